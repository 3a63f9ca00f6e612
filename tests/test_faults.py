"""Faults: non-finite gradients on one replica, 200 steps of every transform.

Every run is 200 steps of a least-squares model on 8 replicas (one
``jax.shard_map`` over a ``jax.lax.scan``), with a NaN or an inf written into
one replica's gradient at 12 random steps. After every step the reduced state
is checked bit-exactly with ``shardopt.replica_divergence`` (the maximum over
the 200 steps must be exactly 0.0), and at the end across the replica axis
with ``chex.assert_trees_all_equal``; the final params are compared with numpy
references written here (float64) that skip the same steps.

Where the finite check goes matters:

* ``optax.apply_if_finite`` *after* the cross-shard reduce (chained after
  ``cross_shard_mean``, or inside ``cross_shard``) sees the reduced gradient,
  which is non-finite on every replica at once: every replica skips together.
  Wrapped *around* a transform that communicates it would test each replica's
  own gradient and let replicas disagree on whether to run the collective
  (they then wait for each other forever), so it is never put there.
* ``tower`` reduces internally, so the skip-together guard is a predicate made
  the same on every replica (``pmin`` of each replica's finite flag) around the
  whole update.
* ``agn`` leaves a replica whose accumulated gradient is not finite out of
  the sync; params are snapped onto the center after a sync, which also brings
  the bad replica back.

Run with ``pytest -s`` to see the figures.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

AXIS = "batch"
R = 8  # replicas
D = 5  # weights (plus one bias)
B = 4  # examples per replica per step
STEPS = 200
NUM_FAULTS = 12
MAX_CONSECUTIVE = 3  # apply_if_finite's max_consecutive_errors
PERIOD = 4  # agn's communication_period
GLOBAL_MOMENTUM = 0.5  # agn's global optimizer: SGD with momentum (has a state)
SGD_LR = 0.05
ADAM_LR = 0.01
B1, B2, EPS = 0.9, 0.999, 1e-8


# --- Data, faults and numpy references. ---------------------------------------


def _data():
  rng = np.random.default_rng(7)
  x = rng.normal(size=(STEPS, R, B, D)).astype(np.float32)
  true_w = rng.normal(size=D)
  y = (x @ true_w + 0.5 + 0.1 * rng.normal(size=(STEPS, R, B))).astype(
    np.float32
  )
  w0 = rng.normal(size=D).astype(np.float32)
  return x, y, w0


def _faults():
  """(STEPS, R) bool: which replica gets a non-finite gradient at which step,
  and (STEPS,) the value written (NaN, +inf, -inf in turn). Faults are at
  least 2 steps apart, so apply_if_finite never gives up and accepts one."""
  rng = np.random.default_rng(11)
  steps = []
  while len(steps) < NUM_FAULTS:
    s = int(rng.integers(1, STEPS - 1))
    if all(abs(s - t) > 1 for t in steps):
      steps.append(s)
  mask = np.zeros((STEPS, R), bool)
  values = np.zeros([STEPS], np.float32)
  for i, s in enumerate(sorted(steps)):
    mask[s, rng.integers(R)] = True
    values[s] = (np.nan, np.inf, -np.inf)[i % 3]
  return mask, values


def _np_grads(p, x, y):
  """Per-replica gradients of 0.5 * mean((x @ w + b - y)^2); p (R, D + 1)."""
  xa = np.concatenate([x, np.ones(x.shape[:-1] + (1,))], axis=-1)  # (R, B, D+1)
  resid = np.einsum("rbd,rd->rb", xa, p) - y
  return np.einsum("rbd,rb->rd", xa, resid) / x.shape[1]


def _poison(g, mask_t, value):
  g = g.copy()
  g[mask_t] = value
  return g


def _np_sync_sgd(x, y, w0, mask, values):
  """SGD on the mean gradient; a step with any non-finite gradient is skipped."""
  p = np.concatenate([w0, [0.0]]).astype(np.float64)
  for t in range(STEPS):
    g = _poison(_np_grads(np.tile(p, (R, 1)), x[t], y[t]), mask[t], values[t])
    mean = g.mean(axis=0)
    if np.all(np.isfinite(mean)):
      p = p - SGD_LR * mean
  return p


def _np_sync_adam(x, y, w0, mask, values):
  """Adam on the mean gradient; skipped steps leave moments and count alone."""
  p = np.concatenate([w0, [0.0]]).astype(np.float64)
  m, v, count = np.zeros_like(p), np.zeros_like(p), 0
  for t in range(STEPS):
    g = _poison(_np_grads(np.tile(p, (R, 1)), x[t], y[t]), mask[t], values[t])
    mean = g.mean(axis=0)
    if not np.all(np.isfinite(mean)):
      continue
    count += 1
    m = B1 * m + (1 - B1) * mean
    v = B2 * v + (1 - B2) * mean**2
    m_hat, v_hat = m / (1 - B1**count), v / (1 - B2**count)
    p = p - ADAM_LR * m_hat / (np.sqrt(v_hat) + EPS)
  return p


def _np_agn(x, y, w0, mask, values):
  """AGN with local SGD and global SGD with momentum; non-finite replicas left
  out of a sync, params snapped onto the center after each sync. Returns
  (params, center, global momentum trace, skipped)."""
  center = np.concatenate([w0, [0.0]]).astype(np.float64)
  trace = np.zeros_like(center)
  params = np.tile(center, (R, 1))
  accumulator = np.zeros_like(params)
  skipped = 0
  with np.errstate(invalid="ignore", over="ignore"):
    for t in range(STEPS):
      g = _poison(_np_grads(params, x[t], y[t]), mask[t], values[t])
      params = params - SGD_LR * g
      accumulator = accumulator + g
      if (t + 1) % PERIOD == 0:
        normalized = accumulator / PERIOD
        finite = np.all(np.isfinite(normalized), axis=1)
        skipped += int(R - finite.sum())
        if finite.any():
          trace = GLOBAL_MOMENTUM * trace + normalized[finite].mean(axis=0)
          center = center - SGD_LR * trace
        params = np.tile(center, (R, 1))
        accumulator = np.zeros_like(params)
  return params, center, trace, skipped


# --- The 200-step run under shard_map. -----------------------------------------


def _loss(params, x, y):
  pred = x[0] @ params["w"][0] + params["b"][0]
  return 0.5 * jnp.mean((pred - y[0]) ** 2)


def _all_finite(tree):
  return jnp.all(
    jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)])
  )


def _specs(tx, params):
  shapes = jax.eval_shape(
    jax.vmap(tx.init, axis_name=AXIS, axis_size=R),
    jax.tree.map(lambda p: p[:, None], params),
  )
  return jax.tree.map(lambda s: P() if s.ndim == 1 else P(AXIS), shapes)


def _run(mesh, tx, *, reduced, guard=False, snap=False, check_vma=True):
  """200 steps; returns (params, state, per-step divergence of reduced state).

  Args:
    reduced: (params, state) -> the tree that must be the same on every replica.
    guard: skip the whole update on every replica when any replica's gradient
      is not finite (a predicate made replicated with pmin).
    snap: after an agn sync, set params to the center bit for bit.
    check_vma: False runs the shard_map like pmap (every value per replica,
      none typed invariant), so replica_divergence compares every leaf.
  """
  x, y, w0 = _data()
  mask, values = _faults()
  params = {"w": np.tile(w0, (R, 1)), "b": np.zeros([R], np.float32)}
  specs = _specs(tx, params)
  row = P(AXIS)

  def one_step(carry, inputs):
    params, state = carry
    x, y, fault, value = inputs
    grads = jax.grad(_loss)(params, x, y)
    grads = jax.tree.map(lambda g: jnp.where(fault[0], value, g), grads)

    def apply():
      updates, new_state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), new_state

    if guard:
      finite = jax.lax.pmin(_all_finite(grads).astype(jnp.int32), AXIS) > 0
      new_params, new_state = jax.lax.cond(
        finite, apply, lambda: (params, state)
      )
    else:
      new_params, new_state = apply()
    if snap:
      synced = new_state.sync_count > state.sync_count
      new_params = jax.tree.map(
        lambda p, c: jnp.where(synced, c, p), new_params, new_state.center
      )
    divergence = shardopt.replica_divergence(
      reduced(new_params, new_state), AXIS
    )
    return (new_params, new_state), divergence

  def run(params, x, y, mask, values):
    state = tx.init(params)
    (params, state), divergence = jax.lax.scan(
      one_step, (params, state), (x, y, mask, values)
    )
    return params, state, divergence

  steps_row = P(None, AXIS)
  run = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(row, steps_row, steps_row, steps_row, P()),
      out_specs=(row, specs, P()),
      check_vma=check_vma,
    )
  )
  put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  params, state, divergence = run(
    put(params, row),
    put(x, steps_row),
    put(y, steps_row),
    put(mask, steps_row),
    put(values, P()),
  )
  return (
    jax.tree.map(np.asarray, params),
    jax.tree.map(np.asarray, state),
    np.asarray(divergence),
  )


def _flat(params):
  return np.concatenate([params["w"], params["b"][:, None]], axis=1)


def _assert_rows_equal(tree, what):
  """Bit-identity across the replica axis (axis 0 of every leaf)."""
  for leaf in jax.tree.leaves(tree):
    chex.assert_trees_all_equal(*list(leaf), custom_message=what)


def _report(name, divergence, skipped):
  print(
    f"\n[faults] {name}: {STEPS} steps, {NUM_FAULTS} non-finite gradients"
    f" injected on one replica, {skipped} skipped,"
    f" max replica_divergence = {float(divergence.max())}"
  )


# --- Tests. --------------------------------------------------------------------


def _fault_count():
  return int(_faults()[0].any(axis=1).sum())


CHECK_VMA = pytest.mark.parametrize(
  "check_vma", [True, False], ids=["check_vma", "no_check_vma"]
)


@CHECK_VMA
def test_apply_if_finite_after_cross_shard_mean_skips_on_every_replica(
  mesh, check_vma
):
  tx = optax.chain(
    shardopt.cross_shard_mean(AXIS),
    optax.apply_if_finite(optax.sgd(SGD_LR), MAX_CONSECUTIVE),
  )
  params, state, divergence = _run(
    mesh, tx, reduced=lambda p, s: (p, s), check_vma=check_vma
  )
  total_skipped = state[1].total_notfinite
  _report(
    f"chain(cross_shard_mean, apply_if_finite(sgd)), {check_vma=}",
    divergence,
    int(total_skipped),
  )
  assert divergence.shape == (STEPS,) and float(divergence.max()) == 0.0
  assert int(total_skipped) == _fault_count() == NUM_FAULTS
  _assert_rows_equal(params, "params differ across replicas")
  np.testing.assert_allclose(
    _flat(params)[0], _np_sync_sgd(*_data(), *_faults()), rtol=1e-4, atol=1e-5
  )


def test_apply_if_finite_inside_cross_shard_adam_skips_on_every_replica(mesh):
  # check_vma=False: with per-replica (varying) params, adam's moments are
  # varying while the reduced gradient is invariant, and optax.apply_if_finite's
  # skip branch (zeros like the gradient) then fails the cond's type check
  # under a checking shard_map. With replicated P() params, or under pmap or
  # check_vma=False as here, the composition works.
  tx = shardopt.cross_shard(
    optax.apply_if_finite(
      optax.adam(ADAM_LR, b1=B1, b2=B2, eps=EPS), MAX_CONSECUTIVE
    ),
    AXIS,
  )
  params, state, divergence = _run(
    mesh, tx, reduced=lambda p, s: (p, s), check_vma=False
  )
  _report(
    "cross_shard(apply_if_finite(adam)), check_vma=False",
    divergence,
    int(state.total_notfinite),
  )
  assert float(divergence.max()) == 0.0
  assert int(state.total_notfinite) == NUM_FAULTS
  adam_state = state.inner_state[0]
  assert int(adam_state.count) == STEPS - NUM_FAULTS  # skipped steps: no count
  _assert_rows_equal(
    (params, adam_state.mu, adam_state.nu),
    "params or moments differ across replicas",
  )
  np.testing.assert_allclose(
    _flat(params)[0], _np_sync_adam(*_data(), *_faults()), rtol=1e-4, atol=1e-5
  )


@CHECK_VMA
def test_tower_adam_with_a_replicated_finite_guard_skips_on_every_replica(
  mesh, check_vma
):
  tx = shardopt.tower(optax.adam(ADAM_LR, b1=B1, b2=B2, eps=EPS), AXIS)
  # The optimizer state is sharded (each replica owns a slice), so the state
  # that must agree across replicas is the params.
  params, state, divergence = _run(
    mesh, tx, reduced=lambda p, s: p, guard=True, check_vma=check_vma
  )
  _report(
    f"tower(adam) under a pmin finite guard, {check_vma=}",
    divergence,
    STEPS - int(state[0].count),
  )
  assert float(divergence.max()) == 0.0
  assert int(state[0].count) == STEPS - NUM_FAULTS
  _assert_rows_equal(params, "params differ across replicas")
  np.testing.assert_allclose(
    _flat(params)[0], _np_sync_adam(*_data(), *_faults()), rtol=1e-4, atol=1e-5
  )


@CHECK_VMA
def test_agn_leaves_the_bad_replica_out_of_the_sync(mesh, check_vma):
  tx = shardopt.agn(
    optax.sgd(SGD_LR),
    AXIS,
    sync_period=PERIOD,
    global_optimizer=optax.sgd(SGD_LR, momentum=GLOBAL_MOMENTUM),
  )
  params, state, divergence = _run(
    mesh,
    tx,
    reduced=lambda p, s: (s.center, s.global_state),
    snap=True,
    check_vma=check_vma,
  )
  want_params, want_center, want_trace, want_skipped = _np_agn(
    *_data(), *_faults()
  )
  _report(
    f"agn(sgd), communication_period 4, center and global state, {check_vma=}",
    divergence,
    int(state.skipped),
  )
  assert float(divergence.max()) == 0.0
  assert int(state.skipped) == want_skipped > 0
  assert int(state.sync_count) == STEPS // PERIOD
  center = _flat(state.center)
  assert np.all(np.isfinite(center))
  _assert_rows_equal(
    (state.center, state.global_state), "center differs across replicas"
  )
  np.testing.assert_allclose(center[0], want_center, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(
    _flat(state.global_state[0].trace)[0], want_trace, rtol=1e-4, atol=1e-5
  )
  # 200 is a multiple of the period: the run ends on a sync, so after the snap
  # every replica (the bad ones included) holds the center, bit for bit.
  assert STEPS % PERIOD == 0
  np.testing.assert_array_equal(_flat(params), center)
  np.testing.assert_allclose(_flat(params), want_params, rtol=1e-4, atol=1e-5)
