"""The performance benchmarks' workload: MLP training steps under pmap and
shard_map, their arguments and placement.

The MLP itself is :mod:`benchmarks.studies.workload`'s (one copy for all
benchmarks). Every benchmark builds the same kind of step, written the way a
user would:

* ``pmap``: params carry a leading device axis; the step computes this
  replica's gradient and hands it to the transform.
* ``shard_map`` (checking, the default): params are replicated ``P()`` and
  cast to varying before ``jax.grad`` (the README's pattern), so the gradient
  is this replica's own and the transform does the reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.studies import workload as studies

AXIS = studies.AXIS
# The one MLP of the benchmarks (the studies' workload), re-exported for the
# step builders below and the sections that build their own steps.
mlp_init = studies.mlp_init
mlp_apply = studies.mlp_apply
mlp_loss = studies.mlp_loss
count_params = studies.count_params
tree_bytes = studies.tree_bytes
replicate = studies.replicate


def adam_and_accumulator_add(
  learning_rate: float = 1e-3,
) -> optax.GradientTransformation:
  """``optax.adam`` plus ``acc += grads`` in its state, hand-written: the
  floor of ``agn``'s step that syncs nothing (the local work it must do: a
  read of the gradient, a read and a write of the accumulator)."""
  adam = optax.adam(learning_rate)

  def init(params):
    return adam.init(params), jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    updates, inner = adam.update(grads, state[0], params)
    return updates, (inner, jax.tree.map(jnp.add, state[1], grads))

  return optax.GradientTransformation(init, update)


def pmap_step(
  tx: optax.GradientTransformation,
  *,
  hand_written: bool = False,
  devices=None,
  donate: bool = False,
) -> Callable:
  """``pmap``-ed ``(params, opt_state, x, y) -> (params, opt_state)``.

  ``hand_written`` replaces the shardopt transform by what a user would write
  without it: ``jax.lax.pmean(grads, axis)`` before ``tx`` (a plain optax
  optimizer). ``donate`` donates params and state (the caller must not reuse
  them).
  """

  def step(params, opt_state, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    if hand_written:
      grads = jax.lax.pmean(grads, AXIS)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.pmap(
    step,
    axis_name=AXIS,
    devices=devices,
    donate_argnums=(0, 1) if donate else (),
  )


def pmap_setup(tx, sizes: Sequence[int], per_replica: int):
  """The pmap step of ``tx`` on an MLP of ``sizes`` and its arguments
  (params, state, a batch of ``per_replica`` rows per replica), placed by
  pmap itself so the timed calls do not recompile."""
  n = jax.device_count()
  identity = jax.pmap(lambda t: t)
  params = identity(replicate(mlp_init(jax.random.key(0), sizes), n))
  x, y = batch(jax.random.key(1), n, per_replica, sizes[0], sizes[-1])
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  return pmap_step(tx), (params, state) + identity((x, y))


def shard_map_step(
  tx: optax.GradientTransformation,
  mesh,
  *,
  hand_written: bool = False,
  per_replica_out: bool = False,
) -> Callable:
  """Jitted checking ``shard_map`` step over replicated params.

  ``hand_written``: ``jax.lax.pmean`` of the (varying) gradient, then ``tx``.
  ``per_replica_out``: return params and state with a leading replica axis
  (``P(axis)``), for transforms whose results differ between replicas
  (``axis_index_groups``: each group has its own values).
  """

  def step(params, opt_state, x, y):
    local = jax.lax.pcast(params, AXIS, to="varying")
    grads = jax.grad(mlp_loss)(local, x, y)
    if hand_written:
      grads = jax.lax.pmean(grads, AXIS)
    updates, opt_state = tx.update(grads, opt_state, params)
    out = optax.apply_updates(params, updates), opt_state
    if per_replica_out:
      out = jax.tree.map(lambda a: a[None], out)
    return out

  out_spec = P(AXIS) if per_replica_out else P()
  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P(AXIS), P(AXIS)),
      out_specs=(out_spec, out_spec),
    )
  )


def unstack(tree: Any) -> Any:
  """pmap's stacked layout ``(n, d0, ...)`` -> shard_map's ``(n * d0, ...)``.

  Leaves that are one scalar per replica (step counters, shape ``(n,)``)
  keep replica 0's value: they are the same on every replica.
  """
  return jax.tree.map(
    lambda a: a[0] if a.ndim == 1 else a.reshape((-1,) + a.shape[2:]), tree
  )


def concat_specs(tree: Any) -> Any:
  """Specs of :func:`unstack`'s layout: ``P(AXIS)`` for arrays, ``P()`` for scalars."""
  return jax.tree.map(lambda a: P(AXIS) if jnp.ndim(a) else P(), tree)


def concat_shard_map_step(
  tx: optax.GradientTransformation,
  mesh,
  specs,
  *,
  donate: bool = False,
  sync: int | None = None,
) -> Callable:
  """:func:`pmap_step` on ``jax.jit`` + ``shard_map(check_vma=False)``.

  Params, state and batch are :func:`unstack`-ed: each replica's values are
  a ``P(AXIS)`` block of one global array, scalar counters are ``P()`` (a
  per-replica scalar such as ``hierarchical_local_sgd``'s ``skipped`` leaves
  with replica 0's value), so every replica holds its own params and every
  value is per replica, as under ``pmap``. ``specs``
  are the state's (:func:`concat_specs`). ``donate`` donates params and state
  to ``jax.jit``, which aliases input and output buffers; ``pmap``'s donation
  (jax 0.10, CPU) copies every donated output instead, so a donated ``pmap``
  step pays copies that no training loop on ``jit`` pays. ``sync`` (a
  static int, ``shardopt.due(tx, t)``) builds the host-scheduled program of
  that value; None, the in-graph schedule.
  """
  extra = {} if sync is None else {"sync": sync}

  def step(params, opt_state, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
      out_specs=(P(AXIS), specs),
      check_vma=False,
    ),
    donate_argnums=(0, 1) if donate else (),
  )


def place(tree: Any, mesh, spec=P()) -> Any:
  return jax.device_put(tree, NamedSharding(mesh, spec))


def on_mesh(tree: Any, mesh) -> Any:
  """pmap's stacked layout placed as :func:`unstack`'s ``P(AXIS)`` blocks
  (scalars ``P()``), reshaped on the host: no device op on pmap arrays."""
  tree = unstack(jax.tree.map(np.asarray, tree))
  return jax.tree.map(
    lambda a, spec: place(a, mesh, spec), tree, concat_specs(tree)
  )


def batch(
  key: jax.Array, n: int, per_replica: int, features: int, classes: int
) -> tuple[jax.Array, jax.Array]:
  """A random batch with a leading replica axis: ``(n, per_replica, ...)``."""
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, per_replica, features), jnp.float32)
  y = jax.random.randint(ky, (n, per_replica), 0, classes)
  return x, y
