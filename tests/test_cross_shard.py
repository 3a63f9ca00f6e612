"""CrossShardOptimizer as optax transforms: TensorFlow's oracle, clipping order,
and composition with optax's wrappers, each against numpy or TF's numbers."""

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
MAPPINGS = ("pmap", "shard_map_check_vma", "shard_map_no_check_vma")


def _mesh(n):
  return jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])


def _on_replicas(mapping, per_replica_fn, *stacked):
  """Runs ``per_replica_fn`` on each row of ``stacked`` (one row per replica).

  Inputs and outputs are stacked along axis 0, under ``pmap`` or under a
  ``shard_map`` over a mesh of as many devices as there are rows.
  """
  n = jax.tree.leaves(stacked)[0].shape[0]
  if mapping == "pmap":
    fn = jax.pmap(per_replica_fn, axis_name=AXIS, devices=jax.devices()[:n])
    return jax.device_get(fn(*stacked))

  def body(*args):
    out = per_replica_fn(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: x[None], out)

  mesh = _mesh(n)
  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=P(AXIS),
      out_specs=P(AXIS),
      check_vma=mapping == "shard_map_check_vma",
    )
  )
  return jax.device_get(
    fn(*jax.device_put(stacked, NamedSharding(mesh, P(AXIS))))
  )


def _steps(tx, params, grads_per_step):
  """Runs ``tx`` from ``tx.init(params)`` over a sequence of gradients."""
  state = tx.init(params)
  for grads in grads_per_step:
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


# TensorFlow's oracle (design.md section 4): 4 replicas, SGD lr 1, w0 = 0,
# per-replica raw gradients 1, 2, 3, 4.

PAIRS = [[0, 1], [2, 3]]
RAW_GRADS = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
TF_ORACLE = {
  ("mean", None): [-2.5, -2.5, -2.5, -2.5],
  ("mean", "pairs"): [-1.5, -1.5, -3.5, -3.5],
  ("sum", None): [-10.0, -10.0, -10.0, -10.0],
  ("sum", "pairs"): [-3.0, -3.0, -7.0, -7.0],
}


def _tf_step(style, reduction, groups):
  """One step on one replica: loss = g * w, so the raw gradient is g."""

  def step(w, g):
    if style == "cross_shard":
      tx = shardopt.cross_shard(
        optax.sgd(1.0), AXIS, reduction=reduction, axis_index_groups=groups
      )
      grad = jax.grad(lambda w: g * w)(w)
    else:  # TF literally: scale the loss, then sum the gradients.
      tx = optax.chain(
        shardopt.cross_shard_sum(AXIS, axis_index_groups=groups), optax.sgd(1.0)
      )
      grad = jax.grad(
        lambda w: shardopt.scale_loss(
          g * w, AXIS, reduction=reduction, axis_index_groups=groups
        )
      )(w)
    return _steps(tx, w, [grad])[0]

  return step


@pytest.mark.parametrize(
  "style", ["cross_shard", "scale_loss_and_cross_shard_sum"]
)
@pytest.mark.parametrize("reduction, groups_name", list(TF_ORACLE))
@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tensorflow_cross_shard_oracle(mapping, reduction, groups_name, style):
  groups = PAIRS if groups_name == "pairs" else None
  w = _on_replicas(
    mapping,
    _tf_step(style, reduction, groups),
    np.zeros(4, np.float32),
    RAW_GRADS,
  )
  np.testing.assert_array_equal(
    w, np.array(TF_ORACLE[reduction, groups_name], np.float32)
  )


@pytest.mark.parametrize(
  "style", ["cross_shard", "scale_loss_and_cross_shard_sum"]
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tensorflow_oracle_with_replicated_params_under_checking_shard_map(
  reduction, style
):
  """P() params: autodiff has already summed the gradient (to 10)."""
  step = _tf_step(style, reduction, None)
  fn = jax.jit(
    jax.shard_map(
      lambda w, g: step(w, g[0]),
      mesh=_mesh(4),
      in_specs=(P(), P(AXIS)),
      out_specs=P(),
    )
  )
  mesh = _mesh(4)
  w = fn(
    jax.device_put(np.zeros((), np.float32), NamedSharding(mesh, P())),
    jax.device_put(RAW_GRADS, NamedSharding(mesh, P(AXIS))),
  )
  assert float(w) == TF_ORACLE[reduction, None][0]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_pcast_fix_from_the_error_message_makes_groups_work_for_replicated_params(
  reduction,
):

  def step(w, g):
    local = jax.lax.pcast(w, AXIS, to="varying")  # the fix the error names
    grad = jax.grad(lambda w: jnp.sum(g * w))(local)
    tx = shardopt.cross_shard(
      optax.sgd(1.0), AXIS, reduction=reduction, axis_index_groups=PAIRS
    )
    return _steps(tx, local, [grad])[0]

  mesh = _mesh(4)
  fn = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS))
  )
  w = fn(
    jax.device_put(np.zeros(1, np.float32), NamedSharding(mesh, P())),
    jax.device_put(RAW_GRADS, NamedSharding(mesh, P(AXIS))),
  )
  np.testing.assert_array_equal(w, TF_ORACLE[reduction, "pairs"])


# Per-replica clipping before the reduce (TF's reason to defer the sum) versus
# clipping the reduced gradient.

MAX_NORM = 1.0


def _clip_grads():
  rng = np.random.default_rng(0)
  scales = np.array([0.1, 0.3, 0.5, 2.0, 3.0, 0.2, 5.0, 0.05], np.float32)
  return {
    "w": (rng.standard_normal((8, 3)) * scales[:, None]).astype(np.float32),
    "b": (rng.standard_normal((8, 2)) * scales[:, None]).astype(np.float32),
  }


def _numpy_clip(tree, max_norm):
  norm = np.sqrt(sum(np.sum(x**2) for x in tree.values()))
  return {k: x * min(1.0, max_norm / norm) for k, x in tree.items()}


def _clip_references(grads):
  """float64 results of one SGD(1) step: clip-then-average, average-then-clip."""
  g64 = {k: v.astype(np.float64) for k, v in grads.items()}
  per_replica = [
    _numpy_clip({k: v[r] for k, v in g64.items()}, MAX_NORM) for r in range(8)
  ]
  before = {k: -np.mean([c[k] for c in per_replica], axis=0) for k in g64}
  after = {
    k: -v
    for k, v in _numpy_clip(
      {k: v.mean(0) for k, v in g64.items()}, MAX_NORM
    ).items()
  }
  return before, after


@pytest.mark.parametrize("order", ["clip_then_reduce", "reduce_then_clip"])
@pytest.mark.parametrize("mapping", MAPPINGS)
def test_clipping_before_or_after_the_reduce_matches_numpy(mapping, order):
  grads = _clip_grads()
  clip = optax.clip_by_global_norm(MAX_NORM)
  reduce = shardopt.cross_shard_mean(AXIS)
  first, second = (
    (clip, reduce) if order == "clip_then_reduce" else (reduce, clip)
  )
  tx = optax.chain(first, second, optax.sgd(1.0))
  zeros = jax.tree.map(np.zeros_like, grads)
  w = _on_replicas(mapping, lambda p, g: _steps(tx, p, [g])[0], zeros, grads)
  before, after = _clip_references(grads)
  expected, other = (
    (before, after) if order == "clip_then_reduce" else (after, before)
  )
  for name in grads:
    assert not np.allclose(
      expected[name], other[name], rtol=1e-2
    )  # order shows
    np.testing.assert_allclose(
      w[name], np.broadcast_to(expected[name], grads[name].shape), rtol=1e-5
    )


# Composition with optax's wrappers. Gradients: 8 replicas x 2 steps x 3.


def _two_step_grads(seed=1):
  return (
    np.random.default_rng(seed).standard_normal((8, 2, 3)).astype(np.float32)
  )


def _mean_over_replicas(grads):
  return grads.astype(np.float64).mean(axis=0)  # (steps, 3)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_chain_with_momentum_matches_numpy(mapping):
  grads = _two_step_grads()
  tx = optax.chain(
    shardopt.cross_shard_mean(AXIS), optax.sgd(0.1, momentum=0.9)
  )
  w = _on_replicas(
    mapping,
    lambda w, g: _steps(tx, w, g)[0],
    np.zeros((8, 3), np.float32),
    grads,
  )
  m = _mean_over_replicas(grads)
  trace1 = m[0]
  trace2 = m[1] + 0.9 * trace1
  expected = -0.1 * trace1 - 0.1 * trace2
  np.testing.assert_allclose(w, np.broadcast_to(expected, (8, 3)), rtol=1e-5)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_multisteps_applies_the_mean_of_accumulated_reduced_gradients(mapping):
  grads = _two_step_grads()
  tx = optax.MultiSteps(
    shardopt.cross_shard(optax.sgd(1.0), AXIS), every_k_schedule=2
  )

  def run(w, g):
    after_first, _ = _steps(tx, w, g[:1])
    after_second, _ = _steps(tx, w, g)
    return after_first, after_second

  first, second = _on_replicas(
    mapping, run, np.zeros((8, 3), np.float32), grads
  )
  np.testing.assert_array_equal(first, np.zeros((8, 3), np.float32))
  expected = -_mean_over_replicas(grads).mean(axis=0)
  np.testing.assert_allclose(
    second, np.broadcast_to(expected, (8, 3)), rtol=1e-5
  )


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_inject_hyperparams_learning_rate_change_takes_effect(mapping):
  grads = _two_step_grads()
  tx = shardopt.cross_shard(
    optax.inject_hyperparams(optax.sgd)(learning_rate=1.0), AXIS
  )

  def run(w, g):
    state = tx.init(w)
    updates, state = tx.update(g[0], state, w)
    w = optax.apply_updates(w, updates)
    # cross_shard's state is inner's state: hyperparams are right there.
    state.hyperparams["learning_rate"] = jnp.asarray(0.25)
    updates, state = tx.update(g[1], state, w)
    return optax.apply_updates(w, updates), state.hyperparams["learning_rate"]

  w, lr = _on_replicas(mapping, run, np.zeros((8, 3), np.float32), grads)
  m = _mean_over_replicas(grads)
  np.testing.assert_allclose(
    w, np.broadcast_to(-m[0] - 0.25 * m[1], (8, 3)), rtol=1e-5
  )
  np.testing.assert_array_equal(lr, np.full(8, 0.25, np.float32))


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_apply_if_finite_inside_cross_shard_skips_on_every_replica_together(
  mapping,
):
  """A NaN on one replica reaches every replica through the reduce, so all
  skip the step together and stay in sync. (apply_if_finite *outside* the
  reduce would put the all-reduce inside a lax.cond whose predicate differs
  across replicas: a hang under pmap, a type error under checking shard_map.)"""
  grads = _two_step_grads()
  grads[3, 0, 1] = np.nan  # replica 3, first step
  tx = shardopt.cross_shard(
    optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=2), AXIS
  )

  def run(w, g):
    after_nan, state_nan = _steps(tx, w, g[:1])
    after_both, state_both = _steps(tx, w, g)
    return (
      after_nan,
      state_nan.notfinite_count,
      after_both,
      state_both.notfinite_count,
      state_both.total_notfinite,
    )

  after_nan, count_nan, after_both, count_both, total = _on_replicas(
    mapping, run, np.zeros((8, 3), np.float32), grads
  )
  np.testing.assert_array_equal(after_nan, np.zeros((8, 3), np.float32))
  np.testing.assert_array_equal(count_nan, np.ones(8, np.int32))
  # The second (finite) step applies on every replica.
  m = _mean_over_replicas(grads)
  np.testing.assert_allclose(
    after_both, np.broadcast_to(-m[1], (8, 3)), rtol=1e-5
  )
  np.testing.assert_array_equal(count_both, np.zeros(8, np.int32))
  np.testing.assert_array_equal(total, np.ones(8, np.int32))
  chex.assert_trees_all_equal(*[after_both[r] for r in range(8)])


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_masked_leaves_pass_through_unreduced(mapping):
  rng = np.random.default_rng(2)
  grads = {
    "w": rng.standard_normal((8, 3)).astype(np.float32),
    "step": np.arange(8, dtype=np.int32),
  }  # not a float: masked out
  tx = optax.masked(shardopt.cross_shard_mean(AXIS), {"w": True, "step": False})

  def run(g):
    updates, _ = tx.update(g, tx.init(g))
    return updates

  out = _on_replicas(mapping, run, grads)
  np.testing.assert_allclose(
    out["w"],
    np.broadcast_to(grads["w"].astype(np.float64).mean(0), (8, 3)),
    rtol=1e-6,
  )
  np.testing.assert_array_equal(out["step"], grads["step"])


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_adam_first_moment_found_by_tree_get_equals_numpy(mapping):
  grads = _two_step_grads()
  tx = shardopt.cross_shard(optax.adam(0.1, b1=0.9, b2=0.999), AXIS)

  def run(w, g):
    _, state = _steps(tx, w, g)
    return (
      optax.tree_utils.tree_get(state, "mu"),
      optax.tree_utils.tree_get(state, "nu"),
    )

  mu, nu = _on_replicas(mapping, run, np.zeros((8, 3), np.float32), grads)
  m = _mean_over_replicas(grads)
  expected_mu = 0.9 * (1 - 0.9) * m[0] + (1 - 0.9) * m[1]
  expected_nu = 0.999 * (1 - 0.999) * m[0] ** 2 + (1 - 0.999) * m[1] ** 2
  np.testing.assert_allclose(
    mu, np.broadcast_to(expected_mu, (8, 3)), rtol=1e-5
  )
  np.testing.assert_allclose(
    nu, np.broadcast_to(expected_nu, (8, 3)), rtol=1e-5
  )


def test_cross_shard_state_is_inner_state_and_init_needs_no_axis():
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  inner = optax.adam(0.1)
  state = shardopt.cross_shard(inner, AXIS).init(params)  # outside any mapping
  chex.assert_trees_all_equal_structs(state, inner.init(params))
  chex.assert_trees_all_equal(state, inner.init(params))
  assert shardopt.cross_shard_mean(AXIS).init(params) == optax.EmptyState()
  assert shardopt.cross_shard_sum(AXIS).init(params) == optax.EmptyState()


def test_cross_shard_forwards_extra_args_to_inner():

  def scale_by_extra(*, factor_name="factor"):
    def update_fn(updates, state, params=None, **extra):
      return jax.tree.map(lambda u: u * extra[factor_name], updates), state

    return optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), update_fn
    )

  tx = shardopt.cross_shard(scale_by_extra(), AXIS)
  out = jax.pmap(
    lambda g: tx.update(g, tx.init(g), None, factor=3.0)[0], axis_name=AXIS
  )(np.arange(8, dtype=np.float32))
  np.testing.assert_allclose(out, np.full(8, 3.0 * 3.5, np.float32))


@pytest.mark.parametrize(
  "make_tx",
  [
    lambda: shardopt.cross_shard(optax.sgd(1.0), None),
    lambda: optax.chain(shardopt.cross_shard_mean(None), optax.sgd(1.0)),
    lambda: optax.chain(shardopt.cross_shard_sum(None), optax.sgd(1.0)),
  ],
  ids=["cross_shard", "cross_shard_mean", "cross_shard_sum"],
)
def test_axis_name_none_is_plain_sgd_under_jit(make_tx):
  tx = make_tx()
  grads = np.array([1.5, -2.0, 0.25], np.float32)
  w = jax.jit(lambda w, g: _steps(tx, w, [g])[0])(
    np.zeros(3, np.float32), grads
  )
  np.testing.assert_array_equal(w, -grads)


@pytest.mark.parametrize(
  "reduction, groups, expected",
  [
    ("mean", None, 0.5),
    ("sum", None, 4.0),
    ("mean", [[0, 1, 2, 3], [4, 5, 6, 7]], 1.0),
    ("sum", [[0, 1], [2, 3], [4, 5], [6, 7]], 4.0),
  ],
)
def test_scale_loss_divides_by_the_axis_or_group_size_for_mean_only(
  reduction, groups, expected
):
  out = jax.pmap(
    lambda loss: shardopt.scale_loss(
      loss, AXIS, reduction=reduction, axis_index_groups=groups
    ),
    axis_name=AXIS,
  )(np.full(8, 4.0, np.float32))
  np.testing.assert_array_equal(out, np.full(8, expected, np.float32))
  assert shardopt.scale_loss(4.0, None, reduction=reduction) == 4.0


def test_scale_loss_then_mean_divides_twice():
  """The pitfall the docs warn about: scale_loss + cross_shard_mean."""
  tx = optax.chain(shardopt.cross_shard_mean(AXIS), optax.sgd(1.0))

  def step(w, g):
    grad = jax.grad(lambda w: shardopt.scale_loss(g * w, AXIS))(w)
    return _steps(tx, w, [grad])[0]

  w = _on_replicas("pmap", step, np.zeros(4, np.float32), RAW_GRADS)
  np.testing.assert_array_equal(w, np.full(4, -2.5 / 4, np.float32))
