"""One name per concept: ``sync_period`` and ``inner`` (issue 35, item 1).

The old spellings (``agn(communication_period=)``, ``local_sgd(period=)``,
``optimizer=`` for the wrapped optimizer of the periodic family) still work
for one release: each warns with a ``DeprecationWarning`` that names the new
keyword, and gives the same numbers, bit for bit, as the new spelling.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardopt

AXIS = "batch"
R = 8


def _run(tx, steps=5):
  """Final params of a pmap loop of ``tx`` on per-replica gradients."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(step, axis_name=AXIS)
  params = jnp.tile(jnp.linspace(-1.0, 1.0, 6), (R, 1))
  state = jax.pmap(tx.init)(params)
  for t in range(steps):
    grads = jnp.cos(params * (t + 1) + jnp.arange(R)[:, None])
    params, state = step(params, state, grads)
    jax.block_until_ready(params)
  return np.asarray(params)


# (transform, new keywords, old keywords): the same call spelled both ways.
CALLS = {
  "agn period": (
    shardopt.agn,
    {"sync_period": 2},
    {"communication_period": 2},
  ),
  "local_sgd period": (
    shardopt.local_sgd,
    {"sync_period": 3},
    {"period": 3},
  ),
}
WRAPPED = ("agn", "local_sgd", "diloco", "hierarchical_local_sgd")
PERIOD = {
  "agn": {"sync_period": 2},
  "local_sgd": {"sync_period": 2},
  "diloco": {"sync_period": 2},
  "hierarchical_local_sgd": {"period_group_sizes": {2: 4, 4: 8}},
}


@pytest.mark.parametrize("name", CALLS)
def test_the_old_period_keyword_warns_and_gives_the_same_numbers(name):
  fn, new, old = CALLS[name]
  want = _run(fn(optax.adam(0.1), AXIS, **new))
  (old_kw,) = old
  (new_kw,) = new
  with pytest.warns(DeprecationWarning, match=rf"{old_kw}=.*{new_kw}="):
    tx = fn(optax.adam(0.1), AXIS, **old)
  np.testing.assert_array_equal(_run(tx), want)


@pytest.mark.parametrize("name", WRAPPED)
def test_optimizer_keyword_is_the_old_spelling_of_inner(name):
  fn = getattr(shardopt, name)
  want = _run(
    fn(inner=optax.sgd(0.1, momentum=0.9), axis_name=AXIS, **PERIOD[name])
  )
  with pytest.warns(DeprecationWarning, match=r"optimizer=.*inner="):
    tx = fn(
      optimizer=optax.sgd(0.1, momentum=0.9), axis_name=AXIS, **PERIOD[name]
    )
  np.testing.assert_array_equal(_run(tx), want)


def test_both_spellings_at_once_is_a_type_error_naming_the_new_one():
  with pytest.raises(TypeError, match=r"shardopt.local_sgd.*sync_period="):
    shardopt.local_sgd(optax.sgd(0.1), AXIS, sync_period=2, period=2)


def test_a_bad_value_under_the_old_spelling_is_named_by_the_new_one():
  with pytest.warns(DeprecationWarning):
    with pytest.raises(ValueError, match=r"shardopt.agn: sync_period=0"):
      shardopt.agn(optax.sgd(0.1), AXIS, communication_period=0)


def test_every_public_signature_spells_the_concepts_one_way():
  """No public callable takes ``period``, ``communication_period`` or
  ``optimizer`` as a parameter: a wrapped optimizer is ``inner``, a period
  between syncs ``sync_period``."""
  old = {"period", "communication_period", "optimizer"}
  offenders = []
  for name in shardopt.__all__:
    obj = getattr(shardopt, name)
    if not callable(obj) or inspect.isclass(obj):
      continue
    params = set(inspect.signature(obj).parameters)
    offenders += [f"shardopt.{name}({p}=)" for p in sorted(params & old)]
  assert not offenders, offenders


def test_agn_state_is_the_periodic_state_under_its_first_name():
  assert shardopt.AGNState is shardopt.PeriodicState
  tx = shardopt.local_sgd(optax.sgd(0.1), AXIS, sync_period=2)
  state = jax.pmap(tx.init)(jnp.zeros((R, 3)))
  assert isinstance(state, shardopt.AGNState)
  assert type(state).__name__ == "PeriodicState"
