"""shardopt inside Flax training loops, and through orbax checkpoints.

* ``flax.training.train_state.TrainState`` with shardopt as its ``tx``, under
  ``jax.pmap`` (cross_shard, agn, tower);
* ``flax.nnx.Optimizer`` with shardopt under ``jax.shard_map``;
* optimizer state saved and restored with ``orbax.checkpoint`` in the middle
  of an AGN communication period and for ``tower``'s sharded state, then
  training continues bit-identically to an uninterrupted run.

References are numpy arithmetic written here, or TensorFlow's test numbers
quoted in design.md section 4.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

AXIS = "batch"
N = 8
ROWS_PER_REPLICA = 5


def _data(seed, rows, cols):
  return (
    np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
  )


def _numpy_mean_squared_error_grads(w, b, x, y):
  """Gradient of mean((x @ w + b - y)**2) in float64."""
  residual = x @ w + b - y
  return 2 * x.T @ residual / residual.size, 2 * residual.sum(0) / residual.size


def _numpy_sgd_momentum_on_mean_gradient(w, b, xs, ys, lr, momentum, steps):
  """Synchronous data parallel SGD+momentum: mean of the replicas' gradients."""
  w, b = w.astype(np.float64), b.astype(np.float64)
  trace_w, trace_b = np.zeros_like(w), np.zeros_like(b)
  for _ in range(steps):
    grads = [
      _numpy_mean_squared_error_grads(
        w, b, x.astype(np.float64), y.astype(np.float64)
      )
      for x, y in zip(xs, ys)
    ]
    gw = np.mean([g[0] for g in grads], axis=0)
    gb = np.mean([g[1] for g in grads], axis=0)
    trace_w = gw + momentum * trace_w
    trace_b = gb + momentum * trace_b
    w, b = w - lr * trace_w, b - lr * trace_b
  return w, b


def _assert_replicas_bit_identical(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


# ---------------------------------------------------------------------------
# TrainState under pmap


def _pmapped_train_state(model, params0, tx):
  """A TrainState per device (built under pmap) and a pmapped MSE train step."""

  def create(_):
    return train_state.TrainState.create(
      apply_fn=model.apply, params=params0, tx=tx
    )

  def train_step(state, x, y):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(
      state.params
    )
    return state.apply_gradients(grads=grads)

  state = jax.pmap(create, axis_name=AXIS)(np.arange(N))
  return state, jax.pmap(train_step, axis_name=AXIS)


def test_train_state_cross_shard_under_pmap_equals_numpy_sgd_on_mean_gradient():
  lr, momentum, steps = 0.1, 0.9, 3
  model = nn.Dense(3)
  xs = _data(0, N * ROWS_PER_REPLICA, 4).reshape(N, ROWS_PER_REPLICA, 4)
  ys = _data(1, N * ROWS_PER_REPLICA, 3).reshape(N, ROWS_PER_REPLICA, 3)
  tx = shardopt.cross_shard(optax.sgd(lr, momentum=momentum), AXIS)
  params0 = model.init(jax.random.key(0), jnp.zeros((1, 4)))
  state, step = _pmapped_train_state(model, params0, tx)
  for _ in range(steps):
    state = step(state, xs, ys)

  _assert_replicas_bit_identical(state.params)
  want_w, want_b = _numpy_sgd_momentum_on_mean_gradient(
    np.asarray(params0["params"]["kernel"]),
    np.asarray(params0["params"]["bias"]),
    xs,
    ys,
    lr,
    momentum,
    steps,
  )
  np.testing.assert_allclose(
    state.params["params"]["kernel"][0], want_w, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    state.params["params"]["bias"][0], want_b, rtol=1e-5, atol=1e-6
  )
  assert int(state.step[0]) == steps


def _agn_sgd_oracle_state(sync_period=4):
  """TrainState for TF's AGN SGD oracle: v0 = (0, 0.5), gradient -1, lr 0.1."""
  tx = shardopt.agn(optax.sgd(0.1), AXIS, sync_period=sync_period)

  def create(_):
    return train_state.TrainState.create(
      apply_fn=None, params={"v": jnp.array([0.0, 0.5])}, tx=tx
    )

  def step(state):
    grads = jax.grad(lambda p: -jnp.sum(p["v"]))(state.params)  # always -1
    return state.apply_gradients(grads=grads)

  return (
    jax.pmap(create, axis_name=AXIS)(np.arange(N)),
    jax.pmap(step, axis_name=AXIS),
  )


def test_train_state_agn_under_pmap_reproduces_tensorflow_sgd_oracle():
  state, step = _agn_sgd_oracle_state()
  seen = {}
  for i in range(1, 9):
    state = step(state)
    seen[i] = (
      np.asarray(state.params["v"][0]),
      np.asarray(state.opt_state.center["v"][0]),
    )
  # design.md 4: local (0.3, 0.8) after step 3; sync at 4 -> (0.1, 0.6),
  # at 8 -> (0.2, 0.7) (without the /T normalisation it would be (0.4, 0.9)).
  np.testing.assert_allclose(seen[3][0], [0.3, 0.8], rtol=1e-6)
  np.testing.assert_allclose(seen[3][1], [0.0, 0.5], rtol=1e-6)
  for i, want in ((4, [0.1, 0.6]), (8, [0.2, 0.7])):
    np.testing.assert_allclose(seen[i][0], want, rtol=1e-6)
    np.testing.assert_allclose(seen[i][1], want, rtol=1e-6)
  assert int(state.opt_state.sync_count[0]) == 2
  assert int(state.step[0]) == 8
  _assert_replicas_bit_identical(state.opt_state.center)


@pytest.mark.parametrize("reduction, want_c", [("sum", 7.0), ("mean", 8.5)])
def test_train_state_tower_under_pmap_reproduces_tensorflow_tower_oracle(
  reduction, want_c
):
  # Two towers, features [[1]], [[2]], labels [[1]], [[2]], loss
  # sum(|features * c - labels|), c0 = 10, gradient descent lr 1.
  tx = shardopt.tower(optax.sgd(1.0), AXIS, reduction=reduction)
  two = jax.devices()[:2]

  def create(_):
    return train_state.TrainState.create(
      apply_fn=None, params={"c": jnp.array(10.0)}, tx=tx
    )

  def step(state, features, labels):
    grads = jax.grad(lambda p: jnp.sum(jnp.abs(features * p["c"] - labels)))(
      state.params
    )
    return state.apply_gradients(grads=grads)

  state = jax.pmap(create, axis_name=AXIS, devices=two)(np.arange(2))
  towers = np.array([[[1.0]], [[2.0]]], np.float32)
  state = jax.pmap(step, axis_name=AXIS, devices=two)(state, towers, towers)
  np.testing.assert_array_equal(np.asarray(state.params["c"]), [want_c] * 2)


def test_train_state_tower_two_sum_steps_reproduce_tensorflow_oracle():
  tx = shardopt.tower(optax.sgd(1.0), AXIS, reduction="sum")
  two = jax.devices()[:2]

  def create(_):
    return train_state.TrainState.create(
      apply_fn=None, params={"c": jnp.array(10.0)}, tx=tx
    )

  def step(state, features, labels):
    grads = jax.grad(lambda p: jnp.sum(jnp.abs(features * p["c"] - labels)))(
      state.params
    )
    return state.apply_gradients(grads=grads)

  step = jax.pmap(step, axis_name=AXIS, devices=two)
  state = jax.pmap(create, axis_name=AXIS, devices=two)(np.arange(2))
  first = np.array([[[1.0]], [[2.0]]], np.float32)
  second = np.array([[[1.5]], [[2.5]]], np.float32)
  state = step(state, first, first)
  state = step(state, second, second)
  np.testing.assert_array_equal(np.asarray(state.params["c"]), [3.0, 3.0])


# ---------------------------------------------------------------------------
# flax.nnx.Optimizer under shard_map


def test_nnx_optimizer_cross_shard_under_shard_map_equals_numpy_sgd(mesh):
  lr, momentum, steps = 0.1, 0.9, 3
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  w0, b0 = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
  optimizer = nnx.Optimizer(
    model,
    shardopt.cross_shard(optax.sgd(lr, momentum=momentum), AXIS),
    wrt=nnx.Param,
  )
  graphdef, state = nnx.split((model, optimizer))

  # Replicated (P()) model and optimizer state; each replica its own rows.
  # The gradient of replicated params is typed invariant (autodiff summed it
  # over the axis); cross_shard turns that sum into the mean.
  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
  def train_step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  x = _data(2, N * ROWS_PER_REPLICA, 4)
  y = _data(3, N * ROWS_PER_REPLICA, 3)
  rows = NamedSharding(mesh, P(AXIS))
  state = jax.device_put(state, NamedSharding(mesh, P()))
  x_sharded, y_sharded = jax.device_put(x, rows), jax.device_put(y, rows)
  for _ in range(steps):
    state = train_step(state, x_sharded, y_sharded)
  model, optimizer = nnx.merge(graphdef, state)

  want_w, want_b = _numpy_sgd_momentum_on_mean_gradient(
    w0,
    b0,
    x.reshape(N, ROWS_PER_REPLICA, 4),
    y.reshape(N, ROWS_PER_REPLICA, 3),
    lr,
    momentum,
    steps,
  )
  np.testing.assert_allclose(model.kernel[...], want_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(model.bias[...], want_b, rtol=1e-5, atol=1e-6)
  assert int(optimizer.step[...]) == steps
  # The state is one replicated copy: every device holds the same bits.
  for leaf in jax.tree.leaves(state):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    for shard in shards[1:]:
      np.testing.assert_array_equal(shard, shards[0])


# ---------------------------------------------------------------------------
# orbax checkpoints


def _save_and_restore(directory, tree):
  """Writes ``tree`` with orbax and reads it back onto the same shardings."""
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory, tree)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  restored = checkpointer.restore(directory, target)
  checkpointer.close()
  return restored


def test_agn_checkpoint_mid_period_restores_and_continues_bit_identically(
  tmp_path,
):
  period = 4
  model = nn.Dense(3)
  xs = _data(4, N * ROWS_PER_REPLICA, 4).reshape(N, ROWS_PER_REPLICA, 4)
  ys = _data(5, N * ROWS_PER_REPLICA, 3).reshape(N, ROWS_PER_REPLICA, 3)
  tx = shardopt.agn(optax.adam(0.05), AXIS, sync_period=period)
  params0 = model.init(jax.random.key(1), jnp.zeros((1, 4)))
  state, step = _pmapped_train_state(model, params0, tx)
  for _ in range(6):  # one sync (step 4), then 2 steps into the next period
    state = step(state, xs, ys)
  assert int(state.opt_state.count[0]) % period == 2
  assert int(state.opt_state.sync_count[0]) == 1
  # Mid-period: replicas have drifted apart and the accumulator is not empty.
  assert (
    float(jnp.abs(state.opt_state.accumulator["params"]["kernel"]).max()) > 0
  )
  assert not np.array_equal(
    state.params["params"]["kernel"][0], state.params["params"]["kernel"][1]
  )

  restored = _save_and_restore(tmp_path / "agn", state)
  assert isinstance(restored.opt_state, shardopt.AGNState)
  chex.assert_trees_all_equal(restored, state)

  uninterrupted, resumed = state, restored
  for _ in range(6):  # crosses the sync at step 8
    uninterrupted = step(uninterrupted, xs, ys)
    resumed = step(resumed, xs, ys)
  assert int(resumed.opt_state.sync_count[0]) == 3
  chex.assert_trees_all_equal(resumed, uninterrupted)


def test_tower_sharded_state_checkpoint_restores_and_continues_bit_identically(
  mesh, tmp_path
):
  inner = optax.adam(0.05)
  tx = shardopt.tower(inner, AXIS)
  params = {"w": jnp.zeros((5, 3)), "b": jnp.zeros((3,))}
  # tower's state holds 1/N of every moment: owned slices P(AXIS), counters P().
  stand_ins = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((1,), x.dtype), params
  )
  specs = jax.tree.map(
    lambda x: P(AXIS) if x.ndim else P(), jax.eval_shape(inner.init, stand_ins)
  )
  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  )

  @jax.jit
  @jax.shard_map(
    mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
  )
  def step(params, state, x, y):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rows = NamedSharding(mesh, P(AXIS))
  x = jax.device_put(_data(6, N * 4, 5), rows)
  y = jax.device_put(_data(7, N * 4, 3), rows)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = init(params)
  for _ in range(3):
    params, state = step(params, state, x, y)
  mu = optax.tree_utils.tree_get(state, "mu")
  assert mu["w"].shape == (N * 2,)  # ceil(15 / 8) = 2 moments per replica
  assert mu["w"].sharding.spec == P(AXIS)

  restored = _save_and_restore(
    tmp_path / "tower", {"params": params, "opt_state": state}
  )
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  assert optax.tree_utils.tree_get(restored["opt_state"], "mu")[
    "w"
  ].sharding.spec == P(AXIS)

  p_resumed, s_resumed = restored["params"], restored["opt_state"]
  for _ in range(4):
    params, state = step(params, state, x, y)
    p_resumed, s_resumed = step(p_resumed, s_resumed, x, y)
  chex.assert_trees_all_equal((p_resumed, s_resumed), (params, state))
