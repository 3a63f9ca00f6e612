"""The new transforms compose: powersgd inside accumulate and apply_if_finite.

References are independent: powersgd's numpy float64 reference from
``test_powersgd`` (fed the per-replica mean of the accumulated gradients),
numpy bookkeeping of skipped steps, and the compiled HLO read by
:mod:`shardopt.measure.hlo`.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _powersgd_reference import COMPRESSED
from _powersgd_reference import RANK
from _powersgd_reference import RATE
from _powersgd_reference import SHAPES
from _powersgd_reference import np_powersgd
from _powersgd_reference import random_grad_steps
from _powersgd_reference import zero_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo

R = 8
AXIS = "batch"
LR = 0.1


def _powersgd_sgd(**kwargs):
  return optax.chain(
    shardopt.powersgd(AXIS, rank=RANK, min_compression_rate=RATE, **kwargs),
    optax.sgd(LR),
  )


def _stacked(params):
  return jax.tree.map(lambda p: jnp.broadcast_to(p, (R,) + p.shape), params)


def _q_init(tx_init_state):
  """The ``q`` that powersgd's init drew, from a (possibly wrapped) state."""
  psgd = next(
    s
    for s in jax.tree.leaves(
      tx_init_state, is_leaf=lambda s: isinstance(s, shardopt.PowerSGDState)
    )
    if isinstance(s, shardopt.PowerSGDState)
  )
  return {k: np.asarray(v)[0] for k, v in psgd.q.items() if COMPRESSED[k]}


def _psgd_state(state):
  return next(
    s
    for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, shardopt.PowerSGDState)
    )
    if isinstance(s, shardopt.PowerSGDState)
  )


def test_accumulate_feeds_powersgd_the_mean_of_k_gradients_once_per_period():
  k = 2
  tx = shardopt.accumulate(_powersgd_sgd(), k)
  params = zero_params()
  state = jax.pmap(tx.init)(_stacked(params))
  q0 = _q_init(state)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)
  grads = random_grad_steps(seed=3, steps=2 * k)
  emitted = []
  for t, g in enumerate(grads):
    updates, state = jax.block_until_ready(step(g, state))
    counts = np.asarray(_psgd_state(state).count)
    assert (counts == (t + 1) // k).all(), counts  # counts once per emit
    if (t + 1) % k:
      assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
    else:
      emitted.append(jax.tree.map(np.asarray, updates))
  # Reference: powersgd on each replica's mean of its k gradients.
  means = [
    {
      name: np.mean(
        [np.asarray(grads[p * k + i][name], np.float64) for i in range(k)],
        axis=0,
      )
      for name in SHAPES
    }
    for p in range(len(grads) // k)
  ]
  expected, _ = np_powersgd(means, q0, compressed=COMPRESSED)
  for got, want in zip(emitted, expected):
    for name in SHAPES:
      for replica in range(R):
        np.testing.assert_allclose(
          got[name][replica], -LR * want[name], rtol=2e-4, atol=2e-5
        )
  chex.assert_trees_all_equal(
    *[jax.tree.map(lambda x: x[i], emitted[-1]) for i in range(R)]
  )


def _whole_state_step(tx, mesh):
  """A checking shard_map step with the whole state under ``P(axis)``.

  Every state leaf (counters included) carries a leading replica axis, the
  spelling users write first; gradients arrive varying, one row per replica.
  Returns the jitted step and the stacked initial state.
  """
  stacked = jax.vmap(tx.init)(_stacked(zero_params()))
  specs = jax.tree.map(lambda _: P(AXIS), stacked)

  def step(g, s):
    g = jax.tree.map(lambda x: x[0], g)
    s = jax.tree.map(lambda x: x[0], s)
    u, s = tx.update(g, s)
    return (
      jax.tree.map(lambda x: x[None], u),
      jax.tree.map(lambda x: x[None], s),
    )

  f = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(AXIS), specs), out_specs=(P(AXIS), specs)
    )
  )
  return f, jax.device_put(stacked, NamedSharding(mesh, P(AXIS)))


def _update_contexts(tx, mapping, mesh=None):
  """Collectives of the compiled ``tx.update`` (grads an input), by context."""
  params = zero_params()
  if mapping == "pmap":
    state = jax.pmap(tx.init)(_stacked(params))
    grads = random_grad_steps(seed=0, steps=1)[0]
    text = (
      jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)
      .lower(grads, state)
      .compile()
      .as_text()
    )
  else:
    f, state = _whole_state_step(tx, mesh)
    grads = jax.device_put(
      random_grad_steps(seed=0, steps=1)[0], NamedSharding(mesh, P(AXIS))
    )
    text = f.lower(grads, state).compile().as_text()
  contexts = {}
  for op in hlo.compiled_collectives(text):
    contexts.setdefault(op.context, []).append(op)
  return contexts


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_accumulate_around_powersgd_communicates_only_in_the_emit_branch(
  mapping, mesh
):
  contexts = _update_contexts(
    shardopt.accumulate(_powersgd_sgd(), 4), mapping, mesh
  )
  assert "top" not in contexts, {c: len(v) for c, v in contexts.items()}
  assert sum(len(v) for v in contexts.values()) >= 2, contexts


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_apply_if_finite_around_powersgd_leaves_only_the_flag_outside(
  mapping, mesh
):
  tx = shardopt.apply_if_finite(_powersgd_sgd(start_step=2), 3, axis_name=AXIS)
  contexts = _update_contexts(tx, mapping, mesh)
  top = contexts.get("top", [])
  assert [op.buffer_bytes for op in top] == [4], top
  inside = [op for c, ops in contexts.items() if c != "top" for op in ops]
  assert inside, contexts


def test_nan_on_one_replica_skips_powersgd_on_every_replica_and_keeps_its_state():
  tx = shardopt.apply_if_finite(_powersgd_sgd(), 5, axis_name=AXIS)
  params = zero_params()
  state = jax.pmap(tx.init)(_stacked(params))
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)
  grads = random_grad_steps(seed=5, steps=4)
  bad_step, bad_replica = 1, 6
  grads[bad_step]["w1"][bad_replica, 0, 0] = np.nan
  finite_grads = [g for t, g in enumerate(grads) if t != bad_step]
  q0 = _q_init(state)
  applied = []
  for t, g in enumerate(grads):
    before = _psgd_state(state)
    updates, state = jax.block_until_ready(step(g, state))
    after = _psgd_state(state)
    for leaf in jax.tree.leaves(
      (after.q, state.last_finite, state.total_notfinite)
    ):
      leaf = np.asarray(leaf)
      assert (leaf == leaf[0]).all()  # the same on every replica
    assert all(
      np.isfinite(np.asarray(x)).all()
      for x in jax.tree.leaves((after.error, after.q))
    )
    if t == bad_step:
      assert not np.asarray(state.last_finite).any()
      chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, before), jax.tree.map(np.asarray, after)
      )
      assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
    else:
      applied.append(jax.tree.map(np.asarray, updates))
  assert (np.asarray(state.total_notfinite) == 1).all()
  expected, _ = np_powersgd(finite_grads, q0, compressed=COMPRESSED)
  for got, want in zip(applied, expected):
    for name in SHAPES:
      np.testing.assert_allclose(
        got[name][bad_replica], -LR * want[name], rtol=2e-4, atol=2e-5
      )


def test_powersgd_state_as_a_whole_under_p_axis_matches_replicated_counters(
  mesh,
):
  """The "whole state under P(axis)" spelling: a stacked, varying counter."""
  tx = _powersgd_sgd()
  params = zero_params()
  grads = random_grad_steps(seed=9, steps=2)
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P(AXIS)))  # noqa: E731
  f, state_a = _whole_state_step(tx, mesh)
  pmapped = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)
  state_b = jax.pmap(tx.init)(_stacked(params))
  for g in grads:
    ua, state_a = jax.block_until_ready(f(put(g), state_a))
    ub, state_b = jax.block_until_ready(pmapped(g, state_b))
    chex.assert_trees_all_close(
      jax.tree.map(np.asarray, ua),
      jax.tree.map(np.asarray, ub),
      rtol=1e-5,
      atol=1e-6,
    )
  assert (np.asarray(state_a[0].count) == len(grads)).all()
