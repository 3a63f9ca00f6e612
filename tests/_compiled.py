"""A transform's compiled ``update``, for the tests that read its HLO.

Shared by tests/test_accumulate.py, tests/test_finite.py,
tests/test_faults_accumulate.py and tests/test_schedules.py: the update
compiled with the gradients (and the state) as inputs, under ``pmap`` or a
``shard_map`` over 8 devices; the ``shard_map`` state specs an update needs;
and the bytes a whole training step copies when it does not sync.
"""

from __future__ import annotations

import _mlp
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardopt import _axes
from shardopt.measure import hlo

AXIS = "batch"
R = 8


def _put(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


def varying_state_specs(tx, mesh, w, g_spec):
  """P(AXIS) for every state leaf that an update leaves varying, else P()."""
  specs = {}

  def probe(w, g):
    state = tx.init(w)
    new_state = tx.update(g, state, w)[1]
    specs["state"] = jax.tree.map(
      lambda a, b: (
        P(AXIS) if _axes.varying_axes(a) | _axes.varying_axes(b) else P()
      ),
      state,
      new_state,
    )
    return jnp.zeros([])

  g = jax.ShapeDtypeStruct(
    (R * w.shape[0],) if g_spec != P() else w.shape,
    w.dtype,
    sharding=NamedSharding(mesh, g_spec),
  )
  jax.eval_shape(
    jax.shard_map(probe, mesh=mesh, in_specs=(P(), g_spec), out_specs=P()), w, g
  )
  return specs["state"]


def compiled_update(tx, spelling, size=4096):
  """HLO text of tx.update compiled with the gradients (and state) as inputs."""
  w = jnp.zeros([size], jnp.float32)
  if spelling == "pmap":
    stacked = jnp.zeros([R, size], jnp.float32)
    state = jax.pmap(tx.init, axis_name=AXIS)(stacked)
    f = jax.pmap(lambda g, s, w: tx.update(g, s, w), axis_name=AXIS)
    return f.lower(stacked, state, stacked).compile().as_text()
  mesh = jax.make_mesh((R,), (AXIS,))
  # "invariant": P() params, the gradient autodiff gives them (already summed,
  # typed invariant). "varying": P() params cast to varying before jax.grad.
  g_spec = P() if spelling == "invariant" else P(AXIS)
  specs = varying_state_specs(tx, mesh, w, g_spec)
  state = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  )(w)
  f = jax.jit(
    jax.shard_map(
      lambda g, s, w: tx.update(g, s, w),
      mesh=mesh,
      in_specs=(g_spec, specs, P()),
      out_specs=(P(), specs),
    )
  )
  g = _put(mesh, jnp.zeros([R * size] if g_spec != P() else [size]), g_spec)
  return f.lower(g, state, _put(mesh, w, P())).compile().as_text()


def non_sync_copied_bytes(tx, sizes, donate):
  """Bytes XLA copies on a step that does not sync: copies at the top level
  and in the branch each cond takes without a sync (its false branch).

  The step is a training loop's, ``jax.jit`` over ``shard_map`` with params
  and state donated or not (pmap on CPU copies every donated output), on
  tests/_mlp.py's MLP.
  """
  mesh = jax.make_mesh((R,), (AXIS,))

  on_mesh = lambda tree: _mlp.on_mesh(tree, mesh)
  stacked = _mlp.replicate(_mlp.mlp_init(jax.random.key(0), sizes), R)
  state = on_mesh(jax.pmap(tx.init, axis_name=AXIS)(stacked))
  step = _mlp.concat_shard_map_step(
    tx, mesh, _mlp.concat_specs(state), donate=donate
  )
  batch = on_mesh(_mlp.batch(jax.random.key(1), R, 4, *sizes[::2]))
  text = step.lower(on_mesh(stacked), state, *batch).compile().as_text()
  copies = hlo.copied_bytes(text)
  return copies["top"] + sum(
    size
    for branch, size in copies["conditional"].items()
    if branch.endswith("#0")
  )
