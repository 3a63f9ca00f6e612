"""A tiny, deterministic data-parallel training run shared by the reliability tests.

The same functions run in the pytest process (8 local CPU devices), in the
two processes of ``multiprocess_worker.py`` (2 x 4 devices over
``jax.distributed``) and in ``train_with_checkpoints.py`` (killed and
restarted), so that their results can be compared with each other.

Layout, under ``jax.shard_map`` over a 1-D mesh ``("batch",)`` of 8 devices:
every replica holds its own params (a leading replica axis sharded over
"batch": ``w`` is ``(8, DIM)``, ``b`` is ``(8,)``), so they are typed varying
and ``agn`` can let them drift apart between syncs. State leaves that are
scalars on a replica (step counters) are replicated (``P()``); every other
state leaf is sharded over "batch".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

AXIS = "batch"
NUM_REPLICAS = 8
DIM = 5  # weights per replica (plus one bias)
BATCH = 4  # examples per replica per step
EXAMPLES = 24  # examples per replica per epoch
AGN_PERIOD = 4  # communication_period of the "agn" run
SEED = 20240611

# Each entry builds a fresh transform. Learning rates are small enough that
# 40 steps stay far from overflow, large enough that every step moves params.
TRANSFORMS = {
  "cross_shard_mean": lambda: optax.chain(
    shardopt.cross_shard_mean(AXIS), optax.sgd(0.05)
  ),
  "tower_adam": lambda: shardopt.tower(optax.adam(0.02), AXIS),
  "agn": lambda: shardopt.agn(optax.sgd(0.05), AXIS, sync_period=AGN_PERIOD),
}


# The transforms of the kill-one-process test (tests/test_process_faults.py),
# trained side by side in two processes of 4 devices. An entry whose
# transform this shardopt lacks is left out, and the test reports it as
# skipped: extend the list here, nowhere else.
HIERARCHY = {2: NUM_REPLICAS // 2, 4: NUM_REPLICAS}  # period -> group size
FAULT_TRANSFORMS = {
  "cross_shard_adam": (
    "cross_shard",
    lambda: shardopt.cross_shard(optax.adam(0.02), AXIS),
  ),
  "tower_adam": ("tower", TRANSFORMS["tower_adam"]),
  "agn": ("agn", TRANSFORMS["agn"]),
  # Inner level (groups of 4 = the devices of one process) every 2 steps,
  # outer level (all 8, across the two processes) every 4 steps.
  "hierarchical_local_sgd": (
    "hierarchical_local_sgd",
    lambda: shardopt.hierarchical_local_sgd(
      optax.sgd(0.05), AXIS, period_group_sizes=HIERARCHY
    ),
  ),
  "accumulate_cross_shard_adam": (
    "accumulate",
    lambda: shardopt.accumulate(
      shardopt.cross_shard(optax.adam(0.02), AXIS), 4
    ),
  ),
}


def available_fault_transforms() -> tuple[list[str], list[str]]:
  """(names whose shardopt function exists, names skipped as missing)."""
  have = [
    n for n, (attr, _) in FAULT_TRANSFORMS.items() if hasattr(shardopt, attr)
  ]
  return have, [n for n in FAULT_TRANSFORMS if n not in have]


def _make_transform(name: str):
  if name in TRANSFORMS:
    return TRANSFORMS[name]()
  return FAULT_TRANSFORMS[name][1]()


def make_mesh() -> jax.sharding.Mesh:
  """The global 1-D mesh over all devices of all processes."""
  return jax.make_mesh((NUM_REPLICAS,), (AXIS,))


# --- Data: an epoch-shuffled dataset whose position is part of a checkpoint. --


def _dataset():
  rng = np.random.default_rng(SEED)
  x = rng.normal(size=(NUM_REPLICAS, EXAMPLES, DIM)).astype(np.float32)
  true_w = rng.normal(size=(NUM_REPLICAS, DIM)).astype(np.float32)
  noise = 0.1 * rng.normal(size=(NUM_REPLICAS, EXAMPLES))
  y = (np.einsum("red,rd->re", x, true_w) + noise).astype(np.float32)
  return x, y


_DATA = _dataset()


def initial_data_position() -> np.ndarray:
  """(epoch, batch index within the epoch) of the next batch."""
  return np.zeros([2], np.int32)


def next_batch(position: np.ndarray):
  """The batch at ``position`` (every replica its own rows) and the next position.

  Each epoch visits the examples in the order of a permutation drawn from
  ``(SEED, epoch)``, so resuming needs the position, not just the step.
  """
  epoch, index = int(position[0]), int(position[1])
  order = np.random.default_rng([SEED, epoch]).permutation(EXAMPLES)
  rows = order[index * BATCH : (index + 1) * BATCH]
  x, y = _DATA[0][:, rows], _DATA[1][:, rows]
  index += 1
  if index * BATCH >= EXAMPLES:
    epoch, index = epoch + 1, 0
  return (x, y), np.array([epoch, index], np.int32)


def initial_params() -> dict:
  """The same starting params on every replica (what ``broadcast`` would give)."""
  w0 = np.random.default_rng(SEED + 1).normal(size=DIM).astype(np.float32)
  return {
    "w": np.tile(w0, (NUM_REPLICAS, 1)),
    "b": np.zeros([NUM_REPLICAS], np.float32),
  }


def put(mesh, tree, spec=P(AXIS)):
  """Places host numpy arrays as global arrays; works with several processes."""
  sharding = NamedSharding(mesh, spec)

  def leaf(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  return jax.tree.map(leaf, tree)


def fetch(tree):
  """Global arrays back to host numpy (all processes get the whole array)."""
  from jax.experimental import multihost_utils

  def leaf(x):
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.sharding.is_fully_replicated:
      return np.asarray(x.addressable_shards[0].data)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(leaf, tree)


# --- The training step. -------------------------------------------------------


def loss_fn(params, x, y):
  """Least squares on this replica's rows; params hold one row per replica."""
  pred = x[0] @ params["w"][0] + params["b"][0]
  return 0.5 * jnp.mean((pred - y[0]) ** 2)


def state_specs(tx, params):
  """Every state leaf ``P("batch")``: the whole state under ``P(axis)``.

  A leaf that is a scalar on a replica (a step counter; the skip counter of
  ``hierarchical_local_sgd``, which differs between groups) travels stacked,
  one element per replica (see :func:`_stack_scalars`).
  """
  del params
  return jax.tree.map(lambda _: P(AXIS), _replica_shapes(tx))


def _replica_shapes(tx):
  """Shapes of ``tx.init``'s state on one replica (traced with the axis bound)."""
  per_replica = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((NUM_REPLICAS, 1) + x.shape[1:], x.dtype),
    initial_params(),
  )
  stacked = jax.eval_shape(
    jax.vmap(tx.init, axis_name=AXIS, axis_size=NUM_REPLICAS), per_replica
  )
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), stacked
  )


def _stack_scalars(state):
  """Scalars on a replica -> shape ``(1,)``, so they can leave with P(axis)."""
  return jax.tree.map(lambda x: x[None] if x.ndim == 0 else x, state)


def _unstack_scalars(state, shapes):
  """Inverse of :func:`_stack_scalars`: the transform sees its own shapes."""
  return jax.tree.map(
    lambda x, s: x.reshape(()) if s.ndim == 0 else x, state, shapes
  )


class Run:
  """One transform's jitted ``init`` and ``step`` over a mesh."""

  def __init__(self, name: str, mesh):
    self.name = name
    self.mesh = mesh
    self.tx = _make_transform(name)
    self.specs = state_specs(self.tx, initial_params())
    tx = self.tx
    shapes = _replica_shapes(tx)

    def init(params):
      return _stack_scalars(tx.init(params))

    def step(params, state, x, y):
      grads = jax.grad(loss_fn)(params, x, y)
      state = _unstack_scalars(state, shapes)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), _stack_scalars(state)

    row = P(AXIS)
    self.init = jax.jit(
      jax.shard_map(init, mesh=mesh, in_specs=row, out_specs=self.specs)
    )
    self.step = jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(row, self.specs, row, row),
        out_specs=(row, self.specs),
      )
    )

  def start(self):
    """Fresh (params, state) as global arrays."""
    params = put(self.mesh, initial_params())
    return params, self.init(params)

  def advance(self, params, state, batch):
    """One training step on ``batch`` (host arrays, as ``next_batch`` gives)."""
    x, y = put(self.mesh, batch)
    return self.step(params, state, x, y)


def train(name: str, mesh, steps: int):
  """An uninterrupted run of ``steps`` steps; returns host numpy params."""
  run = Run(name, mesh)
  params, state = run.start()
  position = initial_data_position()
  for _ in range(steps):
    batch, position = next_batch(position)
    params, state = run.advance(params, state, batch)
  return fetch(params)
