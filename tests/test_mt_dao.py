"""MT-DAO (``shardopt.mt_dao``) against a numpy run of its equations.

The reference (``np_mt_dao_step``) is equations (1) to (4) of the module
docstring (arXiv 2510.05361's Adam form: ``N`` first momenta, one second
moment, the gradient and the momenta mixed by ``omegas``), in float64, with
nothing of the implementation. Inside ``local_sgd`` and ``diloco`` the
reference adds the engine's sync in numpy (the mean of the replicas' params
every ``H`` steps; DiLoCo's Nesterov outer step on ``center - mean``), for 8
replicas on the 8 CPU devices under ``jax.pmap`` and a checking
``jax.shard_map``. Tolerances: float32 against float64, ``rtol=2e-5``,
``atol=1e-6`` (the params stay O(1) over 9 steps).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _docs_pages import DOCS
from _docs_pages import run_page
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo
from shardopt.mt_dao import MTDAOState

N = 8
AXIS = "batch"
SHAPES = {"w": (4, 6), "b": (6,)}
BETAS, OMEGAS, B2, EPS = (0.8, 0.99), (0.3, 0.5), 0.95, 1e-8
LR, WD = 0.05, 0.1
PERIOD, STEPS = 3, 9
RTOL, ATOL = 2e-5, 1e-6


# --------------------------------------------------------------------------
# The numpy reference.


def np_mt_dao_step(
  g, p, state, t, betas=BETAS, omegas=OMEGAS, b2=B2, lr=LR, wd=WD
):
  """One step of equations (1)-(4): returns (new params, new state);
  ``state = (momenta list, v)``, ``t`` counted from 1."""
  momenta, v = state
  momenta = [b * u + (1 - b) * g for b, u in zip(betas, momenta)]
  v = b2 * v + (1 - b2) * g * g
  mixed = (1 - sum(omegas)) * g
  for w, b, u in zip(omegas, betas, momenta):
    mixed = mixed + w * u / (1 - b**t)
  d = mixed / (np.sqrt(v / (1 - b2**t)) + EPS)
  return p - lr * (d + wd * p), (momenta, v)


def _problem(seed=0):
  """Per replica a quadratic: grad = a_r * p + noise_t,r (float32)."""
  rng = np.random.default_rng(seed)
  p0 = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
  a = {
    n: rng.uniform(0.5, 2.0, (N,) + s).astype(np.float32)
    for n, s in SHAPES.items()
  }
  noise = {
    n: rng.standard_normal((STEPS, N) + s).astype(np.float32)
    for n, s in SHAPES.items()
  }
  return p0, a, noise


def np_periodic(p0, a, noise, outer=None):
  """Every step's params of every replica, ``{leaf: (steps, N, ...)}``, and
  the final momenta; a sync every PERIOD steps: the mean (local SGD) or,
  with ``outer=(lr, momentum)``, DiLoCo's Nesterov outer step."""
  names = list(SHAPES)
  p = {n: np.repeat(p0[n][None].astype(np.float64), N, 0) for n in names}
  states = {
    n: [([np.zeros(SHAPES[n])] * len(BETAS), np.zeros(SHAPES[n]))] * N
    for n in names
  }
  center = {n: p0[n].astype(np.float64) for n in names}
  trace = {n: np.zeros(SHAPES[n]) for n in names}
  history = {n: np.zeros((STEPS, N) + SHAPES[n]) for n in names}
  for t in range(1, STEPS + 1):
    for n in names:
      states[n] = list(states[n])
      for r in range(N):
        g = a[n][r] * p[n][r] + noise[n][t - 1, r]
        p[n][r], states[n][r] = np_mt_dao_step(g, p[n][r], states[n][r], t)
      if t % PERIOD == 0:
        mean = p[n].mean(0)
        if outer is None:
          p[n][:] = mean
        else:  # optax.sgd(lr, momentum, nesterov=True) on center - mean
          lr, mu = outer
          delta = center[n] - mean
          trace[n] = delta + mu * trace[n]
          center[n] = center[n] - lr * (delta + mu * trace[n])
          p[n][:] = center[n]
      history[n][t - 1] = p[n]
  return history, states


# --------------------------------------------------------------------------
# The optimizer alone.


def test_one_replica_matches_the_equations_in_numpy():
  tx = shardopt.mt_dao(LR, BETAS, OMEGAS, b2=B2, eps=EPS, weight_decay=WD)
  rng = np.random.default_rng(1)
  p = rng.standard_normal((5, 3)).astype(np.float32)
  grads = rng.standard_normal((6, 5, 3)).astype(np.float32)
  state = tx.init(p)
  want_p = p.astype(np.float64)
  want_state = ([np.zeros((5, 3))] * 2, np.zeros((5, 3)))
  update = jax.jit(tx.update)
  for t, g in enumerate(grads, start=1):
    updates, state = update(g, state, p)
    p = optax.apply_updates(p, updates)
    want_p, want_state = np_mt_dao_step(g, want_p, want_state, t)
    np.testing.assert_allclose(p, want_p, rtol=RTOL, atol=ATOL, err_msg=t)
  inner = state[0]
  assert isinstance(inner, MTDAOState) and int(inner.count) == 6
  for u, want in zip(inner.momenta, want_state[0], strict=True):
    np.testing.assert_allclose(u, want, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(inner.nu, want_state[1], rtol=RTOL, atol=ATOL)


def test_one_momentum_of_weight_one_is_optax_adamw():
  """omegas=(1,): the gradient's weight 0 and one momentum: AdamW."""
  mine = shardopt.mt_dao(0.01, (0.9,), (1.0,), b2=0.999, weight_decay=0.1)
  adamw = optax.adamw(0.01, b1=0.9, b2=0.999, weight_decay=0.1)
  rng = np.random.default_rng(2)
  p = q = rng.standard_normal(7).astype(np.float32)
  s, r = mine.init(p), adamw.init(q)
  for g in rng.standard_normal((5, 7)).astype(np.float32):
    u, s = mine.update(g, s, p)
    v, r = adamw.update(g, r, q)
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
    np.testing.assert_allclose(p, q, rtol=1e-6, atol=1e-7)


def test_no_bias_correction_and_a_bfloat16_gradient():
  tx = shardopt.scale_by_mt_dao((0.9,), (0.5,), bias_correction=False)
  g = jnp.array([1.0, -4.0], jnp.bfloat16)
  out, state = tx.update(g, tx.init(g))
  assert out.dtype == jnp.bfloat16 and state.nu.dtype == jnp.float32
  gf = np.float64([1.0, -4.0])
  u, v = 0.1 * gf, 0.001 * gf * gf
  want = (0.5 * gf + 0.5 * u) / (np.sqrt(v) + 1e-8)
  np.testing.assert_allclose(np.float32(out), want, rtol=1e-2)


# --------------------------------------------------------------------------
# Inside the low-communication methods, 8 replicas.


def _mesh():
  return jax.make_mesh((N,), (AXIS,))


def _build(method):
  inner = shardopt.mt_dao(LR, BETAS, OMEGAS, b2=B2, eps=EPS, weight_decay=WD)
  if method == "local_sgd":
    return shardopt.local_sgd(inner, AXIS, sync_period=PERIOD), None
  outer = (0.8, 0.2)  # shardopt's default outer step, written out
  return shardopt.diloco(
    inner,
    AXIS,
    sync_period=PERIOD,
    outer_learning_rate=outer[0],
    outer_momentum=outer[1],
    nesterov=True,
  ), outer


def _step(tx, a):
  def step(carry, noise):
    params, state = carry
    grads = jax.tree.map(lambda p, a, e: a * p + e, params, a, noise)
    updates, new_state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    # The engine's recipe (local_sgd's docstring): p + (center - p) is not
    # always bitwise the center; snap the params onto it at a sync.
    synced = new_state.sync_count > state.sync_count
    params = jax.tree.map(
      lambda p, c: jnp.where(synced, c, p), params, new_state.center
    )
    return (params, new_state), params

  return step


def _run(tx, p0, a, noise, mapping):
  """Every step's params (``{leaf: (steps, N, ...)}``) and the final state
  (a replica axis first)."""
  if mapping == "pmap":

    def run(p, a, noise):
      (_, state), history = jax.lax.scan(_step(tx, a), (p, tx.init(p)), noise)
      return history, state

    stacked = jax.tree.map(lambda x: np.repeat(x[None], N, 0), p0)
    moved = jax.tree.map(lambda x: np.moveaxis(x, 1, 0), noise)
    history, state = jax.pmap(run, axis_name=AXIS)(stacked, a, moved)
    history = jax.tree.map(lambda h: np.moveaxis(np.asarray(h), 0, 1), history)
    return history, jax.device_get(state)

  def run(p, a, noise):  # p, a: one replica's rows; noise (steps, 1, ...)
    p, a = jax.tree.map(lambda x: x[0], (p, a))
    noise = jax.tree.map(lambda x: x[:, 0], noise)
    p = jax.lax.pcast(p, AXIS, to="varying")
    (_, state), history = jax.lax.scan(_step(tx, a), (p, tx.init(p)), noise)
    return (
      jax.tree.map(lambda h: h[:, None], history),
      jax.tree.map(lambda s: s[None], state),
    )

  mesh = _mesh()
  run = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P(), P(AXIS), P(None, AXIS)),
      out_specs=(P(None, AXIS), P(AXIS)),
    )
  )
  history, state = run(
    jax.tree.map(lambda x: x[None], p0),
    jax.device_put(a, NamedSharding(mesh, P(AXIS))),
    jax.device_put(noise, NamedSharding(mesh, P(None, AXIS))),
  )
  return jax.device_get(history), jax.device_get(state)


def _mt_dao_state(state):
  """The MTDAOState inside a periodic transform's state."""
  found = [
    s
    for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MTDAOState))
    if isinstance(s, MTDAOState)
  ]
  assert len(found) == 1
  return found[0]


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_eight_replicas_match_numpy_over_three_syncs(method, mapping):
  """9 steps, a sync every 3: every replica's params after every step, and
  the final momenta; after each sync the params are bit-identical on every
  replica, the momenta are not (the engine averages params only)."""
  tx, outer = _build(method)
  p0, a, noise = _problem()
  want, want_states = np_periodic(p0, a, noise, outer)
  history, state = _run(tx, p0, a, noise, mapping)
  for name in SHAPES:
    np.testing.assert_allclose(
      history[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name
    )
    for t in range(PERIOD, STEPS + 1, PERIOD):
      for r in range(1, N):
        chex.assert_trees_all_equal(
          history[name][t - 1, 0], history[name][t - 1, r]
        )
  inner = _mt_dao_state(state)
  for name in SHAPES:
    for j in range(len(BETAS)):
      want_u = np.stack([want_states[name][r][0][j] for r in range(N)])
      np.testing.assert_allclose(
        inner.momenta[j][name], want_u, rtol=RTOL, atol=ATOL
      )
    # Drift: the slow momentum differs across replicas by O(its size).
    u = inner.momenta[1][name]
    spread = np.abs(u - u.mean(0)).max() / np.abs(u.mean(0)).max()
    assert spread > 0.05, spread


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_the_compiled_step_averages_the_params_only_in_its_branch(method):
  """Its one all-reduce sits in the sync's conditional branch and moves the
  params' float32 bytes (and one float32 more, the engine's count of finite
  replicas), the same as with optax.adamw inside: the second momentum adds
  state, no byte."""
  params = {n: jnp.zeros((N,) + s, jnp.float32) for n, s in SHAPES.items()}
  param_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
  read = {}
  for name, inner in (
    ("mt_dao", shardopt.mt_dao(LR, BETAS, OMEGAS)),
    ("adamw", optax.adamw(LR)),
  ):
    tx = getattr(shardopt, method)(inner, AXIS, sync_period=PERIOD)

    def step(p, s, tx=tx):
      return tx.update(p, s, p)

    text = (
      jax.pmap(step, axis_name=AXIS)
      .lower(params, jax.pmap(tx.init)(params))
      .compile()
      .as_text()
    )
    ops = hlo.compiled_collectives(text, num_devices=N)
    assert ops and all(op.context == "conditional" for op in ops), ops
    read[name] = [(op.kind, op.dtypes, op.buffer_bytes) for op in ops]
  assert read["mt_dao"] == read["adamw"]
  assert read["mt_dao"] == [("all-reduce", ("f32",), param_bytes + 4)]


# --------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"betas": ()}, r"scale_by_mt_dao: betas=\(\) must be a non-empty tuple"),
    ({"betas": (1.0,)}, r"betas=\(1\.0,\) .*\[0, 1\).*betas=\(0\.995,\)"),
    ({"betas": 0.9}, r"betas=0\.9 must be a non-empty tuple"),
    ({"omegas": (0.5, 0.5)}, r"omegas=\(0\.5, 0\.5\) must be a tuple of 1"),
    (
      {"betas": (0.9, 0.99), "omegas": (0.6, 0.6)},
      r"omegas=\(0\.6, 0\.6\) .*summing to at most 1",
    ),
    ({"b2": 1.0}, r"b2=1\.0 must be a number in \[0, 1\)"),
    ({"eps": -1.0}, r"eps=-1\.0 must be a number >= 0"),
  ],
)
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, match):
  with pytest.raises(ValueError, match=match):
    shardopt.scale_by_mt_dao(**kwargs)


def test_a_bad_weight_decay_and_flag_are_refused():
  with pytest.raises(ValueError, match=r"mt_dao: weight_decay=-0\.1 must"):
    shardopt.mt_dao(0.1, weight_decay=-0.1)
  with pytest.raises(TypeError, match=r"bias_correction=1 must be True"):
    shardopt.scale_by_mt_dao(bias_correction=1)


# --------------------------------------------------------------------------
# The docs page.


def test_the_docs_page_runs_and_shows_what_it_says(capsys):
  """docs/mt_dao.md's python blocks run in order in one namespace: the
  params are one copy after a sync, the slow momenta are not; the page is
  in the Guides toctree."""
  namespace = run_page("mt_dao")
  assert namespace["same_params"] is True
  assert namespace["spread"] > 0.05
  assert capsys.readouterr().out.startswith("True ")
  index = (DOCS / "index.md").read_text()
  assert "MT-DAO <mt_dao>" in index


# --------------------------------------------------------------------------
# With its states averaged: MT-DAO's momenta and second moment synced on
# periods of their own through shardopt.desloc (its fields by name).

STATE_PERIODS = {"momenta": 2, "nu": 3}


def np_desloc_mt_dao(p0, a, noise, periods=None):
  """Every replica's params after every step and the final states, the
  params averaged every PERIOD steps, the momenta every
  ``STATE_PERIODS["momenta"]`` and the second moment every
  ``STATE_PERIODS["nu"]`` (DES-LOC's Algorithm 1 around equations
  (1)-(4)), in float64; ``periods`` replaces ``STATE_PERIODS``."""
  periods = STATE_PERIODS if periods is None else periods
  names = list(SHAPES)
  p = {n: np.repeat(p0[n][None].astype(np.float64), N, 0) for n in names}
  u = {n: np.zeros((len(BETAS), N) + SHAPES[n]) for n in names}
  v = {n: np.zeros((N,) + SHAPES[n]) for n in names}
  history = {n: np.zeros((STEPS, N) + SHAPES[n]) for n in names}
  for t in range(1, STEPS + 1):
    for n in names:
      for r in range(N):
        g = a[n][r] * p[n][r] + noise[n][t - 1, r]
        new_p, (new_u, new_v) = np_mt_dao_step(
          g, p[n][r], (list(u[n][:, r]), v[n][r]), t
        )
        p[n][r], v[n][r] = new_p, new_v
        u[n][:, r] = np.stack(new_u)
      if t % PERIOD == 0:
        p[n][:] = p[n].mean(0)
      if t % periods["momenta"] == 0:
        u[n][:] = u[n].mean(1, keepdims=True)
      if t % periods["nu"] == 0:
        v[n][:] = v[n].mean(0)
      history[n][t - 1] = p[n]
  return history, u, v


@pytest.mark.parametrize(
  "periods",
  [STATE_PERIODS, {"momenta": PERIOD, "nu": PERIOD}],
  ids=["own-periods", "paper-K-all"],
)
def test_desloc_averages_mt_daos_momenta_and_second_moment_as_numpy_does(
  periods,
):
  """``shardopt.desloc(shardopt.mt_dao(...), state_sync_periods=...)`` (the
  paper's states averaged at syncs, the gap the plain ``local_sgd`` leaves)
  against numpy over 9 steps under pmap: every replica's params after every
  step, and the final momenta and second moment, each bit-identical across
  replicas after its own sync. Two settings: the momenta every 2 steps and
  the second moment every 3 (periods of their own), and the paper's
  experiments' ``K_x = K_1 = K_v`` (every state with the params, every 3
  steps: the whole optimizer state averaged at each sync)."""
  inner = shardopt.mt_dao(LR, BETAS, OMEGAS, b2=B2, eps=EPS, weight_decay=WD)
  tx = shardopt.desloc(
    inner, AXIS, sync_period=PERIOD, state_sync_periods=periods
  )
  p0, a, noise = _problem()
  want, want_u, want_v = np_desloc_mt_dao(p0, a, noise, periods)

  def run(p, a, noise):
    def step(carry, noise):
      params, state = carry
      grads = jax.tree.map(lambda p, a, e: a * p + e, params, a, noise)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), params

    (_, state), history = jax.lax.scan(step, (p, tx.init(p)), noise)
    return history, state

  stacked = jax.tree.map(lambda x: np.repeat(x[None], N, 0), p0)
  moved = jax.tree.map(lambda x: np.moveaxis(x, 1, 0), noise)
  history, state = jax.pmap(run, axis_name=AXIS)(stacked, a, moved)
  inner_state = _mt_dao_state(jax.device_get(state))
  for name in SHAPES:
    got = np.moveaxis(np.asarray(history[name]), 0, 1)
    np.testing.assert_allclose(
      got, want[name], rtol=RTOL, atol=ATOL, err_msg=name
    )
    for j in range(len(BETAS)):
      got_u = np.asarray(inner_state.momenta[j][name])
      np.testing.assert_allclose(got_u, want_u[name][j], rtol=RTOL, atol=ATOL)
    got_v = np.asarray(inner_state.nu[name])
    np.testing.assert_allclose(got_v, want_v[name], rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_equal(*got_v)  # synced at step 9
