"""diloco(outer_optimizer=...): any optax transform moves the center.

References: numpy (DiLoCo with an outer Adam written out), optax's own sgd
for the default's spelling, and the state's structure (one outer state per
fragment, as torchft keeps one per fragment).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardopt

R, D, B = 8, 4, 5  # replicas, features, examples per replica and step


def _data(steps: int):
  rng = np.random.default_rng(7)
  x = rng.normal(size=(steps, R, B, D)).astype(np.float32)
  y = (x @ np.arange(1, D + 1, dtype=np.float32) + 0.5).astype(np.float32)
  return x, y


def _params():
  return {
    "w": np.linspace(-0.5, 0.5, D, dtype=np.float32),
    "b": np.float32(0.1),
  }


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _run(tx, steps: int, mesh):
  """``steps`` steps under jit + shard_map over R replicas; params and
  per-replica state as concatenated P("batch") blocks (replica i's row)."""
  x, y = _data(steps)
  params = jax.tree.map(lambda v: np.stack([v] * R), _params())
  specs = jax.tree.map(
    lambda v: P() if jnp.ndim(v) == 0 else P("batch"),
    tx.init(jax.tree.map(lambda v: jnp.zeros((1,) + np.shape(v)), _params())),
  )

  def step(p, s, x, y):
    g = jax.vmap(jax.grad(_loss))(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P("batch"), out_specs=specs)
  )
  run = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P("batch"), specs, P("batch"), P("batch")),
      out_specs=(P("batch"), specs),
    )
  )
  state = init(params)
  for t in range(steps):
    params, state = run(params, state, x[t], y[t])
    jax.block_until_ready(state)
  return params, state


@pytest.fixture(scope="module")
def batch_mesh():
  return jax.make_mesh(
    (R,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,)
  )


def test_the_default_spelled_as_an_optax_sgd_is_bit_identical(batch_mesh):
  default = shardopt.diloco(optax.adam(0.05), "batch", sync_period=3)
  spelled = shardopt.diloco(
    optax.adam(0.05),
    "batch",
    sync_period=3,
    outer_optimizer=optax.sgd(0.8, momentum=0.2, nesterov=True),
  )
  chex.assert_trees_all_equal(
    _run(default, 9, batch_mesh), _run(spelled, 9, batch_mesh)
  )


def _np_diloco_outer_adam(steps, *, period, inner_lr, outer_lr):
  """DiLoCo with SGD inside and Adam (b1 0.9, b2 0.999, eps 1e-8) outside,
  in float64 numpy."""
  x, y = _data(steps)
  w, b = _params()["w"].astype(np.float64), np.float64(_params()["b"])
  center = np.concatenate([w, [b]])
  local = np.tile(center, (R, 1))
  mu = nu = np.zeros_like(center)
  count = 0
  for t in range(steps):
    for i in range(R):
      err = x[t, i] @ local[i, :D] + local[i, D] - y[t, i]
      grad = np.concatenate([2 * x[t, i].T @ err / B, [2 * err.mean()]])
      local[i] -= inner_lr * grad
    if (t + 1) % period == 0:
      g = center - local.mean(0)
      count += 1
      mu = 0.9 * mu + 0.1 * g
      nu = 0.999 * nu + 0.001 * g * g
      center = center - outer_lr * (mu / (1 - 0.9**count)) / (
        np.sqrt(nu / (1 - 0.999**count)) + 1e-8
      )
      local = np.tile(center, (R, 1))
  return center


def test_an_outer_adam_matches_numpy(batch_mesh):
  tx = shardopt.diloco(
    optax.sgd(0.01),
    "batch",
    sync_period=2,
    outer_optimizer=optax.adam(0.05),
  )
  params, state = _run(tx, 6, batch_mesh)
  want = _np_diloco_outer_adam(6, period=2, inner_lr=0.01, outer_lr=0.05)
  center = jax.tree.map(np.asarray, state.center)  # one row per replica
  for i in range(R):
    got = np.concatenate([center["w"][i], [center["b"][i]]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert int(state.global_state[0].count) == 3  # three outer steps
  for leaf in jax.tree.leaves((state.center, state.global_state)):
    if np.ndim(leaf):  # replicated: the same bits on every replica
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
  # params + (center - params) lands on the center to a rounding
  chex.assert_trees_all_close(params, center, rtol=1e-6, atol=1e-7)


def test_fragments_keep_one_outer_state_each(batch_mesh):
  tx = shardopt.diloco(
    optax.sgd(0.01),
    "batch",
    sync_period=2,
    num_fragments=2,
    outer_optimizer=optax.adam(0.05),
  )
  _, state = _run(tx, 5, batch_mesh)
  assert isinstance(state.global_state, tuple) and len(state.global_state) == 2
  # Fragment 0 syncs after steps 2 and 4, fragment 1 after 1, 3 and 5.
  counts = [int(s[0].count) for s in state.global_state]
  assert counts == [2, 3], counts


def test_outer_optimizer_errors_name_the_fix():
  with pytest.raises(TypeError, match="outer_optimizer"):
    shardopt.diloco(optax.adam(1e-3), "batch", outer_optimizer=0.7)
  with pytest.raises(ValueError, match="outer_optimizer.*outer_momentum"):
    shardopt.diloco(
      optax.adam(1e-3),
      "batch",
      outer_optimizer=optax.sgd(1.0),
      outer_momentum=0.3,
    )


@pytest.mark.parametrize(
  "keyword, value",
  [
    # Each default value itself: given explicitly, it still conflicts.
    ("outer_learning_rate", 0.8),
    ("outer_momentum", 0.2),
    ("nesterov", True),
    # And other values.
    ("outer_learning_rate", 0.5),
    ("outer_momentum", 0.0),
    ("nesterov", False),
  ],
)
def test_outer_optimizer_with_any_explicit_outer_keyword_raises(keyword, value):
  with pytest.raises(ValueError) as info:
    shardopt.diloco(
      optax.adam(0.1),
      "batch",
      outer_optimizer=optax.adam(0.1),
      **{keyword: value},
    )
  message = str(info.value)
  assert message.startswith("shardopt.diloco: outer_optimizer replaces"), (
    message
  )
  assert f"{keyword}={value!r} was given too" in message, message
  assert "leave the three arguments out" in message, message


def test_outer_optimizer_names_every_explicit_outer_keyword():
  with pytest.raises(ValueError) as info:
    shardopt.diloco(
      optax.adam(0.1),
      "batch",
      outer_optimizer=optax.adam(0.1),
      outer_learning_rate=0.8,
      nesterov=True,
    )
  assert "outer_learning_rate=0.8, nesterov=True were given too" in str(
    info.value
  )


def test_outer_keywords_read_as_their_defaults_in_the_signature():
  """The sentinel defaults print as the values the docs give, and leaving
  them out builds optax.sgd(0.8, momentum=0.2, nesterov=True) (the
  bit-identity test above) while an explicit default is the same step."""
  import inspect

  params = inspect.signature(shardopt.diloco).parameters
  shown = {
    k: repr(params[k].default)
    for k in ("outer_learning_rate", "outer_momentum", "nesterov")
  }
  assert shown == {
    "outer_learning_rate": "0.8",
    "outer_momentum": "0.2",
    "nesterov": "True",
  }
  default = shardopt.diloco(optax.sgd(1.0), "batch", sync_period=1)
  explicit = shardopt.diloco(
    optax.sgd(1.0),
    "batch",
    sync_period=1,
    outer_learning_rate=0.8,
    outer_momentum=0.2,
    nesterov=True,
  )

  def step(tx):
    def f(p, g):
      return tx.update(g, tx.init(p), p)[1].center

    return jax.pmap(f, axis_name="batch")(jnp.zeros(R), -jnp.arange(R * 1.0))

  chex.assert_trees_all_equal(step(default), step(explicit))
  # outer gradient 0 - 3.5; Nesterov: 0.8 * (3.5 + 0.2 * 3.5) = 3.36
  np.testing.assert_allclose(np.asarray(step(default)), 3.36, rtol=1e-6)
