"""8 replicas on a quadratic each, run by a periodic transform under
``jax.pmap`` or jit + ``jax.shard_map``: the runs the numpy references of
tests/test_noloco.py and tests/test_eager.py are compared with.

Each replica's loss is ``0.5 * |params - target_t|^2`` summed over leaves
(its own target every step); a run returns, per step and replica, the
params, the transform's ``center`` and the ``replica_divergence`` of the
params, as numpy arrays with the step first and the replica second.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

R = 8  # replicas
AXIS = "batch"


def loss(params, targets):
  return sum(
    0.5 * jnp.sum((p - y) ** 2)
    for p, y in zip(jax.tree.leaves(params), jax.tree.leaves(targets))
  )


def _body(tx):
  def body(carry, targets):
    params, state = carry
    grads = jax.grad(loss)(params, targets)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    div = shardopt.replica_divergence(params, AXIS)
    return (params, state), (params, state.center, div)

  return body


def stack(params):
  """``params`` repeated for every replica (a leading axis of R)."""
  return jax.tree.map(lambda p: np.broadcast_to(p, (R,) + p.shape), params)


def pmap_history(tx, params0, targets):
  """(params, center, divergence) after every step under ``jax.pmap``;
  ``targets`` leaves are (steps, R, ...)."""

  def run(params, targets):
    _, history = jax.lax.scan(_body(tx), (params, tx.init(params)), targets)
    return history

  out = jax.pmap(run, axis_name=AXIS)(
    stack(params0), jax.tree.map(lambda v: v.swapaxes(0, 1), targets)
  )
  return jax.tree.map(lambda v: np.swapaxes(np.asarray(v), 0, 1), out)


def shard_map_history(tx, mesh, params0, targets):
  """(params, center, divergence) after every step under jit +
  ``jax.shard_map`` over ``mesh``'s axis; the divergence as replica 0
  computed it."""

  def run(params, targets):
    _, (p, c, div) = jax.lax.scan(_body(tx), (params, tx.init(params)), targets)
    return p, c, div[None]

  per_step = P(None, AXIS)
  run = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P(AXIS), per_step),
      out_specs=(per_step, per_step, P(AXIS)),
    )
  )
  p, c, div = run(
    jax.device_put(stack(params0), NamedSharding(mesh, P(AXIS))),
    jax.device_put(targets, NamedSharding(mesh, per_step)),
  )
  return jax.tree.map(np.asarray, (p, c)) + (np.asarray(div)[0],)
