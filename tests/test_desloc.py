"""DES-LOC (``shardopt.desloc``, arXiv 2505.22549): Local Adam whose params
and moments average on periods of their own.

The reference is the paper's Algorithm 1 written here in numpy (float64):
Adam on every replica, then the params averaged when ``t % K_x == 0``, the
first moment when ``t % K_u == 0`` and the second when ``t % K_v == 0``
(``t`` the steps done). Matched over 12 steps (6 params syncs, 4 of ``mu``,
3 of ``nu``, 1 of all three) on the 8 CPU devices, under ``jax.shard_map``
and ``jax.pmap``, to float32 rounding: ``rtol=2e-5, atol=1e-6``.
"""

from __future__ import annotations

import math
import pathlib

import _compiled
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _docs_pages import run_page
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo
from shardopt.periodic import engine as engine_module

AXIS = "batch"
R = 8
N = 5
KX, KU, KV = 2, 3, 4
PERIODS = {"params": KX, "mu": KU, "nu": KV}
STEPS = 12
LR, B1, B2, EPS = 0.05, 0.9, 0.999, 1e-8


def _tx(**kw):
  return shardopt.desloc(
    optax.adam(LR, b1=B1, b2=B2, eps=EPS),
    AXIS,
    sync_period=KX,
    state_sync_periods={"mu": KU, "nu": KV},
    **kw,
  )


def _targets():
  rng = np.random.default_rng(0)
  return rng.normal(size=(R, N)).astype(np.float32) * 3.0


def _coefficients(t):
  """Step t's curvature and shift (float32, computed on the host)."""
  return np.float32(1.0 + 0.1 * t), np.float32(0.2 * math.sin(t))


def _grad(w, target, c):
  """Replica i's gradient at step t: a quadratic's, pulled to its own target,
  with step t's curvature and shift ``c`` (numpy and jax alike)."""
  return (w - target) * c[0] + c[1]


def _reference(w0, targets, steps):
  """Algorithm 1 in numpy, float64: per replica Adam, then the averages."""
  w = np.tile(np.asarray(w0, np.float64), (R, 1))
  m = np.zeros_like(w)
  v = np.zeros_like(w)
  out = []
  for t in range(1, steps + 1):
    c = [np.float64(x) for x in _coefficients(t)]
    g = _grad(w, targets.astype(np.float64), c)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    m_hat = m / (1 - B1**t)
    v_hat = v / (1 - B2**t)
    w = w - LR * m_hat / (np.sqrt(v_hat) + EPS)
    if t % KX == 0:
      w = np.broadcast_to(w.mean(0), w.shape).copy()
    if t % KU == 0:
      m = np.broadcast_to(m.mean(0), m.shape).copy()
    if t % KV == 0:
      v = np.broadcast_to(v.mean(0), v.shape).copy()
    out.append((w.copy(), m.copy(), v.copy()))
  return out


def _shard_map_run(tx, w0, targets, steps):
  mesh = jax.make_mesh((R,), (AXIS,))
  specs = jax.tree.map(
    lambda v: P() if jnp.ndim(v) == 0 else P(AXIS), tx.init(jnp.zeros((1, N)))
  )

  def step(w, state, target, c):
    g = _grad(w, target, c)
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(AXIS), out_specs=specs)
  )
  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(AXIS), specs, P(AXIS), P()),
      out_specs=(P(AXIS), specs),
    )
  )
  rows = NamedSharding(mesh, P(AXIS))
  w = jax.device_put(jnp.tile(jnp.asarray(w0), (R, 1)), rows)
  target = jax.device_put(jnp.asarray(targets), rows)
  state = init(w)
  out = []
  for t in range(1, steps + 1):
    w, state = step(w, state, target, _coefficients(t))
    out.append(jax.tree.map(np.asarray, (w, state)))
  return out


def _pmap_run(tx, w0, targets, steps):
  def step(w, state, target, c):
    updates, state = tx.update(_grad(w, target, c), state, w)
    return optax.apply_updates(w, updates), state

  step = jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, 0, None))
  w = jnp.tile(jnp.asarray(w0), (R, 1))
  state = jax.pmap(tx.init, axis_name=AXIS)(w)
  out = []
  for t in range(1, steps + 1):
    w, state = step(w, state, jnp.asarray(targets), _coefficients(t))
    out.append(jax.tree.map(np.asarray, (w, state)))
  return out


def _rows(x):
  return [x[i] for i in range(R)]


@pytest.mark.parametrize("mapping", ["shard_map", "pmap"])
def test_matches_the_papers_algorithm_in_numpy(mapping):
  """Params, mu and nu of every replica after every step, against Algorithm
  1 in numpy; and bit-identity across replicas of each synced tree after its
  sync (the moments are the all-reduce's output; the params are the center,
  bit-identical, after snapping, as for local_sgd)."""
  tx = _tx()
  w0 = np.linspace(-1.0, 1.0, N).astype(np.float32)
  targets = _targets()
  run = {"shard_map": _shard_map_run, "pmap": _pmap_run}[mapping]
  got = run(tx, w0, targets, STEPS)
  want = _reference(w0, targets, STEPS)
  for t, ((w, state), (rw, rm, rv)) in enumerate(
    zip(got, want, strict=True), start=1
  ):
    adam = state.local_state[0]
    mu = adam.mu.reshape(R, N)
    nu = adam.nu.reshape(R, N)
    np.testing.assert_allclose(w, rw, rtol=2e-5, atol=1e-6, err_msg=f"t={t}")
    np.testing.assert_allclose(mu, rm, rtol=2e-5, atol=1e-6, err_msg=f"t={t}")
    np.testing.assert_allclose(nu, rv, rtol=2e-5, atol=1e-7, err_msg=f"t={t}")
    center = state.center.reshape(-1, N)
    chex.assert_trees_all_equal(*_rows(np.broadcast_to(center, (R, N))))
    if t % KU == 0:
      chex.assert_trees_all_equal(*_rows(mu))
    else:
      assert not np.all(mu == mu[0]), t
    if t % KV == 0:
      chex.assert_trees_all_equal(*_rows(nu))
    else:
      assert not np.all(nu == nu[0]), t
    if t % KX == 0:
      np.testing.assert_array_equal(
        np.broadcast_to(center, (R, N)), np.broadcast_to(center[0], (R, N))
      )
      # params + (center - params) lands on the center within one rounding.
      np.testing.assert_allclose(w, np.broadcast_to(center, (R, N)), rtol=1e-6)
    else:
      assert not np.all(w == w[0]), t
  assert int(np.ravel(got[-1][1].sync_count)[0]) == sum(
    1 for t in range(1, STEPS + 1) if any(t % k == 0 for k in (KX, KU, KV))
  )


def test_due_numbers_each_set_of_parts_that_fire_together():
  """shardopt.due(tx, t) names the sync whose parts are exactly those whose
  period divides t (written out here), 0 when none does."""
  tx = _tx()
  syncs = engine_module.engine_of(tx).syncs
  assert (
    len(syncs) == 5
  )  # {x}, {u}, {x,u}, {x,v}, {x,u,v}; {v}, {u,v} never alone
  for t in range(1, 3 * math.lcm(KX, KU, KV) + 1):
    fire = {name for name, k in PERIODS.items() if t % k == 0}
    k = shardopt.due(tx, t)
    if not fire:
      assert k == 0, t
      continue
    s = syncs[k - 1]
    assert ({"params"} if s.params else set()) | set(s.states) == fire, t


def test_the_paper_default_periods():
  """state_sync_periods=None: K_u = 3 K_x, K_v = 6 K_x (the paper's rule):
  the syncs are the params alone, params + mu, params + mu + nu."""
  tx = shardopt.desloc(optax.adamw(1e-3), AXIS, sync_period=16)
  syncs = engine_module.engine_of(tx).syncs
  assert [(s.period, s.params, s.states) for s in syncs] == [
    (16, True, ()),
    (48, True, ("mu",)),
    (96, True, ("mu", "nu")),
  ]
  assert [shardopt.due(tx, t) for t in (16, 32, 48, 96, 97)] == [1, 1, 2, 3, 0]


def test_each_sync_all_reduces_exactly_its_parts_in_its_own_branch():
  """The compiled HLO: no collective outside the conds; one branch with
  collectives per sync, in schedule order, over all 8 replicas; each
  all-reduces its parts' float32 bytes plus the finite flag (one float32).
  The first moment's own sync (steps 3, 9) carries mu alone."""
  size = 4096
  text = _compiled.compiled_update(_tx(), "pmap", size=size)
  ops = hlo.compiled_collectives(text, num_devices=R)
  split = hlo.by_branch(ops)
  assert split["top"] == 0.0
  labels = hlo.branch_labels(ops)
  parts = [
    (1 if s.params else 0) + len(s.states)
    for s in engine_module.engine_of(_tx()).syncs
  ]
  assert parts == [1, 1, 2, 2, 3]
  assert len(labels) == len(parts)
  for label, n in zip(labels, parts, strict=True):
    branch = split["branches"][label]
    assert branch["bytes"] == (n * size + 1) * 4, (label, branch)
    assert branch["group_sizes"] in ([R], [0]), branch  # the whole axis
  # Bytes per step over a cycle, from the engine's own schedule.
  schedule = hlo.Schedule(engine_module.engine_of(_tx()).syncs)
  per_step = hlo.per_step(ops, schedule)
  assert per_step["warning"] == ""
  cycle = math.lcm(KX, KU, KV)
  want = [
    (
      sum(1 for name, k in PERIODS.items() if t % k == 0) * size
      + (1 if any(t % k == 0 for k in PERIODS.values()) else 0)
    )
    * 4.0
    for t in range(1, cycle + 1)
  ]
  assert per_step["cycle"] == want


def test_refusals_name_the_argument_and_the_fix():
  with pytest.raises(ValueError, match=r"shardopt.desloc.*'mu'.*scale_by_adam"):
    shardopt.desloc(optax.sgd(0.1), AXIS, sync_period=2).init(jnp.zeros(3))
  with pytest.raises(ValueError, match=r"shardopt.desloc.*'trace'"):
    shardopt.desloc(
      optax.sgd(0.1, momentum=0.9),
      AXIS,
      sync_period=2,
      state_sync_periods={"mu": 4},
    ).init(jnp.zeros(3))
  with pytest.raises(ValueError, match=r"error_feedback=True.*local_sgd"):
    shardopt.desloc(
      optax.adam(0.1),
      AXIS,
      sync_period=2,
      comm_dtype=jnp.int8,
      error_feedback=True,
    )
  with pytest.raises(ValueError, match=r"state_sync_periods\['nu'\]=0"):
    shardopt.desloc(
      optax.adam(0.1), AXIS, sync_period=2, state_sync_periods={"nu": 0}
    )
  with pytest.raises(ValueError, match=r"state_sync_periods=\[3\].*'mu'"):
    shardopt.desloc(optax.adam(0.1), AXIS, state_sync_periods=[3])


def test_elastic_islands_refuse_it_by_name():
  """The elastic split runs the params' syncs only: refused, not ignored."""
  from shardopt.periodic import split  # noqa: PLC0415

  with pytest.raises(ValueError, match=r"shardopt.desloc.*state_sync_periods"):
    split.engine_of(_tx(), "shardopt.elastic.Island")


def test_a_quantized_wire_carries_the_moments_too():
  """comm_dtype=int8: every sync (the moment's own included) sends int8
  payloads, and training still tracks the float32 run within int8's
  rounding."""
  tx = _tx(comm_dtype=jnp.int8)
  text = _compiled.compiled_update(tx, "pmap", size=4096)
  ops = hlo.compiled_collectives(text, num_devices=R)
  labels = hlo.branch_labels(ops)
  assert len(labels) == 5
  for label in labels:
    dtypes = {d for op in ops if op.branch == label for d in op.dtypes}
    assert "u8" in dtypes, (label, dtypes)  # int8 codes, packed as bytes
  w0 = np.linspace(-1.0, 1.0, N).astype(np.float32)
  got = _pmap_run(tx, w0, _targets(), STEPS)[-1][0]
  want = _reference(w0, _targets(), STEPS)[-1][0]
  np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


def test_the_docs_page_runs_and_prints_what_it_says(capsys):
  """docs/desloc.md's python blocks, run in order in one namespace (as
  tests/test_guides.py runs the guides), print what the page says."""
  namespace = run_page("desloc")
  printed = capsys.readouterr().out
  text = (
    pathlib.Path(__file__).resolve().parents[1] / "docs" / "desloc.md"
  ).read_text()
  assert namespace["programs"] == [0, 1, 2, 1, 0, 3]
  assert namespace["together"] == [
    [],
    ["params"],
    ["mu"],
    ["params"],
    [],
    ["params", "mu", "nu"],
  ]
  for line in printed.strip().splitlines():
    assert f"`{line}`" in text, line


def test_groups_average_within_themselves():
  """axis_index_groups of 4: after the first moment's own sync (step 3) mu
  agrees within each group, to the bit, and differs between the groups (to
  the numpy mean of each group's rows, float32 rounding)."""
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  tx = _tx(axis_index_groups=groups)
  w0 = np.linspace(-1.0, 1.0, N).astype(np.float32)
  w, state = _pmap_run(tx, w0, _targets(), 3)[-1]
  mu = state.local_state[0].mu
  for g in groups:
    chex.assert_trees_all_equal(*[mu[i] for i in g])
  assert not np.all(mu[0] == mu[4])
  # The same run with mu never averaged: each group's mean of its rows.
  unsynced = (
    _pmap_run(
      shardopt.desloc(
        optax.adam(LR, b1=B1, b2=B2, eps=EPS),
        AXIS,
        sync_period=KX,
        state_sync_periods={"mu": 100, "nu": 100},
        axis_index_groups=groups,
      ),
      w0,
      _targets(),
      3,
    )[-1][1]
    .local_state[0]
    .mu
  )
  for g in groups:
    np.testing.assert_allclose(
      mu[g[0]], unsynced[g].mean(0), rtol=1e-5, atol=1e-7
    )


# The paper's Algorithm 1 as the public transcriptions write it (quoted in
# docs/desloc.md, "Against the paper"): t = 0, 1, ...; a coordinate-wise
# clip ``g = clip(g, rho)``; at step t, u_{t-1} averaged if t % K_u == 0,
# v_{t-1} if t % K_v == 0, x_t if t % K_x == 0, *then* Adam's step, written
# without bias corrections. shardopt runs that local step as
# ``chain(optax.clip(rho), scale_by_mt_dao((b1,), (1.0,), bias_correction=
# False), scale(-lr))`` (one momentum of weight 1: Adam's direction).
RHO = 0.5


def _paper_tx():
  inner = optax.chain(
    optax.clip(RHO),
    shardopt.scale_by_mt_dao(
      (B1,), (1.0,), b2=B2, eps=EPS, bias_correction=False
    ),
    optax.scale(-LR),
  )
  return shardopt.desloc(
    inner,
    AXIS,
    sync_period=KX,
    state_sync_periods={"momenta": KU, "nu": KV},
  )


def _paper_algorithm_1(w0, grad, steps, *, gradient_at):
  """Algorithm 1, float64, t = 0 .. steps - 1, as transcribed. ``grad(x,
  t)`` is every replica's gradient at step t, taken at ``x``: the replica's
  own x_t (``gradient_at="local"``) or the averaged x-bar_t
  (``"averaged"``). Returns, for s = 1 .. steps, what step s of the paper
  starts from: (x-bar_s, u-bar_{s-1}, v-bar_{s-1})."""
  mean = lambda a: np.broadcast_to(a.mean(0), a.shape).copy()  # noqa: E731
  x = np.tile(np.asarray(w0, np.float64), (R, 1))
  u = np.zeros_like(x)
  v = np.zeros_like(x)
  out = []
  for t in range(steps):
    x_bar = mean(x) if t % KX == 0 else x
    u_bar = mean(u) if t % KU == 0 else u
    v_bar = mean(v) if t % KV == 0 else v
    g = np.clip(grad(x if gradient_at == "local" else x_bar, t), -RHO, RHO)
    u = B1 * u_bar + (1 - B1) * g
    v = B2 * v_bar + (1 - B2) * g * g
    x = x_bar - LR * u / (np.sqrt(v) + EPS)
    s = t + 1
    out.append(
      (
        mean(x) if s % KX == 0 else x,
        mean(u) if s % KU == 0 else u,
        mean(v) if s % KV == 0 else v,
      )
    )
  return out


def _paper_run(tx, w0, grad, steps):
  """shardopt under pmap; step s feeds grad(params after step s - 1, s - 1)."""

  def step(w, state, g):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  step = jax.pmap(step, axis_name=AXIS)
  w = jnp.tile(jnp.asarray(w0), (R, 1))
  state = jax.pmap(tx.init, axis_name=AXIS)(w)
  out = []
  for t in range(steps):
    g = np.float32(grad(np.asarray(w, np.float64), t))
    w, state = step(w, state, jnp.asarray(g))
    mt = state.local_state[1]
    out.append((np.asarray(w), np.asarray(mt.momenta[0]), np.asarray(mt.nu)))
  return out


def _assert_matches(got, want):
  for s, ((w, u, v), (rw, ru, rv)) in enumerate(
    zip(got, want, strict=True), start=1
  ):
    np.testing.assert_allclose(w, rw, rtol=2e-5, atol=1e-6, err_msg=f"s={s}")
    np.testing.assert_allclose(u, ru, rtol=2e-5, atol=1e-7, err_msg=f"s={s}")
    np.testing.assert_allclose(v, rv, rtol=2e-5, atol=1e-8, err_msg=f"s={s}")


def test_the_transcribed_algorithm_1_with_gradients_that_ignore_the_params():
  """With each replica's gradients a fixed sequence (so where they are taken
  cannot matter), shardopt's desloc around the transcribed local step
  (clip, Adam without bias corrections) is Algorithm 1 to float32
  rounding after every step: its sync after step s is the paper's averaging
  at the start of step s, the same arithmetic. The clip is active (about
  half the gradients exceed rho)."""
  table = np.random.default_rng(3).normal(size=(STEPS, R, N))
  assert 0.2 < np.mean(np.abs(table) > RHO) < 0.8
  grad = lambda x, t: table[t]  # noqa: E731
  w0 = np.linspace(-1.0, 1.0, N).astype(np.float32)
  want = _paper_algorithm_1(w0, grad, STEPS, gradient_at="local")
  chex.assert_trees_all_equal(
    want, _paper_algorithm_1(w0, grad, STEPS, gradient_at="averaged")
  )
  _assert_matches(_paper_run(_paper_tx(), w0, grad, STEPS), want)


def test_where_the_gradient_is_taken_is_the_one_difference():
  """With gradients that depend on the params: shardopt takes step s's
  gradient at the params after step s - 1's sync (the averaged x-bar), and
  matches Algorithm 1 read that way; the transcriptions take it at the
  replica's own x_t, before the average, which lands elsewhere (by far more
  than rounding). docs/desloc.md states the difference."""
  targets = _targets().astype(np.float64)

  def grad(x, t):
    curvature, shift = (np.float64(c) for c in _coefficients(t + 1))
    return (x - targets) * curvature + shift

  w0 = np.linspace(-1.0, 1.0, N).astype(np.float32)
  got = _paper_run(_paper_tx(), w0, grad, STEPS)
  _assert_matches(
    got, _paper_algorithm_1(w0, grad, STEPS, gradient_at="averaged")
  )
  local = _paper_algorithm_1(w0, grad, STEPS, gradient_at="local")
  assert np.abs(got[-1][0] - local[-1][0]).max() > 1e-3
