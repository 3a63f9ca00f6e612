"""Numerical faults in ``accumulate``: NaN/inf on one replica, with and without a guard.

A least-squares model on 8 replicas (``pmap``, one step per call,
``block_until_ready`` after each) trains ``STEPS`` steps of
``accumulate(cross_shard(adam), K)``. At ``FAULTS`` (drawn from a fixed seed:
two in the middle of a period, two on its emit step) one replica's whole
gradient is NaN, +inf or -inf. Three spellings:

* **no guard**, ``accumulate(cross_shard(adam), K)``: the bad replica's
  accumulator turns non-finite, the emit step's all-reduce spreads it, and
  every replica applies the same non-finite update: params and adam's
  moments are NaN on every replica from the first faulty period's emit step
  on, *identically* (``replica_divergence`` stays exactly 0). Training is
  lost; the replicas still agree.
* **guard outside**, ``apply_if_finite(accumulate(cross_shard(adam), K))``:
  the faulty mini-step is dropped whole on every replica (not accumulated,
  ``mini_step`` not advanced), so that period waits one more step for its
  K-th finite gradient. The finite flag is a 4-byte all-reduce on *every*
  mini-step, and the emit steps move with the data.
* **guard inside**, ``accumulate(apply_if_finite(cross_shard(adam)), K)``:
  the guard sees the accumulated gradients at the emit step, so a period with
  a fault anywhere in it is skipped whole on every replica (adam's moments
  and count are left as they were); the next period starts from a fresh
  accumulator. Mini-steps communicate nothing (the flag's all-reduce sits in
  the emit branch), the emit schedule stays ``K, 2K, ...``, and that is what
  PyTorch's ``GradScaler`` and DeepSpeed do with accumulation (check the
  accumulated gradients at the boundary, skip the whole step). It is the
  order we recommend (docs/reliability.md).

Each run is checked against a numpy float64 reference that skips the same
steps; ``replica_divergence`` of params and of every state leaf that is the
same on every replica by design (all but ``acc_grads``, each replica's local
sum) is exactly 0.0 after every step. The HLO test counts what each order
communicates outside its conds. Run with ``pytest -s`` to see the figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiled import compiled_update
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo

AXIS = "batch"
R, D, B = 8, 6, 4
K = 4  # accumulate's every_k_steps
STEPS = 32  # 8 periods
MAX_CONSECUTIVE = 3
LR, B1, B2, EPS = 0.02, 0.9, 0.999, 1e-8


def _data():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(STEPS, R, B, D)).astype(np.float32)
  y = (x @ rng.normal(size=D) + 0.1 * rng.normal(size=(STEPS, R, B))).astype(
    np.float32
  )
  return x, y, rng.normal(size=D).astype(np.float32)


def _faults():
  """(STEPS, R) bool mask, (STEPS,) values and a description.

  Four faulty periods among 1..6 (never the first or the last, so there is
  training before and after), two faults mid-period (mini-step 0, 1 or 2),
  two on the emit step (mini-step K-1), each on one random replica.
  """
  rng = np.random.default_rng(2024)
  periods = sorted(rng.choice(np.arange(1, STEPS // K - 1), 4, replace=False))
  positions = rng.permutation(
    [int(rng.integers(0, K - 1)), int(rng.integers(0, K - 1)), K - 1, K - 1]
  )
  mask = np.zeros((STEPS, R), bool)
  values = np.zeros([STEPS], np.float32)
  where = []
  for i, (period, pos) in enumerate(zip(periods, positions)):
    t = int(period) * K + int(pos)
    replica = int(rng.integers(R))
    mask[t, replica] = True
    values[t] = (np.nan, np.inf, -np.inf)[i % 3]
    where.append(
      f"step {t} ({'emit' if pos == K - 1 else f'mini-step {pos}'}"
      f", replica {replica}, {values[t]})"
    )
  return mask, values, where


def _adam():
  return optax.adam(LR, b1=B1, b2=B2, eps=EPS)


SPELLINGS = {
  "no guard": lambda: shardopt.accumulate(
    shardopt.cross_shard(_adam(), AXIS), K
  ),
  "guard outside": lambda: shardopt.apply_if_finite(
    shardopt.accumulate(shardopt.cross_shard(_adam(), AXIS), K),
    MAX_CONSECUTIVE,
    axis_name=AXIS,
  ),
  "guard inside": lambda: shardopt.accumulate(
    shardopt.apply_if_finite(
      shardopt.cross_shard(_adam(), AXIS), MAX_CONSECUTIVE, axis_name=AXIS
    ),
    K,
  ),
}


def _accumulate_state(spelling, state):
  return state.inner_state if spelling == "guard outside" else state


def _replicated(spelling, state):
  """Every state leaf that must be the same on every replica: all but
  accumulate's ``acc_grads`` (each replica's local running mean)."""
  acc = _accumulate_state(spelling, state)._replace(acc_grads=())
  if spelling == "guard outside":
    return state._replace(inner_state=acc)
  return acc


def _loss(w, x, y):
  return 0.5 * jnp.mean((jnp.einsum("...bd,...d->...b", x, w) - y) ** 2)


def _train(spelling, mapping="pmap"):
  """STEPS steps; params per step (STEPS, R, D), divergence per step, state."""
  tx = SPELLINGS[spelling]()
  x, y, w0 = _data()
  mask, values, _ = _faults()

  def one_step(w, state, x, y, fault, value):
    grads = jnp.where(fault, value, jax.grad(_loss)(w, x, y))
    updates, state = tx.update(grads, state, w)
    w = optax.apply_updates(w, updates)
    divergence = shardopt.replica_divergence(
      (w, _replicated(spelling, state)), AXIS
    )
    return w, state, divergence

  w = jnp.tile(w0, (R, 1))
  state = jax.pmap(tx.init, axis_name=AXIS)(w)
  if mapping == "pmap":
    step = jax.pmap(one_step, axis_name=AXIS, in_axes=(0, 0, 0, 0, 0, None))
    put = lambda v: v
  else:  # a checking shard_map, the whole state stacked under P(AXIS)
    mesh = jax.make_mesh((R,), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    put = lambda v: jax.device_put(v, sharding)

    def body(w, state, x, y, fault, value):  # a leading 1 on every input
      w, state, divergence = one_step(w, state, x, y, fault[:, None], value)
      return w, state, divergence[None]

    step = jax.jit(
      jax.shard_map(
        body, mesh=mesh, in_specs=(P(AXIS),) * 5 + (P(),), out_specs=P(AXIS)
      )
    )
    w, state = put(w), put(state)
  history, divergence, emitted = [], [], []
  for t in range(STEPS):
    before = int(
      np.asarray(_accumulate_state(spelling, state).gradient_step).ravel()[0]
    )
    w, state, div = step(
      w, state, put(x[t]), put(y[t]), put(mask[t]), values[t]
    )
    jax.block_until_ready((w, state))
    history.append(np.asarray(w))
    divergence.append(float(np.max(np.asarray(div))))
    after = int(
      np.asarray(_accumulate_state(spelling, state).gradient_step).ravel()[0]
    )
    emitted.append(after > before)
  return (
    np.stack(history),
    np.asarray(divergence),
    np.asarray(emitted),
    jax.tree.map(np.asarray, state),
  )


def _np_grads(w, x, y):
  """Per-replica gradients of 0.5 * mean((x @ w - y)^2): (R, D)."""
  return np.einsum("rbd,rb->rd", x, x @ w - y) / x.shape[1]


def _np_reference(spelling):
  """numpy float64 Adam on the replica-mean of K accumulated gradients.

  "guard outside": a mini-step with a non-finite gradient is dropped;
  "guard inside": a period with one is skipped whole. Returns params per step,
  which steps emitted, and how many adam steps were applied.
  """
  x, y, w0 = _data()
  mask, values, _ = _faults()
  w = w0.astype(np.float64)
  m, v, count = np.zeros_like(w), np.zeros_like(w), 0
  pending, period_ok, history, emitted = [], True, [], []
  for t in range(STEPS):
    g = _np_grads(w, x[t], y[t])
    g[mask[t]] = values[t]
    finite = bool(np.all(np.isfinite(g)))
    emit = False
    if spelling == "guard outside" and not finite:
      pass  # dropped: not accumulated
    else:
      period_ok &= finite
      pending.append(g.mean(axis=0) if finite else None)
      if len(pending) == K:
        emit = True
        if period_ok:
          mean = np.mean(pending, axis=0)
          count += 1
          m = B1 * m + (1 - B1) * mean
          v = B2 * v + (1 - B2) * mean**2
          w = w - LR * (m / (1 - B1**count)) / (
            np.sqrt(v / (1 - B2**count)) + EPS
          )
        pending, period_ok = [], True
    history.append(w)
    emitted.append(emit)
  return np.stack(history), np.asarray(emitted), count


def _assert_same_on_every_replica(history, divergence):
  assert float(divergence.max()) == 0.0, divergence
  for r in range(1, R):
    np.testing.assert_array_equal(history[:, r], history[:, 0])


def _print(spelling, mapping, divergence, extra):
  _, _, where = _faults()
  print(
    f"\n[faults] {spelling}: {SPELLINGS_TEXT[spelling]} under {mapping},"
    f" {STEPS} steps, faults at {', '.join(where)}: {extra};"
    f" max replica_divergence = {float(divergence.max())}"
  )


SPELLINGS_TEXT = {
  "no guard": f"accumulate(cross_shard(adam), {K})",
  "guard outside": f"apply_if_finite(accumulate(cross_shard(adam), {K}))",
  "guard inside": f"accumulate(apply_if_finite(cross_shard(adam)), {K})",
}


def test_faults_cover_mid_period_and_emit_steps():
  mask, _, where = _faults()
  positions = sorted(int(t) % K for t in np.nonzero(mask.any(axis=1))[0])
  assert mask.sum() == 4 and mask.any(axis=1).sum() == 4, where
  assert positions.count(K - 1) == 2 and max(positions[:2]) < K - 1, where


def test_without_a_guard_a_nan_poisons_every_replica_identically():
  history, divergence, emitted, state = _train("no guard")
  mask, _, _ = _faults()
  first = int(np.nonzero(mask.any(axis=1))[0][0])
  poisoned = (first // K + 1) * K - 1  # the emit step of its period
  want, want_emitted, _ = _np_reference("guard inside")
  _print(
    "no guard",
    "pmap",
    divergence,
    f"params finite up to step {poisoned - 1}, NaN on every replica from"
    f" the emit step {poisoned} on",
  )
  _assert_same_on_every_replica(history, divergence)
  np.testing.assert_array_equal(emitted, (np.arange(STEPS) + 1) % K == 0)
  # Before the first faulty period ends: the numbers of a fault-free run.
  np.testing.assert_allclose(
    history[:poisoned, 0], want[:poisoned], rtol=2e-5, atol=2e-6
  )
  # From its emit step on: non-finite everywhere, adam's moments too.
  assert np.all(np.isnan(history[poisoned:]))
  mu = state.inner_state[0].mu
  assert np.all(np.isnan(mu)), mu


@pytest.mark.parametrize(
  "spelling, mapping",
  [
    ("guard outside", "pmap"),
    ("guard inside", "pmap"),
    ("guard inside", "shard_map"),
  ],
)
def test_a_guarded_accumulate_skips_on_every_replica_and_matches_numpy(
  spelling, mapping
):
  history, divergence, emitted, state = _train(spelling, mapping)
  want, want_emitted, adam_steps = _np_reference(spelling)
  faulty_steps = int(_faults()[0].any(axis=1).sum())
  if spelling == "guard outside":
    guard, acc = state, state.inner_state
    adam_count = int(acc.inner_state[0].count.ravel()[0])
    skipped = f"{faulty_steps} mini-steps dropped"
  else:
    acc = state
    guard = state.inner_state
    adam_count = int(guard.inner_state[0].count.ravel()[0])
    skipped = f"{int(guard.total_notfinite.ravel()[0])} periods skipped whole"
  _print(
    spelling,
    mapping,
    divergence,
    f"{skipped}; emit steps {np.nonzero(emitted)[0].tolist()}; adam steps"
    f" {adam_count} of {int(acc.gradient_step.ravel()[0])} updates",
  )
  _assert_same_on_every_replica(history, divergence)
  np.testing.assert_array_equal(emitted, want_emitted)
  assert adam_count == adam_steps
  np.testing.assert_array_equal(
    guard.total_notfinite.ravel(),
    faulty_steps if spelling == "guard outside" else 4,
  )  # four faulty periods
  assert np.all(np.isfinite(history))
  np.testing.assert_allclose(history[:, 0], want, rtol=2e-5, atol=2e-6)


def test_only_the_inner_guard_keeps_the_mini_steps_free_of_communication():
  counts = {}
  for spelling in ("guard outside", "guard inside"):
    ops = hlo.compiled_collectives(
      compiled_update(SPELLINGS[spelling](), "pmap", 1024), num_devices=R
    )
    counts[spelling] = (
      [(o.kind, o.buffer_bytes) for o in ops if o.context == "top"],
      sum(o.buffer_bytes for o in ops if "conditional" in o.context),
    )
  print(
    f"\n[hlo] collectives outside any cond (every mini-step) and inside:"
    f" {counts}"
  )
  # Outside: the 4-byte finite flag on every mini-step.
  assert counts["guard outside"][0] == [("all-reduce", 4)]
  # Inside: nothing on a mini-step, the flag and the update (1024 floats) in
  # the emit branch (XLA may combine the two all-reduces into one).
  assert counts["guard inside"][0] == []
  assert counts["guard inside"][1] == 4 + 1024 * 4


def test_the_accumulate_entry_of_the_kill_one_process_test_trains(mesh):
  """tests/test_process_faults.py compares final params bit for bit; make
  sure its accumulate entry is there and moves them (4 updates in 16 steps),
  the same on every replica, so that comparison is not vacuous."""
  from _workers import tiny_training

  have, _ = tiny_training.available_fault_transforms()
  assert "accumulate_cross_shard_adam" in have
  params = tiny_training.train("accumulate_cross_shard_adam", mesh, 16)
  start = tiny_training.initial_params()
  for key in ("w", "b"):
    assert not np.array_equal(params[key], start[key]), key
    for r in range(1, R):
      np.testing.assert_array_equal(params[key][r], params[key][0])
  # 15 steps: the fourth period has not emitted, so one update less.
  fewer = tiny_training.train("accumulate_cross_shard_adam", mesh, 15)
  twelve = tiny_training.train("accumulate_cross_shard_adam", mesh, 12)
  np.testing.assert_array_equal(fewer["w"], twelve["w"])
  assert not np.array_equal(params["w"], twelve["w"])
