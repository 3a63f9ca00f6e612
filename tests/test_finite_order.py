"""apply_if_finite takes optax's order, shardopt's axis_name keyword-only; the
order of shardopt <= 0.1 still works, with a DeprecationWarning."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardopt


def _run(tx):
  def step(w, g):
    updates, state = tx.update(g, tx.init(w), w)
    return updates, state.total_notfinite

  grads = jnp.ones(8).at[2].set(jnp.inf)
  return jax.pmap(step, axis_name="batch")(jnp.zeros(8), grads)


def test_optax_order_with_axis_name_skips_on_every_replica():
  updates, skipped = _run(
    shardopt.apply_if_finite(
      shardopt.cross_shard(optax.sgd(1.0), "batch"), 3, axis_name="batch"
    )
  )
  np.testing.assert_array_equal(updates, np.zeros(8))
  np.testing.assert_array_equal(skipped, np.ones(8))


def test_old_order_warns_and_gives_the_same_numbers():
  inner = shardopt.cross_shard(optax.sgd(1.0), "batch")
  with pytest.warns(DeprecationWarning, match="axis_name='batch'"):
    old = shardopt.apply_if_finite(inner, "batch", 3)
  new = shardopt.apply_if_finite(inner, 3, axis_name="batch")
  for a, b in zip(_run(old), _run(new)):
    np.testing.assert_array_equal(a, b)


def test_a_port_from_optax_fails_naming_axis_name():
  with pytest.raises(TypeError, match="axis_name is required"):
    shardopt.apply_if_finite(optax.adam(1e-3), 5)


def test_axis_name_none_is_optax_apply_if_finite():
  ours = shardopt.apply_if_finite(optax.sgd(1.0), 2, axis_name=None)
  theirs = optax.apply_if_finite(optax.sgd(1.0), 2)
  w, s_ours, s_theirs = jnp.zeros(3), ours.init(jnp.zeros(3)), None
  s_theirs = theirs.init(w)
  for g in (jnp.ones(3), jnp.full(3, jnp.nan), jnp.full(3, 2.0)):
    u1, s_ours = ours.update(g, s_ours, w)
    u2, s_theirs = theirs.update(g, s_theirs, w)
    np.testing.assert_array_equal(u1, u2)
    assert int(s_ours.total_notfinite) == int(s_theirs.total_notfinite)


def test_both_orders_at_once_is_an_error():
  with pytest.raises(TypeError, match="positional arguments and axis_name"):
    shardopt.apply_if_finite(optax.adam(1e-3), "batch", 3, axis_name="batch")
