"""``shardopt.delayed_nesterov`` against a numpy transcription of the Delayed
Nesterov update (arXiv 2401.09135, c = 0) and against optax's own Nesterov
SGD, which N of its updates must equal on the mean of their gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardopt


def numpy_dn(grads, lr, beta, n):
  """The DN update in numpy: buffer b, momentum m; at every N-th arrival the
  buffered mean enters the momentum."""
  b = np.zeros_like(grads[0])
  m = np.zeros_like(grads[0])
  out = []
  for t, g in enumerate(grads, start=1):
    b = b + g
    if t % n == 0:
      m = beta * m + b / n
      out.append(-lr * (g / n + beta * m))
      b = np.zeros_like(b)
    else:
      out.append(-lr * g / n)
  return out


@pytest.mark.parametrize("n", [1, 3, 4])
def test_updates_match_the_numpy_transcription(n):
  rng = np.random.default_rng(n)
  grads = [rng.normal(size=(5,)).astype(np.float32) for _ in range(11)]
  dn = shardopt.delayed_nesterov(
    learning_rate=0.7, momentum=0.9, momentum_period=n
  )
  update = jax.jit(dn.update)
  state = dn.init(jnp.zeros(5))
  want = numpy_dn([g.astype(np.float64) for g in grads], 0.7, 0.9, n)
  for g, w in zip(grads, want, strict=True):
    u, state = update(jnp.asarray(g), state)
    np.testing.assert_allclose(np.asarray(u), w, rtol=2e-6, atol=1e-6)


def test_n_updates_are_one_nesterov_step_on_their_mean():
  """Two rounds of N = 4 single contributions move the params as two steps
  of optax.sgd(lr, beta, nesterov=True) on each round's mean."""
  rng = np.random.default_rng(0)
  rounds = [rng.normal(size=(4, 3)) for _ in range(2)]
  dn = shardopt.delayed_nesterov(
    learning_rate=0.5, momentum=0.8, momentum_period=4
  )
  sgd = optax.sgd(0.5, momentum=0.8, nesterov=True)
  x = jnp.zeros(3)
  y = jnp.zeros(3)
  dn_state, sgd_state = dn.init(x), sgd.init(y)
  for grads in rounds:
    for g in grads:
      u, dn_state = dn.update(jnp.asarray(g, jnp.float32), dn_state)
      x = optax.apply_updates(x, u)
    u, sgd_state = sgd.update(
      jnp.asarray(grads.mean(0), jnp.float32), sgd_state
    )
    y = optax.apply_updates(y, u)
  np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5)


def test_period_one_is_optax_nesterov_sgd():
  rng = np.random.default_rng(1)
  params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
  dn = shardopt.delayed_nesterov(0.7, 0.9, momentum_period=1)
  sgd = optax.sgd(0.7, momentum=0.9, nesterov=True)
  a, b = dn.init(params), sgd.init(params)
  for _ in range(5):
    g = jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params
    )
    ua, a = dn.update(g, a)
    ub, b = sgd.update(g, b)
    chex.assert_trees_all_close(ua, ub, rtol=1e-6)


def test_it_is_diloco_s_outer_optimizer_under_pmap():
  """As diloco's outer optimizer over 8 replicas (pmap): the replicas stay
  bit-identical after every sync and the center moves."""
  tx = shardopt.diloco(
    optax.sgd(0.1),
    "i",
    sync_period=2,
    outer_optimizer=shardopt.delayed_nesterov(0.7, 0.9, momentum_period=2),
  )
  params = jnp.ones((8, 4))
  state = jax.pmap(tx.init, axis_name="i")(params)

  def local(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.pmap(local, axis_name="i")

  grads = jnp.arange(32.0).reshape(8, 4) / 32
  for _ in range(4):
    params, state = step(params, state, grads)
  for r in range(1, 8):
    chex.assert_trees_all_equal(params[0], params[r])
  assert not np.allclose(np.asarray(params[0]), 1.0)


@pytest.mark.parametrize(
  ("kwargs", "error", "words"),
  [
    ({"momentum_period": 0}, ValueError, "momentum_period=0 must be >= 1"),
    ({"momentum_period": 2.0}, TypeError, "momentum_period=2.0 must be an int"),
    (
      {"momentum": 1.0},
      ValueError,
      "momentum=1.0 must be a number in [0.0, 1.0)",
    ),
    ({"learning_rate": 0.0}, ValueError, "learning_rate=0.0 must be > 0"),
  ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs, error, words):
  with pytest.raises(error, match="shardopt.delayed_nesterov") as info:
    shardopt.delayed_nesterov(**kwargs)
  assert words in str(info.value)
