"""shardopt.agn / local_sgd / diloco against independent references.

References are numpy arithmetic written here (float64) or the numbers of
TensorFlow's AGNOptimizer tests quoted in design.md. Run with ``pytest -s`` to
see the oracle values, the HLO collective counts and the convergence numbers.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

R = 8  # replicas
D = 3  # weights per replica (plus one bias)
B = 4  # examples per replica per step
LR = 0.1
MOMENTUM = 0.5
GROUPS = [[0, 2, 4, 6], [1, 3, 5, 7]]


# --------------------------------------------------------------------------
# Shared pieces: a least-squares model, its numpy gradient, the step functions.


def _loss(params, x, y):
  w, b = params
  return 0.5 * jnp.mean((x @ w + b - y) ** 2)


def _np_grad(p, x, y):
  """Gradient of _loss in numpy; p = [w..., b] (D + 1,), x (B, D), y (B,)."""
  xa = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
  return xa.T @ (xa @ p - y) / x.shape[0]


def _data(seed, steps):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps, R, B, D)).astype(np.float32)
  y = rng.normal(size=(steps, R, B)).astype(np.float32)
  return x, y


def _w0():
  return (np.array([0.3, -0.2, 0.1], np.float32), np.float32(0.05))


def _stack(params):
  return jax.tree.map(
    lambda p: jnp.broadcast_to(jnp.asarray(p), (R,) + np.shape(p)), params
  )


def _flat(params):
  """(w (R, D), b (R,)) -> (R, D + 1) float64."""
  w, b = params
  return np.concatenate(
    [np.asarray(w, np.float64), np.asarray(b, np.float64)[:, None]], axis=1
  )


def _pmap_step(tx):
  def step(params, state, x, y):
    grads = jax.grad(_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.pmap(step, axis_name="batch")


def _scan_steps(tx, grad_fn):
  """A scan body: one training step, recording (params, state) after it."""

  def body(carry, batch):
    params, state = carry
    updates, state = tx.update(grad_fn(params, *batch), state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), (params, state)

  return body


def _pmap_trajectory(tx, x, y):
  """All steps in one pmap(scan); returns (params, state) per step, step axis first."""

  def run(params, x, y):
    carry = (params, tx.init(params))
    _, history = jax.lax.scan(_scan_steps(tx, jax.grad(_loss)), carry, (x, y))
    return history

  history = jax.pmap(run, axis_name="batch")(
    _stack(_w0()), x.swapaxes(0, 1), y.swapaxes(0, 1)
  )
  return jax.tree.map(lambda v: np.swapaxes(np.asarray(v), 0, 1), history)


def _state_specs(tx, params_row, leading=()):
  """Scalar counters replicated, every other leaf one row per replica."""
  example = tx.init(
    jax.tree.map(lambda p: jnp.zeros((1,) + np.shape(p)), params_row)
  )
  return jax.tree.map(
    lambda v: P(*leading) if jnp.ndim(v) == 0 else P(*leading, "batch"), example
  )


def _shard_map_fns(tx, mesh):
  """init and step under jax.shard_map: params carry a leading replica axis."""
  specs = _state_specs(tx, _w0())

  def step(params, state, x, y):  # params: ((1, D), (1,)), varying
    grads = jax.vmap(jax.grad(_loss))(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P("batch"), out_specs=specs)
  )
  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P("batch"), specs, P("batch"), P("batch")),
      out_specs=(P("batch"), specs),
    )
  )
  return init, step


def _shard_map_trajectory(tx, mesh, x, y):
  """All steps in one shard_map(scan); the state is the scan carry, so its
  varying/invariant types must stay the same from step to step."""

  def run(params, x, y):  # params ((1, D), (1,)); x (steps, 1, B, D)
    carry = (params, tx.init(params))
    _, history = jax.lax.scan(
      _scan_steps(tx, jax.vmap(jax.grad(_loss))), carry, (x, y)
    )
    return history

  per_step = P(None, "batch")
  run = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P("batch"), per_step, per_step),
      out_specs=(per_step, _state_specs(tx, _w0(), leading=(None,))),
    )
  )
  data = NamedSharding(mesh, per_step)
  history = run(
    _rows(mesh, *_stack(_w0())),
    jax.device_put(x, data),
    jax.device_put(y, data),
  )
  return jax.tree.map(np.asarray, history)


def _rows(mesh, *arrays):
  sharding = NamedSharding(mesh, P("batch"))
  return tuple(jax.device_put(a, sharding) for a in arrays)


def _assert_identical_within_groups(tree, groups):
  for group in groups or [list(range(R))]:
    first = jax.tree.map(lambda v, g=group: np.asarray(v)[g[0]], tree)
    for i in group[1:]:
      chex.assert_trees_all_equal(
        first, jax.tree.map(lambda v, i=i: np.asarray(v)[i], tree)
      )


# --------------------------------------------------------------------------
# numpy references.


def _np_momentum(g, m, lr, momentum):
  """optax.sgd(lr, momentum) / PyTorch SGD: m <- g + mu m; update = -lr m."""
  m = g + momentum * m
  return -lr * m, m


def _np_agn(
  x, y, *, period, reduction, groups, lr=LR, momentum=MOMENTUM, grads=None
):
  """AGN, synchronous: local and global SGD-with-momentum, separate states.

  Returns per step (params, center, accumulator), each (R, D + 1) float64.
  A replica whose normalized accumulator is not finite is left out of its
  group's combination and restarts with zero local momentum; params are
  snapped onto the center at a sync.
  """
  w, b = _w0()
  p0 = np.concatenate([w, [b]]).astype(np.float64)
  p = np.tile(p0, (R, 1))
  center = p.copy()
  local_m = np.zeros_like(p)
  global_m = np.zeros_like(p)
  acc = np.zeros_like(p)
  history = []
  for t in range(len(x) if grads is None else len(grads)):
    if grads is None:
      g = np.stack([_np_grad(p[i], x[t, i], y[t, i]) for i in range(R)])
    else:
      g = grads[t].astype(np.float64)
    u, local_m = _np_momentum(g, local_m, lr, momentum)
    p = p + u
    acc = acc + g
    if (t + 1) % period == 0:
      a = acc / period
      finite = np.all(np.isfinite(a), axis=1)
      for group in groups or [list(range(R))]:
        ok = [i for i in group if finite[i]]
        if not ok:
          continue
        combined = a[ok].sum(0)
        if reduction == "mean":
          combined = combined / len(ok)
        step, m = _np_momentum(combined, global_m[group[0]], lr, momentum)
        global_m[group] = m
        center[group] = center[group[0]] + step
      local_m[~finite] = 0.0
      p = center.copy()
      acc = np.zeros_like(acc)
    history.append((p.copy(), center.copy(), acc.copy()))
  return history


# --------------------------------------------------------------------------
# TensorFlow's oracles (design.md, "AGNOptimizer").


def _one_replica_run(tx, steps):
  def step(params, state):
    updates, state = tx.update(jnp.full_like(params, -1.0), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(step, axis_name="batch")
  params = jnp.array([[0.0, 0.5]])
  state = jax.pmap(tx.init)(params)
  out = {}
  for t in range(1, steps + 1):
    params, state = step(params, state)
    out[t] = (np.asarray(params[0]), np.asarray(state.center[0]))
  return out


def test_tf_oracle_adam_b0_one_replica_period_4():
  tx = shardopt.agn(
    optax.adam(0.1, b1=0.0, b2=0.0, eps=1e-8), "batch", sync_period=4
  )
  out = _one_replica_run(tx, 8)
  for t in (1, 3, 4, 8):
    print(f"AGN Adam oracle step {t}: local={out[t][0]} center={out[t][1]}")
  np.testing.assert_allclose(out[1][0], [0.1, 0.6], rtol=1e-6)
  np.testing.assert_allclose(out[1][1], [0.0, 0.5], rtol=1e-6)
  np.testing.assert_allclose(out[3][0], [0.3, 0.8], rtol=1e-6)
  for t, expected in ((4, [0.1, 0.6]), (8, [0.2, 0.7])):
    np.testing.assert_allclose(out[t][0], expected, rtol=1e-6)
    np.testing.assert_allclose(out[t][1], expected, rtol=1e-6)


def test_tf_oracle_sgd_detects_normalization_by_period():
  tx = shardopt.agn(optax.sgd(0.1), "batch", sync_period=4)
  out = _one_replica_run(tx, 8)
  print(
    f"AGN SGD oracle: step 4 center={out[4][1]}, step 8 center={out[8][1]}"
    " (without /T it would be [0.4 0.9], [0.8 1.3])"
  )
  np.testing.assert_allclose(out[4][1], [0.1, 0.6], rtol=1e-6)
  np.testing.assert_allclose(out[8][1], [0.2, 0.7], rtol=1e-6)
  np.testing.assert_allclose(out[4][0], [0.1, 0.6], rtol=1e-6)
  np.testing.assert_allclose(out[8][0], [0.2, 0.7], rtol=1e-6)
  assert not np.allclose(out[4][1], [0.4, 0.9])


# --------------------------------------------------------------------------
# Eight replicas against the numpy reference.


def _check_against_reference(history, x, y, *, period, reduction, groups):
  params, state = history
  reference = _np_agn(x, y, period=period, reduction=reduction, groups=groups)
  for t, (ref_params, ref_center, ref_acc) in enumerate(reference):
    at = lambda tree, t=t: jax.tree.map(lambda v: v[t], tree)
    where = f"step {t + 1} (period {period}, {reduction}, groups={groups})"
    np.testing.assert_allclose(
      _flat(at(params)),
      ref_params,
      rtol=2e-5,
      atol=2e-6,
      err_msg=f"params at {where}",
    )
    np.testing.assert_allclose(
      _flat(at(state.center)),
      ref_center,
      rtol=2e-5,
      atol=2e-6,
      err_msg=f"center at {where}",
    )
    np.testing.assert_allclose(
      _flat(at(state.accumulator)),
      ref_acc,
      rtol=2e-5,
      atol=2e-6,
      err_msg=f"accumulator at {where}",
    )
    # The center and the global state are bit-identical within each group.
    _assert_identical_within_groups(
      at((state.center, state.global_state)), groups
    )
    assert np.all(np.asarray(state.sync_count[t]) == (t + 1) // period)


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["all", "groups"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("period", [1, 3, 4])
def test_eight_replicas_match_numpy_reference_under_pmap(
  period, reduction, groups
):
  tx = shardopt.agn(
    optax.sgd(LR, momentum=MOMENTUM),
    "batch",
    sync_period=period,
    reduction=reduction,
    axis_index_groups=groups,
  )
  x, y = _data(period, 8)
  _check_against_reference(
    _pmap_trajectory(tx, x, y),
    x,
    y,
    period=period,
    reduction=reduction,
    groups=groups,
  )


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["all", "groups"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_eight_replicas_match_numpy_reference_under_shard_map(
  mesh, reduction, groups
):
  period = 3
  tx = shardopt.agn(
    optax.sgd(LR, momentum=MOMENTUM),
    "batch",
    sync_period=period,
    reduction=reduction,
    axis_index_groups=groups,
  )
  x, y = _data(7, 7)
  _check_against_reference(
    _shard_map_trajectory(tx, mesh, x, y),
    x,
    y,
    period=period,
    reduction=reduction,
    groups=groups,
  )


def test_replicated_params_cast_to_varying_keep_an_invariant_center(mesh):
  """The pcast pattern: params come in replicated (P()), each replica casts
  them to varying before jax.grad; the center stays typed invariant, so it
  can leave the shard_map as P(): bit-identical by construction."""
  period, steps = 3, 6
  tx = shardopt.agn(
    optax.sgd(LR, momentum=MOMENTUM), "batch", sync_period=period
  )
  x, y = _data(11, steps)

  def train(params, x, y):  # x: (steps, 1, B, D) on each replica
    state = tx.init(params)
    params = jax.lax.pcast(params, "batch", to="varying")
    for t in range(steps):
      grads = jax.grad(_loss)(params, x[t, 0], y[t, 0])
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return state.center, jax.tree.map(lambda p: p[None], params)

  data = NamedSharding(mesh, P(None, "batch"))
  train = jax.jit(
    jax.shard_map(
      train,
      mesh=mesh,
      in_specs=(P(), P(None, "batch"), P(None, "batch")),
      out_specs=(P(), P("batch")),
    )
  )
  center, params = train(
    _w0(), jax.device_put(x, data), jax.device_put(y, data)
  )
  ref_params, ref_center, _ = _np_agn(
    x, y, period=period, reduction="mean", groups=None
  )[-1]
  np.testing.assert_allclose(
    np.concatenate([center[0], [center[1]]]),
    ref_center[0],
    rtol=2e-5,
    atol=2e-6,
  )
  np.testing.assert_allclose(_flat(params), ref_params, rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------
# Identities.


def test_period_1_with_global_sgd_equals_synchronous_sgd_on_mean_gradient():
  tx = shardopt.agn(
    optax.sgd(0.3),
    "batch",
    sync_period=1,
    global_optimizer=optax.sgd(LR),
  )
  x, y = _data(21, 5)
  params, _ = _pmap_trajectory(tx, x, y)
  w, b = _w0()
  reference = np.concatenate([w, [b]]).astype(np.float64)
  for t in range(len(x)):
    mean_grad = np.mean(
      [_np_grad(reference, x[t, i], y[t, i]) for i in range(R)], 0
    )
    reference = reference - LR * mean_grad
    np.testing.assert_allclose(
      _flat((params[0][t], params[1][t])),
      np.tile(reference, (R, 1)),
      rtol=2e-5,
      atol=2e-6,
    )


def _np_local_sgd(x, y, *, period, lr, groups):
  w, b = _w0()
  p = np.tile(np.concatenate([w, [b]]).astype(np.float64), (R, 1))
  history = []
  for t in range(len(x)):
    g = np.stack([_np_grad(p[i], x[t, i], y[t, i]) for i in range(R)])
    p = p - lr * g
    if (t + 1) % period == 0:
      for group in groups or [list(range(R))]:
        p[group] = p[group].mean(0)
    history.append(p.copy())
  return history


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["all", "groups"])
def test_agn_with_global_sgd_lr_times_period_equals_local_sgd(groups):
  period, lr = 4, 0.2
  agn = shardopt.agn(
    optax.sgd(lr),
    "batch",
    sync_period=period,
    global_optimizer=optax.sgd(lr * period),
    axis_index_groups=groups,
  )
  averaging = shardopt.local_sgd(
    optax.sgd(lr), "batch", sync_period=period, axis_index_groups=groups
  )
  x, y = _data(31, 8)
  reference = _np_local_sgd(x, y, period=period, lr=lr, groups=groups)
  runs = []
  for tx in (agn, averaging):
    (w, b), _ = _pmap_trajectory(tx, x, y)
    runs.append([_flat((w[t], b[t])) for t in range(len(x))])
  assert averaging.init(_w0()).accumulator == ()
  for t in range(len(x)):
    np.testing.assert_allclose(runs[0][t], runs[1][t], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(runs[1][t], reference[t], rtol=2e-5, atol=2e-6)


def _np_diloco(x, y, *, sync_period, inner_lr, outer_lr, outer_momentum):
  """Douillard et al. 2023, Algorithm 1, with Adam inner and Nesterov outer."""
  b1, b2, eps = 0.9, 0.999, 1e-8
  w, b = _w0()
  center = np.concatenate([w, [b]]).astype(np.float64)
  p = np.tile(center, (R, 1))
  mu, nu = np.zeros_like(p), np.zeros_like(p)
  outer_m = np.zeros_like(center)
  history = []
  for t in range(len(x)):
    g = np.stack([_np_grad(p[i], x[t, i], y[t, i]) for i in range(R)])
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * g * g
    k = t + 1
    p = p - inner_lr * (mu / (1 - b1**k)) / (np.sqrt(nu / (1 - b2**k)) + eps)
    if k % sync_period == 0:
      delta = center - p.mean(0)  # outer gradient
      outer_m = outer_momentum * outer_m + delta
      center = center - outer_lr * (
        delta + outer_momentum * outer_m
      )  # Nesterov
      p = np.tile(center, (R, 1))
    history.append((p.copy(), center.copy()))
  return history


def test_diloco_matches_numpy_implementation_of_the_paper():
  sync_period, inner_lr = 3, 0.05
  tx = shardopt.diloco(
    optax.adam(inner_lr),
    "batch",
    sync_period=sync_period,
    outer_learning_rate=0.7,
    outer_momentum=0.9,
    nesterov=True,
  )
  x, y = _data(41, 9)
  reference = _np_diloco(
    x,
    y,
    sync_period=sync_period,
    inner_lr=inner_lr,
    outer_lr=0.7,
    outer_momentum=0.9,
  )
  history = _pmap_trajectory(tx, x, y)
  for t in range(len(x)):
    params, state = jax.tree.map(lambda v, t=t: v[t], history)
    np.testing.assert_allclose(
      _flat(params),
      reference[t][0],
      rtol=1e-4,
      atol=1e-5,
      err_msg=f"params at step {t + 1}",
    )
    np.testing.assert_allclose(
      _flat(state.center),
      np.tile(reference[t][1], (R, 1)),
      rtol=1e-4,
      atol=1e-5,
      err_msg=f"center at step {t + 1}",
    )
    _assert_identical_within_groups((state.center, state.global_state), None)
  assert np.all(state.sync_count == 3)


# --------------------------------------------------------------------------
# Robustness: non-finite replicas, exactness of the pull, checkpoints, dtypes.


def _grads_run(tx, grads, *, snap):
  """pmap(scan) over given per-step gradients (steps, R, D + 1).

  With ``snap`` the params are set to the center at a sync (the documented
  pattern). Returns per step (params, state, params' replica divergence).
  """

  def body(carry, g):
    params, state = carry
    updates, new_state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
    if snap:
      synced = new_state.sync_count > state.sync_count
      params = jax.tree.map(
        lambda p, c: jnp.where(synced, c, p), params, new_state.center
      )
    divergence = shardopt.replica_divergence(params, "batch")
    return (params, new_state), (params, new_state, divergence)

  def run(params, grads):
    _, history = jax.lax.scan(body, (params, tx.init(params)), grads)
    return history

  w, b = _w0()
  params = _stack(jnp.concatenate([w, jnp.array([b])]))
  history = jax.pmap(run, axis_name="batch")(params, grads.swapaxes(0, 1))
  params, state, divergence = jax.tree.map(
    lambda v: np.swapaxes(np.asarray(v), 0, 1), history
  )
  return [
    (
      params[t],
      jax.tree.map(lambda v, t=t: v[t], state),
      float(divergence[t][0]),
    )
    for t in range(len(grads))
  ]


def test_nan_in_one_replica_is_left_out_and_the_replica_rejoins_the_center():
  period, bad = 4, 3
  rng = np.random.default_rng(5)
  grads = rng.normal(size=(8, R, D + 1)).astype(np.float32)
  poisoned = grads.copy()
  poisoned[1, bad, 2] = np.nan  # one replica, one step
  tx = shardopt.agn(
    optax.sgd(LR, momentum=MOMENTUM), "batch", sync_period=period
  )
  clean = _grads_run(tx, grads, snap=True)
  run = _grads_run(tx, poisoned, snap=True)
  reference = _np_agn(
    None, None, period=period, reduction="mean", groups=None, grads=poisoned
  )
  others = [i for i in range(R) if i != bad]
  for t in range(period - 1):  # before the sync, the others do not notice
    np.testing.assert_array_equal(run[t][0][others], clean[t][0][others])
  for t, (params, state, _) in enumerate(run):
    np.testing.assert_allclose(
      params,
      reference[t][0],
      rtol=2e-5,
      atol=2e-6,
      equal_nan=True,
      err_msg=f"params at step {t + 1}",
    )
    np.testing.assert_allclose(
      np.asarray(state.center),
      reference[t][1],
      rtol=2e-5,
      atol=2e-6,
      err_msg=f"center at {t + 1}",
    )
  _, state, divergence = run[period - 1]
  print(
    f"NaN in replica {bad}: center after sync {np.asarray(state.center[0])},"
    f" skipped={int(state.skipped[0])}, params divergence {divergence}"
  )
  assert np.all(np.isfinite(np.asarray(state.center)))
  assert int(state.skipped[0]) == 1
  assert divergence == 0.0  # the bad replica is back
  # Flagged at the sync, its local momentum restarts (from zero) at its next
  # step: the others' momentum carries on.
  restart = np.asarray(state.restart)[:, 0]
  np.testing.assert_array_equal(restart, np.arange(R) == bad)
  _, after, _ = run[period]
  assert not np.asarray(after.restart).any()
  momentum = np.asarray(after.local_state[0].trace)
  np.testing.assert_allclose(
    momentum[bad], grads[period, bad], rtol=1e-6, err_msg="restarted momentum"
  )
  np.testing.assert_allclose(
    momentum[others],
    MOMENTUM * np.asarray(state.local_state[0].trace)[others]
    + grads[period, others],
    rtol=1e-6,
  )
  assert np.all(np.isfinite(run[-1][0]))
  assert int(run[-1][1].skipped[0]) == 1


def test_no_finite_replica_leaves_center_and_global_state_unchanged():
  period = 2
  grads = np.ones((2, R, D + 1), np.float32)
  grads[0, :, 0] = np.inf
  tx = shardopt.agn(
    optax.sgd(LR, momentum=MOMENTUM), "batch", sync_period=period
  )
  _, state, _ = _grads_run(tx, grads, snap=True)[-1]
  w, b = _w0()
  np.testing.assert_array_equal(
    np.asarray(state.center), np.tile(np.concatenate([w, [b]]), (R, 1))
  )
  np.testing.assert_array_equal(np.asarray(state.global_state[0].trace), 0.0)
  assert int(state.skipped[0]) == R and int(state.sync_count[0]) == 1


def test_params_pulled_onto_center_are_snapped_bit_identical():
  """params + (center - params) is not always bitwise center; the snap is."""
  rng = np.random.default_rng(8)
  grads = rng.normal(scale=3.0, size=(12, R, D + 1)).astype(np.float32)
  tx = shardopt.agn(optax.sgd(0.5), "batch", sync_period=3)
  pulled = _grads_run(tx, grads, snap=False)
  snapped = _grads_run(tx, grads, snap=True)
  after_sync = [pulled[t][2] for t in (2, 5, 8, 11)]
  print(
    f"params replica divergence right after each sync: pulled {after_sync},"
    f" snapped {[snapped[t][2] for t in (2, 5, 8, 11)]}"
  )
  for t in (2, 5, 8, 11):
    assert snapped[t][2] == 0.0
    np.testing.assert_array_equal(
      snapped[t][0], np.asarray(snapped[t][1].center)
    )
    # The pull lands within one rounding of the center.
    np.testing.assert_allclose(
      pulled[t][0], np.asarray(pulled[t][1].center), rtol=1e-6, atol=1e-6
    )


def test_state_restored_mid_period_continues_bit_identically():
  tx = shardopt.agn(
    optax.adam(0.05),
    "batch",
    sync_period=4,
    global_optimizer=optax.sgd(0.2, momentum=0.9),
  )
  x, y = _data(51, 10)

  def two_steps(params, state, x, y):
    (params, state), _ = jax.lax.scan(
      _scan_steps(tx, jax.grad(_loss)), (params, state), (x, y)
    )
    return params, state

  two_steps = jax.pmap(two_steps, axis_name="batch")
  xs, ys = x.swapaxes(0, 1), y.swapaxes(0, 1)
  chunk = lambda i: (xs[:, 2 * i : 2 * i + 2], ys[:, 2 * i : 2 * i + 2])

  params = _stack(_w0())
  state = jax.pmap(tx.init)(params)
  for i in range(5):
    params, state = two_steps(params, state, *chunk(i))
  uninterrupted = (params, state)

  params = _stack(_w0())
  state = jax.pmap(tx.init)(params)
  for i in range(3):
    params, state = two_steps(params, state, *chunk(i))
  saved = jax.tree.map(np.asarray, (params, state))  # mid-period checkpoint
  assert isinstance(saved[1], shardopt.PeriodicState)
  assert np.all(saved[1].count == 6) and np.all(saved[1].sync_count == 1)
  assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(saved))
  params, state = jax.tree.map(jnp.asarray, saved)
  for i in range(3, 5):
    params, state = two_steps(params, state, *chunk(i))
  chex.assert_trees_all_equal((params, state), uninterrupted)


def test_low_precision_gradients_accumulate_in_float32():
  tx = shardopt.agn(optax.sgd(0.0), "batch", sync_period=1000)
  params = jnp.zeros((R, 2), jnp.bfloat16)
  state = jax.pmap(tx.init)(params)
  assert state.accumulator.dtype == jnp.float32
  assert state.center.dtype == jnp.bfloat16
  # 256 + 1 is not a bfloat16 (it rounds to 256); in float32 it is exact.
  state = state._replace(accumulator=jnp.full((R, 2), 256.0, jnp.float32))
  step = jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name="batch")
  _, state = step(params, state, jnp.ones((R, 2), jnp.bfloat16))
  assert float(jnp.bfloat16(256) + jnp.bfloat16(1)) == 256.0
  np.testing.assert_array_equal(np.asarray(state.accumulator), 257.0)


# --------------------------------------------------------------------------
# Communication only at sync steps: read the compiled HLO.

_COLLECTIVE = re.compile(
  r"\b(all-reduce|all-reduce-start|all-gather|all-gather-start|reduce-scatter|"
  r"collective-permute|collective-permute-start|all-to-all)\("
)
_CALLS = re.compile(
  r"(?:calls|to_apply|body|condition|true_computation|"
  r"false_computation)=%?([\w.\-]+)"
)


def _computations(hlo):
  """{name: list of instruction lines}, plus the ENTRY computation's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def _branches(line):
  """(non-sync, sync) computations of a ``conditional`` instruction."""
  listed = re.search(r"branch_computations=\{([^}]*)\}", line)
  if (
    listed
  ):  # lax.cond lowers to a case on int(pred): [false branch, true branch]
    local_branch, sync_branch = [
      b.strip().lstrip("%") for b in listed.group(1).split(",")
    ]
    return local_branch, sync_branch
  true = re.search(r"true_computation=%?([\w.\-]+)", line).group(1)
  false = re.search(r"false_computation=%?([\w.\-]+)", line).group(1)
  return false, true


def _collective_counts(hlo):
  """Collective ops in the conds' sync branches, their other branches, and
  elsewhere."""
  comps, entry = _computations(hlo)

  def count(name, skip_conditionals):
    total = 0
    for line in comps[name]:
      total += bool(_COLLECTIVE.search(line))
      if skip_conditionals and " conditional(" in line:
        continue  # the branches are counted on their own
      for callee in set(_CALLS.findall(line)) & set(comps):
        total += count(callee, skip_conditionals)
    return total

  # One top-level cond, the sync's (its global step is a cond nested in its
  # sync branch; a left-out replica's restart is a select in its next step).
  conditionals = [line for line in comps[entry] if " conditional(" in line]
  assert len(conditionals) == 1, conditionals
  sync, local = zip(*(_branches(line)[::-1] for line in conditionals))
  return {
    "sync branch": sum(count(b, False) for b in sync),
    "non-sync branch": sum(count(b, False) for b in local),
    "outside the cond": count(entry, True),
    "conds with collectives": sum(bool(count(b, False)) for b in sync),
  }


def test_collectives_only_inside_the_sync_branch_under_pmap():
  tx = shardopt.agn(optax.adam(0.1), "batch", sync_period=4)
  params = _stack(_w0())
  state = jax.pmap(tx.init)(params)
  x, y = _data(61, 1)
  hlo = _pmap_step(tx).lower(params, state, x[0], y[0]).compile().as_text()
  counts = _collective_counts(hlo)
  print(f"pmap HLO collectives per step: {counts}")
  assert counts["sync branch"] >= 1 and counts["conds with collectives"] == 1
  assert counts["non-sync branch"] == 0 and counts["outside the cond"] == 0


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["all", "groups"])
def test_collectives_only_inside_the_sync_branch_under_shard_map(mesh, groups):
  tx = shardopt.agn(
    optax.adam(0.1), "batch", sync_period=4, axis_index_groups=groups
  )
  init, step = _shard_map_fns(tx, mesh)
  params = _rows(mesh, *_stack(_w0()))
  x, y = _data(62, 1)
  hlo = (
    step.lower(params, init(params), *_rows(mesh, x[0], y[0]))
    .compile()
    .as_text()
  )
  counts = _collective_counts(hlo)
  print(f"shard_map HLO collectives per step (groups={groups}): {counts}")
  assert counts["sync branch"] >= 1 and counts["conds with collectives"] == 1
  assert counts["non-sync branch"] == 0 and counts["outside the cond"] == 0


@pytest.mark.parametrize(
  "make",
  [
    lambda inner: shardopt.local_sgd(inner, "batch", sync_period=4),
    lambda inner: shardopt.diloco(inner, "batch", sync_period=4),
    lambda inner: shardopt.noloco(
      inner, "batch", sync_period=4, num_matchings=4
    ),
  ],
  ids=["local_sgd", "diloco", "noloco_4_matchings"],
)
def test_the_local_step_is_traced_once_per_update(make):
  """The local step runs where the step needs it and is recomputed in each
  sync's branch (and traced once more to read whether it communicates),
  but one trace serves them all: the inner optimizer's ``update`` runs once
  in Python per traced ``update`` (it ran 3 times for one sync, 6 for
  NoLoCo's 4 matchings, before it was one ``jax.jit``)."""
  base = optax.adam(0.1)
  traced = []

  def update(grads, state, params=None):
    traced.append(1)
    return base.update(grads, state, params)

  tx = make(optax.GradientTransformation(base.init, update))
  params = _stack(_w0())
  state = jax.pmap(tx.init)(params)
  jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name="batch").lower(
    params, state, params
  )
  assert len(traced) == 1, len(traced)


def test_comm_dtype_sets_the_wire_dtype_of_the_sync_all_reduce():
  tx = shardopt.agn(
    optax.sgd(0.1), "batch", sync_period=2, comm_dtype=jnp.bfloat16
  )
  params = _stack(_w0())
  state = jax.pmap(tx.init)(params)
  x, y = _data(63, 1)
  stablehlo = _pmap_step(tx).lower(params, state, x[0], y[0]).as_text()
  wires = re.findall(
    r"stablehlo.all_reduce.*?\) -> \(?(tensor<[^>]*>)", stablehlo, re.S
  )
  print(f"comm_dtype=bfloat16: all-reduce result types in StableHLO {wires}")
  assert any("bf16" in w for w in wires)
  assert np.asarray(state.accumulator[0]).dtype == np.float32


# --------------------------------------------------------------------------
# Convergence: AGN with T = 8 over 8 replicas vs synchronous training.


def test_agn_period_8_converges_close_to_synchronous_with_an_eighth_of_the_syncs():
  features, per_replica, steps, lr, period = 10, 64, 160, 0.5, 8
  rng = np.random.default_rng(0)
  w_true = rng.normal(size=features)
  x = rng.normal(size=(R, per_replica, features)).astype(np.float32)
  logits = x @ w_true + rng.normal(scale=1.0, size=(R, per_replica))
  y = (logits > 0).astype(np.float32)

  def loss(w, x, y):
    z = x @ w
    return jnp.mean(jnp.logaddexp(0.0, z) - y * z)

  def train(tx):
    def run(w, x, y):
      state = tx.init(w)

      def body(carry, _):
        w, state = carry
        updates, state = tx.update(jax.grad(loss)(w, x, y), state, w)
        return (optax.apply_updates(w, updates), state), None

      (w, state), _ = jax.lax.scan(body, (w, state), None, length=steps)
      return w, state

    return jax.pmap(run, axis_name="batch")(jnp.zeros((R, features)), x, y)

  w_sync, _ = train(shardopt.cross_shard(optax.sgd(lr), "batch"))
  w_agn, state = train(
    shardopt.agn(
      optax.sgd(lr),
      "batch",
      sync_period=period,
      global_optimizer=optax.sgd(lr * period),
    )
  )
  full_loss = lambda w: float(
    loss(jnp.asarray(w), x.reshape(-1, features), y.reshape(-1))
  )
  sync_loss, agn_loss = full_loss(w_sync[0]), full_loss(w_agn[0])
  print(
    f"convergence after {steps} steps: synchronous loss {sync_loss:.4f}"
    f" ({steps} all-reduces), AGN T={period} loss {agn_loss:.4f}"
    f" ({int(state.sync_count[0])} all-reduce rounds)"
  )
  assert int(state.sync_count[0]) == steps // period
  assert sync_loss < 0.5 * np.log(2.0)  # training did happen
  assert agn_loss <= 1.1 * sync_loss


# --------------------------------------------------------------------------
# Argument checks and errors.


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10", None])
def test_sync_period_must_be_a_positive_integer(bad):
  with pytest.raises(ValueError, match="shardopt.agn: sync_period="):
    shardopt.agn(optax.sgd(0.1), "batch", sync_period=bad)


def test_period_arguments_name_their_transform():
  with pytest.raises(ValueError, match="shardopt.local_sgd: sync_period=0"):
    shardopt.local_sgd(optax.sgd(0.1), "batch", sync_period=0)
  with pytest.raises(ValueError, match="shardopt.diloco: sync_period=0"):
    shardopt.diloco(optax.sgd(0.1), "batch", sync_period=0)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"outer_learning_rate": 0.0}, "outer_learning_rate=0.0"),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
  ],
)
def test_diloco_outer_arguments_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    shardopt.diloco(optax.sgd(0.1), "batch", **kwargs)


def test_diloco_nesterov_not_a_bool_is_a_type_error():
  with pytest.raises(TypeError, match="shardopt.diloco: nesterov='yes'"):
    shardopt.diloco(optax.sgd(0.1), "batch", nesterov="yes")


def test_unsupported_reduction_raises_at_construction():
  with pytest.raises(
    ValueError, match="Unsupported reduction: 'max' in shardopt.agn"
  ):
    shardopt.agn(optax.sgd(0.1), "batch", reduction="max")


@pytest.mark.parametrize(
  "make",
  [
    lambda: shardopt.agn(optax.sgd(0.1), None),
    lambda: shardopt.local_sgd(optax.sgd(0.1), None, sync_period=2),
    lambda: shardopt.diloco(optax.sgd(0.1), None),
  ],
)
def test_axis_name_none_is_rejected(make):
  with pytest.raises(ValueError, match="needs a named axis"):
    make()


def test_unbound_axis_names_the_transform_and_the_fix():
  tx = shardopt.agn(optax.sgd(0.1), "batch")
  params = jnp.zeros(2)
  with pytest.raises(
    shardopt.AxisNotBoundError, match="shardopt.agn: axis name 'batch'"
  ):
    tx.update(params, tx.init(params), params)


def test_update_needs_params():
  tx = shardopt.agn(optax.sgd(0.1), "batch")
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="batch")
  with pytest.raises(ValueError, match="shardopt.agn: params are required"):
    step(jnp.zeros((R, 2)), jax.pmap(tx.init)(jnp.zeros((R, 2))))


def test_groups_are_validated_at_trace_time():
  tx = shardopt.agn(
    optax.sgd(0.1), "batch", axis_index_groups=[[0, 1, 2, 3], [3, 4, 5, 6]]
  )
  step = jax.pmap(lambda g, s: tx.update(g, s, g), axis_name="batch")
  with pytest.raises(
    ValueError, match="shardopt.agn: .*index 3 appears more than once"
  ):
    step(jnp.zeros((R, 2)), jax.pmap(tx.init)(jnp.zeros((R, 2))))


def _abstract(mesh, shape, spec):
  return jax.ShapeDtypeStruct(
    shape, jnp.float32, sharding=NamedSharding(mesh, spec)
  )


def test_invariant_gradients_are_rejected_with_the_fix(mesh):
  tx = shardopt.agn(optax.sgd(0.1), "batch")

  def step(w, x):  # replicated params: autodiff sums the gradient over "batch"
    grads = jax.grad(lambda w: jnp.sum(w * x))(w)
    return tx.update(grads, tx.init(w), w)[0]

  f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
  with pytest.raises(
    ValueError,
    match=r"shardopt.agn: the gradient .* invariant over"
    r" axis 'batch'.*jax.lax.pcast\(params, 'batch', to='varying'\)",
  ):
    jax.eval_shape(
      f, _abstract(mesh, (1,), P()), _abstract(mesh, (8,), P("batch"))
    )


def test_groups_need_a_varying_center_under_shard_map(mesh):
  tx = shardopt.agn(optax.sgd(0.1), "batch", axis_index_groups=GROUPS)

  def step(w, x):
    state = tx.init(w)  # center from replicated params
    local = jax.lax.pcast(w, "batch", to="varying")
    grads = jax.grad(lambda w: jnp.sum(w * x))(local)
    return tx.update(grads, state, local)[0]

  f = jax.shard_map(
    step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P("batch")
  )
  with pytest.raises(
    ValueError, match="shardopt.agn: with axis_index_groups each group"
  ):
    jax.eval_shape(
      f, _abstract(mesh, (1,), P()), _abstract(mesh, (8,), P("batch"))
    )


# --------------------------------------------------------------------------
# Warm-up: synchronous steps on the mean gradient before the schedule.


def _np_warm_start(x, y, *, warmup, period, inner, outer, groups=None):
  """Steps 1..warmup: every replica of a group takes the inner step on the
  group's mean gradient and the center follows the params; then local
  steps, and a sync after steps warmup + period, warmup + 2 period, ...
  ``inner(p, g, k)`` is one inner step (k counts inner steps, from 1);
  ``outer(center, delta)`` the outer step on the mean outer gradient."""
  w, b = _w0()
  start = np.concatenate([w, [b]]).astype(np.float64)
  p, center = np.tile(start, (R, 1)), np.tile(start, (R, 1))
  history = []
  for t in range(1, len(x) + 1):
    g = np.stack([_np_grad(p[i], x[t - 1, i], y[t - 1, i]) for i in range(R)])
    if t <= warmup:
      for group in groups or [list(range(R))]:
        g[group] = g[group].mean(0)
    p = inner(p, g, t)
    if t <= warmup:
      center = p.copy()
    elif (t - warmup) % period == 0:
      for group in groups or [list(range(R))]:
        delta = center[group[0]] - p[group].mean(0)
        center[group] = outer(center[group[0]], delta)
        p[group] = center[group]
    history.append((p.copy(), center.copy()))
  return history


def _np_adam(lr, b1=0.9, b2=0.999, eps=1e-8):
  moments = {}

  def step(p, g, k):
    mu, nu = moments.get("m", (np.zeros_like(p), np.zeros_like(p)))
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * g * g
    moments["m"] = (mu, nu)
    return p - lr * (mu / (1 - b1**k)) / (np.sqrt(nu / (1 - b2**k)) + eps)

  return step


def _np_nesterov(lr, momentum):
  buffer = {}

  def step(center, delta):
    m = momentum * buffer.get("m", np.zeros_like(delta)) + delta
    buffer["m"] = m
    return center - lr * (delta + momentum * m)

  return step


def _check_warm_start(history, reference, warmup):
  for t, (want_p, want_c) in enumerate(reference, 1):
    params, state = jax.tree.map(lambda v, t=t: v[t - 1], history)
    got = _flat(params)
    np.testing.assert_allclose(got, want_p, rtol=1e-4, atol=1e-5, err_msg=t)
    np.testing.assert_allclose(
      _flat(state.center), want_c, rtol=1e-4, atol=1e-5, err_msg=t
    )
    if t <= warmup:  # one synchronous model
      np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
      assert int(state.sync_count[0]) == 0


@pytest.mark.parametrize("warmup", [0, 3])
def test_diloco_warm_start_matches_numpy(warmup):
  """DiLoCo's synchronous start: Adam on the mean gradient for W steps,
  then H local steps per outer Nesterov step, the first after step W + H."""
  period, lr = 3, 0.05
  tx = shardopt.diloco(
    optax.adam(lr),
    "batch",
    sync_period=period,
    warmup_steps=warmup,
    outer_learning_rate=0.7,
    outer_momentum=0.9,
  )
  x, y = _data(43, warmup + 2 * period + 1)
  reference = _np_warm_start(
    x,
    y,
    warmup=warmup,
    period=period,
    inner=_np_adam(lr),
    outer=_np_nesterov(0.7, 0.9),
  )
  history = _pmap_trajectory(tx, x, y)
  _check_warm_start(history, reference, warmup)
  assert int(history[1].sync_count[-1, 0]) == 2


@pytest.mark.parametrize("kind", ["local_sgd", "agn"])
def test_local_sgd_and_agn_warm_start_within_groups_match_numpy(kind):
  """Within each group of axis_index_groups the warm-up averages the
  gradients of that group; agn with global sgd(lr * period) is local SGD
  (its accumulator starts after the warm-up)."""
  warmup, period, lr = 2, 3, 0.1
  if kind == "agn":
    tx = shardopt.agn(
      optax.sgd(lr),
      "batch",
      sync_period=period,
      global_optimizer=optax.sgd(lr * period),
      axis_index_groups=GROUPS,
      warmup_steps=warmup,
    )
  else:
    tx = shardopt.local_sgd(
      optax.sgd(lr),
      "batch",
      sync_period=period,
      axis_index_groups=GROUPS,
      warmup_steps=warmup,
    )
  x, y = _data(44, warmup + 2 * period)
  reference = _np_warm_start(
    x,
    y,
    warmup=warmup,
    period=period,
    inner=lambda p, g, k: p - lr * g,
    outer=lambda center, delta: center - delta,
    groups=GROUPS,
  )
  history = _pmap_trajectory(tx, x, y)
  for t, (want_p, want_c) in enumerate(reference, 1):
    params, state = jax.tree.map(lambda v, t=t: v[t - 1], history)
    np.testing.assert_allclose(
      _flat(params), want_p, rtol=1e-4, atol=1e-5, err_msg=t
    )
    np.testing.assert_allclose(
      _flat(state.center), want_c, rtol=1e-4, atol=1e-5, err_msg=t
    )
    _assert_identical_within_groups(state.center, GROUPS)


def test_warm_start_runs_its_all_reduce_only_in_its_branch():
  """The warm-up's gradient all-reduce sits in a cond on the counter, like
  the sync's: the compiled step runs no collective outside conditionals."""
  from shardopt.measure import hlo  # noqa: PLC0415

  tx = shardopt.diloco(optax.adam(0.1), "batch", sync_period=4, warmup_steps=5)
  params = _stack(_w0())
  x, y = _data(1, 1)
  text = (
    _pmap_step(tx)
    .lower(params, jax.pmap(tx.init)(params), x[0], y[0])
    .compile()
    .as_text()
  )
  ops = hlo.compiled_collectives(text)
  assert [op for op in ops if op.context == "top"] == [], ops
  # The warm-up's all-reduce of the gradient, and the sync's.
  assert len({op.branch.split("#")[0] for op in ops}) >= 2, ops


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_warmup_steps_must_be_a_non_negative_integer(bad):
  with pytest.raises(ValueError, match=r"shardopt\.local_sgd: warmup_steps"):
    shardopt.local_sgd(optax.sgd(0.1), "batch", sync_period=2, warmup_steps=bad)
