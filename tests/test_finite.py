"""shardopt.all_finite and shardopt.apply_if_finite: every replica agrees.

References: numpy (which replicas hold a NaN; an optimizer that skips the
same steps), ``optax.apply_if_finite`` where the inner transform does not
communicate, and the compiled HLO (what runs outside the cond). The fault
runs execute in a child process under a timeout, so a deadlock fails the test
instead of hanging the suite. Run with ``pytest -s`` to see the figures.
"""

import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiled import compiled_update
from _compiled import non_sync_copied_bytes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt import _axes
from shardopt.measure import hlo
from tests._workers import finite_faults as ff

AXIS = "batch"
R = 8
GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]
WORKER = Path(__file__).resolve().parent / "_workers" / "finite_faults.py"
TIMEOUT_S = 240  # a run takes ~5 s; a deadlock never ends


def _mesh():
  return jax.make_mesh((R,), (AXIS,))


def _grads_with_nan_on(replica):
  g = np.ones((R, 3), np.float32)
  g[replica, 1] = np.nan
  return g


# --- all_finite. ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, 2, 6])
def test_all_finite_agrees_on_every_replica_under_pmap(bad):
  g = (
    _grads_with_nan_on(bad) if bad is not None else np.ones((R, 3), np.float32)
  )
  f = jax.pmap(
    lambda g: (
      shardopt.all_finite({"g": g}, AXIS),
      shardopt.all_finite({"g": g}, AXIS, axis_index_groups=GROUPS),
    ),
    axis_name=AXIS,
  )
  everywhere, grouped = map(np.asarray, f(g))
  np.testing.assert_array_equal(everywhere, np.full(R, bad is None))
  want = [bad not in group for group in GROUPS for _ in group]
  np.testing.assert_array_equal(grouped, want)


def test_all_finite_with_groups_under_checking_shard_map_flags_only_that_group():
  mesh = _mesh()
  f = jax.jit(
    jax.shard_map(
      lambda g: shardopt.all_finite(g, AXIS, axis_index_groups=GROUPS)[None],
      mesh=mesh,
      in_specs=P(AXIS),
      out_specs=P(AXIS),
    )
  )
  g = jax.device_put(_grads_with_nan_on(5), NamedSharding(mesh, P(AXIS)))
  np.testing.assert_array_equal(np.asarray(f(g)), [True] * 4 + [False] * 4)
  # Invariant leaves (the same on every replica) with groups: every group says
  # the same thing, and no error.
  h = jax.jit(
    jax.shard_map(
      lambda w: shardopt.all_finite(w, AXIS, axis_index_groups=GROUPS)[None],
      mesh=mesh,
      in_specs=P(),
      out_specs=P(AXIS),
    )
  )
  np.testing.assert_array_equal(
    np.asarray(h(jnp.array([1.0, jnp.inf]))), [False] * R
  )


def test_all_finite_is_invariant_under_checking_shard_map_with_one_4_byte_all_reduce():
  mesh = _mesh()
  seen = {}

  def f(g):
    flag = shardopt.all_finite(g, AXIS)
    seen["varying"] = _axes.varying_axes(flag)
    return flag  # leaves through out_specs=P(): typed invariant

  f = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P()))
  g = jax.device_put(_grads_with_nan_on(3), NamedSharding(mesh, P(AXIS)))
  assert not bool(f(g)) and seen["varying"] == frozenset()
  ops = hlo.compiled_collectives(f.lower(g).compile().as_text(), num_devices=R)
  print(
    f"\n[hlo] all_finite under shard_map: {[(o.kind, o.buffer_bytes) for o in ops]}"
  )
  assert [(o.kind, o.buffer_bytes) for o in ops] == [("all-reduce", 4)]


def test_all_finite_without_an_axis_tests_this_replica_only():
  assert bool(shardopt.all_finite({"a": jnp.ones(3), "b": None}))
  assert not bool(shardopt.all_finite([jnp.ones(3), jnp.array([jnp.inf])]))
  assert bool(shardopt.all_finite({}))
  with pytest.raises(
    ValueError, match="shardopt.all_finite: axis_index_groups"
  ):
    shardopt.all_finite(jnp.ones(3), axis_index_groups=GROUPS)


# --- apply_if_finite: optax's numbers and state. ------------------------------


def test_same_numbers_and_state_as_optax_apply_if_finite_on_one_device():
  rng = np.random.default_rng(0)
  tx = shardopt.apply_if_finite(optax.adam(0.1), 2, axis_name=None)
  ref = optax.apply_if_finite(optax.adam(0.1), 2)
  w = jnp.asarray(rng.normal(size=4), jnp.float32)
  state, ref_state = tx.init(w), ref.init(w)
  # Three non-finite steps in a row: the third exceeds max_consecutive_errors=2
  # and is applied, as in optax.
  bad = {2, 5, 6, 7, 10}
  for t in range(12):
    g = jnp.asarray(rng.normal(size=4), jnp.float32)
    if t in bad:
      g = g.at[t % 4].set((jnp.nan, jnp.inf)[t % 2])
    updates, state = jax.jit(tx.update)(g, state, w)
    want, ref_state = ref.update(g, ref_state, w)
    chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-7)
    assert type(state) is type(ref_state)
    chex.assert_trees_all_close(state, ref_state, rtol=1e-6, atol=1e-7)
  assert int(state.total_notfinite) == len(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_consecutive_errors_must_be_a_non_negative_integer(bad):
  with pytest.raises(
    ValueError, match="shardopt.apply_if_finite: max_consecutive"
  ):
    shardopt.apply_if_finite(optax.sgd(0.1), bad, axis_name=AXIS)
  shardopt.apply_if_finite(
    optax.sgd(0.1), 0, axis_name=AXIS
  )  # 0: apply the next one


# --- HLO: the guard adds the 4-byte flag and nothing else. ------------------

INNERS = {
  "cross_shard(adam)": lambda: shardopt.cross_shard(optax.adam(0.1), AXIS),
  "tower(adam)": lambda: shardopt.tower(optax.adam(0.1), AXIS),
  "accumulate(cross_shard(adam), 2)": lambda: shardopt.accumulate(
    shardopt.cross_shard(optax.adam(0.1), AXIS), 2
  ),
}


def _bytes_by_branch(tx, spelling) -> dict:
  """Buffer bytes of the compiled update's collectives: ``"top"`` and each
  conditional branch (:func:`shardopt.measure.hlo.by_branch`)."""
  text = compiled_update(tx, spelling, size=1024)
  ops = hlo.compiled_collectives(text, num_devices=R)
  summary = hlo.by_branch(ops, measure=lambda op: op.buffer_bytes)
  return {
    "top": summary["top"],
    **{branch: e["bytes"] for branch, e in summary["branches"].items()},
  }


@pytest.mark.parametrize(
  "spelling, inner",
  [
    ("pmap", "cross_shard(adam)"),
    ("pmap", "tower(adam)"),
    ("pmap", "accumulate(cross_shard(adam), 2)"),
    ("invariant", "tower(adam)"),
    ("varying", "cross_shard(adam)"),
    ("varying", "tower(adam)"),
  ],
)
def test_the_guard_adds_only_the_4_byte_flag_to_the_inner_collectives(
  spelling, inner
):
  """The guard's compiled update moves the unguarded inner's bytes, in the
  same branches (accumulate's all-reduce stays in its emit branch), plus
  the 4-byte flag at the top (which XLA may combine with an all-reduce of
  the inner's): no branch of its own around them."""
  guarded = _bytes_by_branch(
    shardopt.apply_if_finite(INNERS[inner](), 3, axis_name=AXIS), spelling
  )
  bare = _bytes_by_branch(INNERS[inner](), spelling)
  print(
    f"\n[hlo] apply_if_finite({inner}).update, {spelling}: bytes per branch"
    f" {guarded}; unguarded {bare}"
  )
  # Invariant gradients are the same on every replica: the flag needs no
  # all-reduce at all there.
  flag = 0 if spelling == "invariant" else 4
  assert guarded == {**bare, "top": bare["top"] + flag}


# --- The free guard: after the reduce, the decision needs no collective. -------

FAULTS = {  # step: [(replica, value)]: NaN, +-inf, and inf - inf across two
  2: [(3, np.nan)],
  5: [(0, np.inf)],
  6: [(7, -np.inf)],
  9: [(1, np.inf), (4, -np.inf)],
}
STEPS, D, LR = 12, 6, 0.1


def _free_guard(max_consecutive_errors=3):
  return optax.chain(
    shardopt.cross_shard_mean(AXIS),
    shardopt.apply_if_finite(
      optax.adam(LR), max_consecutive_errors, axis_name=None
    ),
  )


def _faulty_grads(seed=21):
  g = np.random.default_rng(seed).normal(size=(STEPS, R, D)).astype(np.float32)
  for t, faults in FAULTS.items():
    for r, v in faults:
      g[t, r, t % D] = v
  return g


def _np_adam_skipping_nonfinite(w0, grads):
  """numpy float64 Adam on the replica mean, skipping non-finite steps."""
  b1, b2, eps = 0.9, 0.999, 1e-8
  w, m, v, count, history = w0.astype(np.float64), 0.0, 0.0, 0, []
  for g in grads.astype(np.float64):
    with np.errstate(invalid="ignore"):
      mean = g.mean(axis=0)
    if np.all(np.isfinite(mean)):
      count += 1
      m = b1 * m + (1 - b1) * mean
      v = b2 * v + (1 - b2) * mean**2
      w = w - LR * (m / (1 - b1**count)) / (np.sqrt(v / (1 - b2**count)) + eps)
    history.append(w)
  return np.stack(history)


def _run_free_guard(tx, mapping, w0, grads):
  """(params per step and replica (STEPS, R, D), total_notfinite per replica,
  max replica_divergence) of ``tx`` trained on ``grads`` (STEPS, R, D)."""

  def run(w, g):  # g: (STEPS, D), this replica's gradients
    def step(carry, g):
      w, state = carry
      updates, state = tx.update(g, state, w)
      w = optax.apply_updates(w, updates)
      mine = jax.lax.pcast(w, AXIS, to="varying") if _axes.vma_checked() else w
      return (w, state), (mine, shardopt.replica_divergence(mine, AXIS))

    (w, state), (history, divergence) = jax.lax.scan(step, (w, tx.init(w)), g)
    total = state[1].total_notfinite
    if _axes.vma_checked():
      assert not _axes.varying_axes(w)  # P() params stay P()
      total = jax.lax.pcast(total, AXIS, to="varying")
    return history[:, None], total[None], jnp.max(divergence)[None]

  if mapping == "pmap":
    out = jax.pmap(run, axis_name=AXIS)(
      jnp.broadcast_to(w0, (R, D)), np.swapaxes(grads, 0, 1)
    )
    history, total, divergence = map(np.asarray, out)
    return history[:, :, 0].swapaxes(0, 1), total[:, 0], divergence.max()
  mesh = jax.make_mesh((R,), (AXIS,))
  f = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P(), P(None, AXIS)),
      out_specs=(P(None, AXIS), P(AXIS), P(AXIS)),
    )
  )
  g = jax.device_put(
    grads.reshape(STEPS, R * D), NamedSharding(mesh, P(None, AXIS))
  )
  history, total, divergence = map(np.asarray, f(w0, g))
  return history.reshape(STEPS, R, D), total, divergence.max()


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_free_guard_after_cross_shard_mean_skips_together_and_equals_numpy(
  mapping,
):
  w0 = np.random.default_rng(20).normal(size=D).astype(np.float32)
  grads = _faulty_grads()
  history, total, divergence = _run_free_guard(
    _free_guard(), mapping, w0, grads
  )
  print(
    f"\n[faults] chain(cross_shard_mean, apply_if_finite(adam, None, 3))"
    f" under {mapping}: {STEPS} steps, {len(FAULTS)} with NaN/inf on one or"
    f" two replicas, total_notfinite={total.tolist()}, max"
    f" replica_divergence={divergence}"
  )
  assert divergence == 0.0
  np.testing.assert_array_equal(total, np.full(R, len(FAULTS)))
  for r in range(1, R):  # bit-identical on every replica, every step
    np.testing.assert_array_equal(history[:, r], history[:, 0])
  for t in FAULTS:  # a skipped step leaves the params as they were
    np.testing.assert_array_equal(history[t, 0], history[t - 1, 0])
  want = _np_adam_skipping_nonfinite(w0, grads)
  np.testing.assert_allclose(history[:, 0], want, rtol=2e-5, atol=5e-6)
  # optax's own guard in the same place (where it is safe: after the reduce).
  theirs = optax.chain(
    shardopt.cross_shard_mean(AXIS), optax.apply_if_finite(optax.adam(LR), 3)
  )
  ref, _, _ = _run_free_guard(theirs, "pmap", w0, grads)
  np.testing.assert_allclose(history[:, 0], ref[:, 0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_free_guard_step_has_exactly_one_all_reduce(mapping):
  tx = _free_guard()
  w = jnp.zeros([D])

  def step(w, state, g):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  if mapping == "pmap":
    stacked = jnp.zeros([R, D])
    state = jax.pmap(tx.init)(stacked)
    f = jax.pmap(step, axis_name=AXIS)
    text = f.lower(stacked, state, stacked).compile().as_text()
  else:
    mesh = jax.make_mesh((R,), (AXIS,))
    f = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P())
      )
    )
    g = jax.device_put(jnp.zeros([R * D]), NamedSharding(mesh, P(AXIS)))
    text = f.lower(w, tx.init(w), g).compile().as_text()
  ops = [
    (o.kind, o.buffer_bytes)
    for o in hlo.compiled_collectives(text, num_devices=R)
  ]
  print(f"\n[hlo] free guard step under {mapping}: {ops}")
  assert ops == [("all-reduce", 4 * D)]  # the gradient's; no flag


# --- Mixed precision: the kept state keeps its dtypes. --------------------------


def test_mixed_precision_state_keeps_its_dtypes_as_multisteps_skip_does():
  """f16 params, f32 gradients, adam's mu_dtype=None (its moments come back
  f32): the guard keeps the old dtypes, as optax.MultiSteps(adam, 1,
  should_skip_update_fn=optax.skip_not_finite) does."""
  rng = np.random.default_rng(22)
  w = jnp.asarray(rng.normal(size=5), jnp.float16)
  tx = shardopt.apply_if_finite(optax.adam(0.1), 3, axis_name=None)
  ref = optax.MultiSteps(
    optax.adam(0.1), 1, should_skip_update_fn=optax.skip_not_finite
  )
  state, ref_state = tx.init(w), ref.init(w)
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  for t in range(6):
    g = jnp.asarray(rng.normal(size=5), jnp.float32)
    if t in (2, 3):
      g = g.at[t].set((jnp.nan, jnp.inf)[t % 2])
    updates, state = update(g, state, w)
    want, ref_state = ref_update(g, ref_state, w)
    chex.assert_trees_all_equal_dtypes(
      state.inner_state, tx.init(w).inner_state
    )
    chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(
      state.inner_state, ref_state.inner_opt_state, rtol=1e-6, atol=1e-7
    )
  assert int(state.total_notfinite) == 2


# --- Faults on one replica: no hang, every replica skips together. ------------


def _run_worker(scenario, mapping, tmp_path):
  out = tmp_path / f"{scenario}_{mapping}.npz"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  root = Path(__file__).resolve().parents[1]
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(root / "src"), str(root), env.get("PYTHONPATH")) if p
  )
  try:
    proc = subprocess.run(
      [sys.executable, str(WORKER), scenario, mapping, str(out)],
      env=env,
      capture_output=True,
      text=True,
      timeout=TIMEOUT_S,
    )
  except subprocess.TimeoutExpired:
    pytest.fail(
      f"{scenario} under {mapping} did not finish in {TIMEOUT_S} s:"
      " the replicas deadlocked"
    )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return dict(np.load(out))


def _np_grads(w, x, y):
  """Per-replica gradients of 0.5 * mean((x @ w - y)^2): (R, D)."""
  return np.einsum("rbd,rb->rd", x, x @ w - y) / x.shape[1]


def _np_adam_skipping(every_k_steps=1):
  """Adam on the replica-mean gradient; a step with a non-finite gradient on
  any replica is skipped (for accumulate: not accumulated either)."""
  x, y, w0 = ff.data()
  mask, values = ff.faults()
  w = w0.astype(np.float64)
  m, v, count, pending, history = np.zeros_like(w), np.zeros_like(w), 0, [], []
  for t in range(ff.STEPS):
    g = _np_grads(w, x[t], y[t])
    g[mask[t]] = values[t]
    if np.all(np.isfinite(g)):
      pending.append(g.mean(axis=0))
      if len(pending) == every_k_steps:
        mean = np.mean(pending, axis=0)
        pending = []
        count += 1
        m = ff.B1 * m + (1 - ff.B1) * mean
        v = ff.B2 * v + (1 - ff.B2) * mean**2
        w = w - ff.LR * (m / (1 - ff.B1**count)) / (
          np.sqrt(v / (1 - ff.B2**count)) + ff.EPS
        )
    history.append(w)
  return np.stack(history)


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
@pytest.mark.parametrize("scenario", ["cross_shard", "tower", "accumulate"])
def test_nan_on_one_replica_every_replica_skips_together(
  scenario, mapping, tmp_path
):
  got = _run_worker(scenario, mapping, tmp_path)
  num_faults = int(ff.faults()[0].any(axis=1).sum())
  label = {"accumulate": f"accumulate(cross_shard(adam), {ff.K})"}.get(
    scenario, f"{scenario}(adam)"
  )
  print(
    f"\n[faults] apply_if_finite({label}) under {mapping}:"
    f" {ff.STEPS} steps, {num_faults} non-finite gradients on one replica,"
    f" total_notfinite={got['total_notfinite'].ravel().tolist()},"
    f" max replica_divergence={got['divergence'].max()}"
  )
  assert float(got["divergence"].max()) == 0.0
  np.testing.assert_array_equal(got["total_notfinite"].ravel(), num_faults)
  params = got["params"].reshape(ff.STEPS, R, -1)
  for r in range(1, R):  # bit-identical on every replica, every step
    np.testing.assert_array_equal(params[:, r], params[:, 0])
  want = _np_adam_skipping(ff.K if scenario == "accumulate" else 1)
  np.testing.assert_allclose(params[:, 0], want, rtol=2e-5, atol=2e-6)


def test_dynamic_loss_scale_from_the_replicated_flag_stays_in_sync(tmp_path):
  got = _run_worker("loss_scale", "pmap", tmp_path)
  mask, values = ff.faults()
  # numpy: jmp.DynamicLossScale's rule, factor 2.
  scale, counter, want = 2.0**10, 0, []
  for t in range(ff.STEPS):
    if mask[t].any():
      scale, counter = max(1.0, scale / 2), 0
    else:
      counter += 1
      if counter == ff.LOSS_SCALE_PERIOD:
        scale, counter = scale * 2, 0
    want.append(scale)
  print(
    f"\n[faults] jmp.DynamicLossScale adjusted with apply_if_finite's"
    f" last_finite: loss scale per step {got['loss_scale'][:, 0].tolist()}"
  )
  np.testing.assert_array_equal(
    got["loss_scale"], np.repeat(np.array(want)[:, None], R, axis=1)
  )
  params = got["params"]
  for r in range(1, R):
    np.testing.assert_array_equal(params[:, r], params[:, 0])


# --- Cost: a donated guarded step copies nothing more than the unguarded one.


def _where_guard(inner):
  """The naive select: inner's outputs or the old state, chosen at the end
  (``jnp.where`` over inner's outputs), deciding on the local gradients."""

  def update(grads, state, params=None):
    ok = shardopt.all_finite(grads)
    updates, new = inner.update(grads, state, params)
    updates = jax.tree.map(lambda u: jnp.where(ok, u, 0.0), updates)
    return updates, jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, state)

  return optax.GradientTransformation(inner.init, update)


@pytest.mark.parametrize(
  "name",
  ["free guard after cross_shard_mean", "flag around cross_shard", "tower"],
)
def test_a_donated_guarded_step_copies_no_more_than_the_unguarded_one(name):
  """The guard selects each new state leaf where inner computes it, which
  keeps adam's update fused with apply_updates: a donated step copies no
  more than the unguarded one. The control, a plain where over inner's
  outputs, makes XLA recompute the moments from the old ones inside the
  caller's fusion after they were overwritten in place: it copies them."""
  adam = lambda: optax.adam(1e-3)
  mean = lambda inner: optax.chain(shardopt.cross_shard_mean(AXIS), inner)
  unguarded, guarded = {
    "free guard after cross_shard_mean": (
      lambda: mean(adam()),
      lambda: mean(shardopt.apply_if_finite(adam(), 3, axis_name=None)),
    ),
    "flag around cross_shard": (
      lambda: shardopt.cross_shard(adam(), AXIS),
      lambda: shardopt.apply_if_finite(
        shardopt.cross_shard(adam(), AXIS), 3, axis_name=AXIS
      ),
    ),
    "tower": (
      lambda: shardopt.tower(adam(), AXIS),
      lambda: shardopt.apply_if_finite(
        shardopt.tower(adam(), AXIS), 3, axis_name=AXIS
      ),
    ),
  }[name]
  sizes = (64, 128, 8)
  bare = non_sync_copied_bytes(unguarded(), sizes, donate=True)
  mine = non_sync_copied_bytes(guarded(), sizes, donate=True)
  print(f"\n[hlo] {name}: copied bytes guarded {mine}, unguarded {bare}")
  assert mine <= bare
  if name.startswith("free"):
    naive = non_sync_copied_bytes(mean(_where_guard(adam())), sizes, True)
    moments = 2 * 4 * (64 * 128 + 128 + 128 * 8 + 8)
    print(f"[hlo] the naive where guard copies {naive} ({moments} of moments)")
    assert naive >= moments


@pytest.mark.parametrize(
  "inner",
  [
    lambda: optax.adam(1e-2),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, 0.9)),
    lambda: optax.lion(1e-3),
  ],
  ids=["adam", "clip+momentum", "lion"],
)
def test_update_or_skip_is_inner_bit_for_bit_or_the_old_state(inner):
  """Applied: inner's updates and state, bit for bit (inner alone, jitted
  on its own, is the reference). Skipped: zero updates and the old state's
  bits, whatever NaN/inf the skipped update computed."""
  from shardopt._skip import update_or_skip

  tx = inner()
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  state = tx.init(params)
  for _ in range(3):  # a state that is not all zeros
    g = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
    _, state = jax.jit(tx.update)(g, state, params)
  grads = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  want = jax.jit(tx.update)(grads, state, params)
  got = jax.jit(lambda g, s, p: update_or_skip(True, tx.update, g, s, p))(
    grads, state, params
  )
  chex.assert_trees_all_equal(got, want)
  bad = {"w": grads["w"].at[1, 2].set(jnp.nan)}
  updates, kept = jax.jit(
    lambda g, s, p: update_or_skip(False, tx.update, g, s, p)
  )(bad, state, params)
  chex.assert_trees_all_equal(kept, state)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))


def test_update_or_skip_keeps_each_leaf_when_one_value_is_two_state_leaves():
  """A value the new state holds twice, over two different old leaves (and
  an old leaf passed through unchanged), comes back as each leaf's own old
  value on a skip."""
  from shardopt._skip import update_or_skip

  def update(g, state, params=None):
    new = jnp.sum(g) * jnp.ones(2)
    return g, (new, new, state[2])

  state = (jnp.zeros(2), jnp.ones(2), jnp.full(2, 7.0))
  g = jnp.array([1.0, jnp.nan])
  _, kept = jax.jit(lambda g: update_or_skip(False, update, g, state))(g)
  chex.assert_trees_all_equal(kept, state)
  _, new = jax.jit(lambda g: update_or_skip(True, update, g, state))(
    jnp.array([1.0, 2.0])
  )
  chex.assert_trees_all_equal(
    new, (jnp.full(2, 3.0), jnp.full(2, 3.0), state[2])
  )


def test_under_vmap_with_batched_counters_every_member_skips_together():
  """No cond of its own: under jax.vmap(axis_name=...) with the state
  vmapped, the guard runs (no error) and decides once for the whole axis."""
  tx = shardopt.apply_if_finite(
    shardopt.cross_shard(optax.sgd(1.0), AXIS), 3, axis_name=AXIS
  )
  params = jnp.zeros((4, 3))
  state = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS))
  updates, state = step(jnp.ones((4, 3)).at[1, 0].set(jnp.nan), state, params)
  np.testing.assert_array_equal(updates, 0.0)
  np.testing.assert_array_equal(state.total_notfinite, [1, 1, 1, 1])
  grads = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
  updates, state = step(grads, state, params)
  np.testing.assert_array_equal(updates, -1.5)  # -(0 + 1 + 2 + 3) / 4
