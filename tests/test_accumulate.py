"""shardopt.accumulate: optax.MultiSteps' numbers, one communication per period.

References: ``optax.MultiSteps`` (the same numbers), numpy, and the compiled
HLO (where the collectives sit; how many buffers XLA copies). Run with
``pytest -s`` to see the HLO figures quoted in the README.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiled import compiled_update
from _compiled import varying_state_specs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt import _axes
from shardopt.measure import hlo

AXIS = "batch"
R = 8


def _tree(rng, dtypes=(jnp.float32, jnp.float32), lead=()):
  return {
    "w": jnp.asarray(rng.normal(size=lead + (3, 4)), dtypes[0]),
    "b": jnp.asarray(rng.normal(size=lead + (5,)), dtypes[1]),
  }


def _adam():
  return optax.adam(0.05)


# --- Same numbers as optax.MultiSteps. ---------------------------------------

CASES = [  # (every_k_steps, use_grad_mean, dtypes, inner, seed)
  (1, True, (jnp.float32, jnp.float32), "sgd", 0),
  (3, True, (jnp.float32, jnp.float32), "adam", 1),
  (4, False, (jnp.float32, jnp.float32), "momentum", 2),
  (2, True, (jnp.bfloat16, jnp.bfloat16), "sgd", 3),
  (5, False, (jnp.float16, jnp.float32), "momentum", 4),
  (3, True, (jnp.float32, jnp.bfloat16), "adam", 5),
]
INNERS = {
  "sgd": lambda: optax.sgd(0.1),
  "adam": _adam,
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


@pytest.mark.parametrize("k, mean, dtypes, inner, seed", CASES)
def test_same_numbers_as_optax_multisteps(k, mean, dtypes, inner, seed):
  rng = np.random.default_rng(seed)
  params = _tree(rng, dtypes)
  tx = shardopt.accumulate(INNERS[inner](), k, use_grad_mean=mean)
  ref = optax.MultiSteps(INNERS[inner](), k, use_grad_mean=mean)
  state, ref_state = tx.init(params), ref.init(params)
  for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(state.acc_grads)):
    assert a.dtype == jnp.promote_types(
      p.dtype, jnp.float32
    )  # f32 for bf16/f16
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  # The adam cases differ from optax by at most an ulp or two (XLA fuses the
  # branch differently); sgd and momentum are bit-identical.
  tol = (
    {"rtol": 0, "atol": 0} if inner != "adam" else {"rtol": 1e-6, "atol": 1e-7}
  )
  for step in range(2 * k + 1):
    grads = _tree(rng, dtypes)
    updates, state = update(grads, state, params)
    want, ref_state = ref_update(grads, ref_state, params)
    chex.assert_trees_all_close(updates, want, **tol)
    chex.assert_trees_all_equal_dtypes(updates, want)
    assert int(state.mini_step) == int(ref_state.mini_step) == (step + 1) % k
    assert (
      int(state.gradient_step)
      == int(ref_state.gradient_step)
      == (step + 1) // k
    )
    if int(
      state.mini_step
    ):  # after an update optax zeroes, shardopt ignores it
      chex.assert_trees_all_equal(state.acc_grads, ref_state.acc_grads)
    chex.assert_trees_all_close(
      state.inner_state, ref_state.inner_opt_state, **tol
    )


def test_accumulated_mean_matches_numpy_and_sum_is_k_times_it():
  k, lr = 3, 0.5
  rng = np.random.default_rng(5)
  grads = rng.normal(size=(k, 6)).astype(np.float32)
  for mean in (True, False):
    tx = shardopt.accumulate(optax.sgd(lr), k, use_grad_mean=mean)
    state = tx.init(jnp.zeros(6))
    for g in grads:
      updates, state = tx.update(jnp.asarray(g), state)
    want = -lr * (grads.astype(np.float64).mean(0) if mean else grads.sum(0))
    np.testing.assert_allclose(updates, want, rtol=1e-6)


# --- Mixed precision: any params/gradients/inner-state dtypes MultiSteps takes.

MIXED = [  # (params dtype, gradients dtype)
  (jnp.float16, jnp.float32),
  (jnp.float32, jnp.bfloat16),
  (jnp.float16, jnp.bfloat16),
  (jnp.bfloat16, jnp.float16),
]
MU_DTYPES = [None, jnp.float32]  # adam's moments: the params' dtype, or f32


def _mixed_id(case):
  return getattr(case, "__name__", str(case))


def test_f16_params_f32_grads_emit_the_issue_numbers():
  """The report: f16 params, f32 gradients, adam's mu_dtype=None."""
  w = jnp.array([1.0, 0.0, -1.0], jnp.float16)
  g = jnp.array([1.0, 0.0, -1.0], jnp.float32)
  tx = shardopt.accumulate(optax.adam(0.1), 2)
  state = tx.init(w)
  first, state = tx.update(g, state, w)
  second, state = tx.update(g, state, w)
  np.testing.assert_array_equal(first, np.zeros(3, np.float32))
  # optax.MultiSteps(optax.adam(0.1), 2) emits these bits on the same input.
  np.testing.assert_array_equal(
    second, np.array([-0.09999934, -0.0, 0.09999934], np.float32)
  )
  assert state.inner_state[0].mu.dtype == jnp.float16  # the old state's dtype


@pytest.mark.parametrize("mu_dtype", MU_DTYPES, ids=_mixed_id)
@pytest.mark.parametrize(
  "dtypes", MIXED, ids=lambda d: "/".join(map(_mixed_id, d))
)
def test_mixed_precision_same_numbers_as_optax_multisteps(dtypes, mu_dtype):
  param_dtype, grad_dtype = dtypes
  k, rng = 3, np.random.default_rng(11)
  params = _tree(rng, (param_dtype, param_dtype))
  tx = shardopt.accumulate(optax.adam(0.05, mu_dtype=mu_dtype), k)
  ref = optax.MultiSteps(optax.adam(0.05, mu_dtype=mu_dtype), k)
  state, ref_state = tx.init(params), ref.init(params)
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  for step in range(2 * k + 1):
    grads = _tree(rng, (grad_dtype, grad_dtype))
    updates, state = update(grads, state, params)
    want, ref_state = ref_update(grads, ref_state, params)
    chex.assert_trees_all_equal_dtypes(updates, want)
    chex.assert_trees_all_equal_dtypes(
      state.inner_state, ref_state.inner_opt_state
    )
    if (step + 1) % k:  # a mini-step: zeros (MultiSteps may give -0.)
      for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u, np.zeros_like(u))
    else:
      chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(
      state.inner_state, ref_state.inner_opt_state, rtol=1e-6, atol=1e-7
    )
    assert int(state.gradient_step) == int(ref_state.gradient_step)


def _shard_map_run(tx, params, grads):
  """Like :func:`_pmap_run`, under a checking shard_map: P() params, varying
  per-replica gradients (steps, R, ...) split over AXIS. Returns every
  replica's params after every step, (steps, R, ...)."""
  mesh = _mesh()
  steps = jax.tree.leaves(grads)[0].shape[0]

  def run(params, grads):
    state, history = tx.init(params), []
    for t in range(steps):
      g = jax.tree.map(lambda a: a[t], grads)
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      assert not any(map(_axes.varying_axes, jax.tree.leaves(params)))
      # Each replica's own bits, to check that they are the same everywhere.
      history.append(
        jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
      )
    return jax.tree.map(lambda *h: jnp.stack(h)[:, None], *history)

  f = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P(), P(None, AXIS)),
      out_specs=P(None, AXIS),
    )
  )
  split = jax.tree.map(
    lambda g: g.reshape((g.shape[0], R * g.shape[2]) + g.shape[3:]), grads
  )
  out = f(params, _put(mesh, split, P(None, AXIS)))
  return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
@pytest.mark.parametrize("mu_dtype", MU_DTYPES, ids=_mixed_id)
@pytest.mark.parametrize(
  "dtypes", MIXED, ids=lambda d: "/".join(map(_mixed_id, d))
)
def test_mixed_precision_cross_shard_matches_multisteps_and_stays_in_sync(
  dtypes, mu_dtype, mapping
):
  param_dtype, grad_dtype = dtypes
  k, steps = 2, 5
  rng = np.random.default_rng(12)
  params = _tree(rng, (param_dtype, param_dtype))
  grads = _tree(rng, (grad_dtype, grad_dtype), lead=(steps, R))

  def inner():
    return shardopt.cross_shard(optax.adam(0.05, mu_dtype=mu_dtype), AXIS)

  run = {"pmap": _pmap_run, "shard_map": _shard_map_run}[mapping]
  got = run(shardopt.accumulate(inner(), k), params, grads)
  want = _pmap_run(
    optax.MultiSteps(inner(), k).gradient_transformation(), params, grads
  )
  chex.assert_trees_all_equal_dtypes(got, want)
  chex.assert_trees_all_close(
    jax.tree.map(lambda a: a.astype(np.float32), got),
    jax.tree.map(lambda a: a.astype(np.float32), want),
    rtol=1e-6,
    atol=1e-7,
  )
  for leaf in jax.tree.leaves(got):  # bit-identical on every replica
    chex.assert_trees_all_equal(*[leaf[:, r] for r in range(R)])
  for leaf, p in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    assert not np.array_equal(leaf[k - 1, 0], p)  # the emit step moved them


# --- every_k_steps as a schedule of the gradient step. -------------------------


def _growing(step):
  """1 mini-step for the first update, 2 for the second, then 3."""
  return jnp.minimum(step + 1, 3)


def test_growing_schedule_same_numbers_as_multisteps_on_one_device():
  rng = np.random.default_rng(13)
  params = _tree(rng)
  tx = shardopt.accumulate(_adam(), _growing)
  ref = optax.MultiSteps(_adam(), _growing)
  state, ref_state = tx.init(params), ref.init(params)
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  emitted = []
  for step in range(12):
    grads = _tree(rng)
    updates, state = update(grads, state, params)
    want, ref_state = ref_update(grads, ref_state, params)
    chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-7)
    assert int(state.mini_step) == int(ref_state.mini_step)
    assert int(state.gradient_step) == int(ref_state.gradient_step)
    chex.assert_trees_all_close(
      state.inner_state, ref_state.inner_opt_state, rtol=1e-6, atol=1e-7
    )
    if int(state.mini_step) == 0:
      emitted.append(step)
  # Periods of 1, 2, 3, 3, 3 mini-steps end at steps 0, 2, 5, 8, 11.
  assert emitted == [0, 2, 5, 8, 11]


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_growing_schedule_under_cross_shard_matches_multisteps_in_sync(mapping):
  steps = 9
  rng = np.random.default_rng(14)
  params = _tree(rng)
  grads = _tree(rng, lead=(steps, R))
  inner = INNER_COMMUNICATING["cross_shard(adam)"]
  run = {"pmap": _pmap_run, "shard_map": _shard_map_run}[mapping]
  got = run(shardopt.accumulate(inner(), _growing), params, grads)
  want = _pmap_run(
    optax.MultiSteps(inner(), _growing).gradient_transformation(),
    params,
    grads,
  )
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  for leaf in jax.tree.leaves(got):  # bit-identical on every replica
    chex.assert_trees_all_equal(*[leaf[:, r] for r in range(R)])
  moved = [
    t
    for t in range(steps)
    if not np.array_equal(
      got["b"][t, 0], (got["b"][t - 1, 0] if t else params["b"])
    )
  ]
  assert moved == [0, 2, 5, 8]


@pytest.mark.parametrize("spelling", ["pmap", "varying"])
def test_a_schedule_decides_without_a_collective(spelling):
  text = compiled_update(
    shardopt.accumulate(INNER_COMMUNICATING["cross_shard(adam)"](), _growing),
    spelling,
  )
  counts = _contexts(text)
  print(f"\n[hlo] accumulate(cross_shard(adam), schedule).update: {counts}")
  assert set(counts) == {"conditional"}, counts  # none at the top level


@pytest.mark.parametrize(
  "returns",
  [2.0, jnp.float32(2), jnp.array([2, 2]), True, "4", None],
  ids=["float", "f32 array", "vector", "bool", "str", "None"],
)
def test_a_schedule_must_return_an_integer_scalar(returns):
  tx = shardopt.accumulate(optax.sgd(0.1), lambda step: returns)
  with pytest.raises(
    TypeError, match=r"shardopt.accumulate: every_k_steps=.*integer scalar"
  ):
    tx.update(jnp.zeros(3), tx.init(jnp.zeros(3)))


# --- Under pmap: per-replica gradients, communicating inner transforms. ------


def _pmap_run(tx, params, grads):
  """grads (steps, R, ...): every step in one pmapped scan; returns params per step."""

  def run(params, grads):
    def step(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), params

    return jax.lax.scan(step, (params, tx.init(params)), grads)[1]

  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (R,) + p.shape), params)
  out = jax.pmap(run, axis_name=AXIS)(
    stacked, jax.tree.map(lambda g: jnp.swapaxes(g, 0, 1), grads)
  )
  return jax.tree.map(lambda v: np.swapaxes(np.asarray(v), 0, 1), out)


INNER_COMMUNICATING = {
  "cross_shard(adam)": lambda: shardopt.cross_shard(_adam(), AXIS),
  "tower(adam)": lambda: shardopt.tower(_adam(), AXIS),
  "chain(clip, cross_shard_mean, adam)": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), shardopt.cross_shard_mean(AXIS), _adam()
  ),
}


@pytest.mark.parametrize("inner", sorted(INNER_COMMUNICATING))
def test_per_replica_gradients_match_multisteps_and_stay_in_sync(inner):
  k, steps = 3, 7
  rng = np.random.default_rng(6)
  params = _tree(rng)
  grads = _tree(rng, lead=(steps, R))  # a different gradient on every replica
  got = _pmap_run(
    shardopt.accumulate(INNER_COMMUNICATING[inner](), k), params, grads
  )
  # tower equals cross_shard for an elementwise inner transform.
  ref_inner = INNER_COMMUNICATING[
    "cross_shard(adam)" if inner == "tower(adam)" else inner
  ]()
  want = _pmap_run(
    optax.MultiSteps(ref_inner, k).gradient_transformation(), params, grads
  )
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  for leaf in jax.tree.leaves(got):  # bit-identical on every replica
    chex.assert_trees_all_equal(*[leaf[:, r] for r in range(R)])
  # Nothing moves on a mini-step.
  for leaf, p in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_array_equal(leaf[0, 0], p)
    np.testing.assert_array_equal(leaf[k - 2, 0], p)
    assert not np.array_equal(leaf[k - 1, 0], p)


# --- HLO: where the collectives sit. -----------------------------------------


def _mesh():
  return jax.make_mesh((R,), (AXIS,))


def _put(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


def _contexts(text):
  return hlo.summarize(hlo.compiled_collectives(text, num_devices=R))["count"]


HLO_CASES = [
  ("pmap", "cross_shard(adam)"),
  ("pmap", "tower(adam)"),
  ("pmap", "chain(clip, cross_shard_mean, adam)"),
  ("invariant", "tower(adam)"),
  ("varying", "cross_shard(adam)"),
  ("varying", "tower(adam)"),
  ("varying", "chain(clip, cross_shard_mean, adam)"),
]


@pytest.mark.parametrize("spelling, inner", HLO_CASES)
def test_every_collective_of_the_update_sits_in_the_emit_branch(
  spelling, inner
):
  text = compiled_update(
    shardopt.accumulate(INNER_COMMUNICATING[inner](), 4), spelling
  )
  counts = _contexts(text)
  print(f"\n[hlo] accumulate({inner}, 4).update, {spelling}: {counts}")
  assert set(counts) == {"conditional"}, counts  # none at the top level
  assert sum(counts["conditional"].values()) >= 1


def test_optax_multisteps_communicates_outside_any_branch():
  text = compiled_update(
    optax.MultiSteps(
      INNER_COMMUNICATING["cross_shard(adam)"](), 4
    ).gradient_transformation(),
    "pmap",
  )
  counts = _contexts(text)
  print(
    f"\n[hlo] optax.MultiSteps(cross_shard(adam), 4).update, pmap: {counts}"
  )
  assert counts.get("top", {}).get("all-reduce", 0) >= 1


def _loss(w, x):
  return jnp.sum((x * w - 1.0) ** 2)


def _whole_step_collectives(cast_to_varying):
  """Compiled training step with P() params: (top-level, in-branch) collectives."""
  mesh, size = _mesh(), 1024
  tx = shardopt.accumulate(shardopt.cross_shard(optax.sgd(0.1), AXIS), 4)
  g_spec = P(AXIS) if cast_to_varying else P()
  w = jnp.zeros([size])
  specs = varying_state_specs(tx, mesh, w, g_spec)

  def step(w, state, x):
    local = jax.lax.pcast(w, AXIS, to="varying") if cast_to_varying else w
    grads = jax.grad(_loss)(local, x)
    updates, state = tx.update(grads, state, w)
    return optax.apply_updates(w, updates), state

  state = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  )(w)
  f = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)
    )
  )
  x = _put(mesh, jnp.ones([R * size]), P(AXIS))
  counts = _contexts(f.lower(_put(mesh, w, P()), state, x).compile().as_text())
  top = sum(counts.get("top", {}).values())
  branch = sum(counts.get("conditional", {}).values())
  return top, branch


def test_replicated_params_all_reduce_in_autodiff_on_every_mini_step():
  top, branch = _whole_step_collectives(cast_to_varying=False)
  print(
    f"\n[hlo] whole step, P() params, jax.grad(params): {top} collective(s)"
    f" on every mini-step, {branch} in the emit branch"
  )
  assert top >= 1  # autodiff's psum: no optimizer can remove it


def test_params_cast_to_varying_communicate_once_per_period():
  top, branch = _whole_step_collectives(cast_to_varying=True)
  print(
    f"\n[hlo] whole step, P() params cast to varying before jax.grad: {top}"
    f" collective(s) on every mini-step, {branch} in the emit branch"
  )
  assert top == 0 and branch >= 1


# --- HLO: a mini-step copies no more than a bare gradient add. ----------------


def _copies(text):
  """Copy instructions of a buffer with more than one element."""
  found = []
  for line in text.splitlines():
    match = re.search(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+copy\(", line)
    if (
      match
      and int(np.prod([int(d) for d in match.group(2).split(",") if d] or [1]))
      > 1
    ):
      found.append(line.strip())
  return found


def _bare_step(k):
  """The least a mini-step can do: add the gradient, count, return zeros."""
  inner = shardopt.cross_shard(_adam(), AXIS)

  def update(grads, state, params):
    return jax.tree.map(jnp.zeros_like, params), state._replace(
      mini_step=state.mini_step + 1,
      acc_grads=jax.tree.map(lambda a, g: a + g, state.acc_grads, grads),
    )

  return optax.GradientTransformation(
    shardopt.accumulate(inner, k).init, update
  )


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_mini_step_copies_no_buffer_a_bare_gradient_add_does_not(mapping):
  size = 1 << 14

  def compiled(tx):
    def step(w, state, g):
      updates, state = tx.update(g, state, w)
      return optax.apply_updates(w, updates), state

    if mapping == "pmap":
      w = jnp.zeros([R, size])
      f = jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1))
      return f.lower(w, jax.pmap(tx.init)(w), w).compile().as_text()
    mesh = _mesh()
    w = jnp.zeros([size])
    specs = varying_state_specs(tx, mesh, w, P(AXIS))
    state = jax.jit(
      jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    )(w)
    f = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)
      ),
      donate_argnums=(0, 1),
    )
    return (
      f.lower(
        _put(mesh, w, P()), state, _put(mesh, jnp.zeros([R * size]), P(AXIS))
      )
      .compile()
      .as_text()
    )

  got = _copies(
    compiled(shardopt.accumulate(shardopt.cross_shard(_adam(), AXIS), 4))
  )
  bare = _copies(compiled(_bare_step(4)))
  print(
    f"\n[hlo] whole step, donated, {mapping}: accumulate copies"
    f" {len(got)} array buffer(s), a bare gradient add {len(bare)}"
  )
  # Under shard_map a mini-step copies nothing a bare add does not (the
  # scalar counter's 4-byte copy aside). Under pmap, whose per-device
  # (1, n) buffers XLA bitcasts around the cond, it copies the accumulator
  # and the params once more.
  extra = {"shard_map": 0, "pmap": 2}[mapping]
  assert len(got) <= len(bare) + extra, (got, bare)


# --- Counters typed varying, or stacked with the rest of the state. -----------


@pytest.mark.parametrize(
  "k, updates", [(2, 2), (_growing, 2)], ids=["k=2", "schedule"]
)
@pytest.mark.parametrize("inner", ["cross_shard(adam)", "tower(adam)"])
def test_whole_state_under_p_axis_matches_pmap(inner, k, updates):
  """The state built stacked (jax.pmap(tx.init)), every leaf under P(AXIS):
  the counters arrive typed varying, and so does a schedule's value."""
  steps = 5
  rng = np.random.default_rng(8)
  params = _tree(rng)
  grads = _tree(rng, lead=(steps, R))
  tx = shardopt.accumulate(INNER_COMMUNICATING[inner](), k)
  want = _pmap_run(tx, params, grads)
  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (R,) + p.shape), params)
  state = jax.pmap(tx.init, axis_name=AXIS)(stacked)
  mesh = _mesh()

  def step(params, state, g):  # every leaf has a leading 1 here, varying
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  )
  params, state = _put(mesh, (stacked, state), P(AXIS))
  for t in range(steps):
    params, state = f(
      params, state, _put(mesh, jax.tree.map(lambda g: g[t], grads), P(AXIS))
    )
    jax.block_until_ready(params)
    chex.assert_trees_all_close(
      jax.tree.map(np.asarray, params),
      jax.tree.map(lambda v: v[t], want),
      rtol=1e-6,
      atol=1e-7,
    )
  assert state.mini_step.shape == (R,)
  np.testing.assert_array_equal(np.asarray(state.gradient_step), updates)


def test_scalar_counter_typed_varying_keeps_replicated_params_replicated():
  k, lr = 2, 0.5
  mesh = _mesh()
  tx = shardopt.accumulate(shardopt.cross_shard(optax.sgd(lr), AXIS), k)
  grads = np.random.default_rng(9).normal(size=(k, R, 3)).astype(np.float32)

  def run(w, g):
    state = tx.init(w)
    state = state._replace(
      mini_step=jax.lax.pcast(state.mini_step, AXIS, to="varying")
    )
    for t in range(k):
      updates, state = tx.update(g[t], state, w)
      w = optax.apply_updates(w, updates)
    assert not _axes.varying_axes(w)  # P() params stay P()
    return w

  f = jax.jit(
    jax.shard_map(run, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P())
  )
  w = f(jnp.zeros(3), _put(mesh, grads.reshape(k, R * 3), P(None, AXIS)))
  np.testing.assert_allclose(w, -lr * grads.mean(axis=(0, 1)), rtol=1e-6)


def test_a_counter_with_more_than_one_element_is_an_error_with_the_specs():
  tx = shardopt.accumulate(optax.sgd(0.1), 2)
  state = tx.init(jnp.zeros(3))._replace(mini_step=jnp.zeros([2], jnp.int32))
  with pytest.raises(
    ValueError,
    match=r"shardopt.accumulate: state.mini_step has"
    r" shape \(2,\).*spec P\(\)",
  ):
    tx.update(jnp.zeros(3), state)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4", None])
def test_every_k_steps_must_be_a_positive_integer_or_a_schedule(bad):
  with pytest.raises(
    ValueError,
    match=r"shardopt.accumulate: every_k_steps=.* must be a positive integer"
    r".* or a callable of the gradient step",
  ):
    shardopt.accumulate(optax.sgd(0.1), bad)
