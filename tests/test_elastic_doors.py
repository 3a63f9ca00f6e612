"""shardopt.elastic refuses hostile or careless input at the door (issue 52).

Fast: every ``Island`` argument is checked when the Island is built, before
anything reaches the coordination service (in one process, without
``jax.distributed``, a valid Island fails later, at the key-value store:
``RuntimeError``), with one error type per kind of mistake, naming the
argument, the value and the fix; the round's weights do not overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardopt
from shardopt.elastic import Island
from shardopt.elastic import island as island_mod
from shardopt.elastic import rows
from shardopt.periodic import split


def _tx(**kwargs):
  return shardopt.diloco(optax.adam(1e-2), "island", sync_period=4, **kwargs)


def test_valid_arguments_pass_the_door_and_stop_at_the_runtime():
  """A valid Island gets past every check and stops where a single process
  without jax.distributed must: the key-value store."""
  with pytest.raises(RuntimeError, match="jax.distributed is not initialized"):
    Island(
      _tx(),
      timeout_s=10,
      round_timeout_s=60,
      stall_timeout_s=np.float32(5.0),
      max_attempts=np.int64(3),
      round_seconds=2.5,
      work_per_step=2**30,
      on_event=lambda name, info: None,
    )


BAD = [
  # (kwargs, error, words the message must hold)
  (dict(round_timeout_s=-5), ValueError, ["round_timeout_s=-5", "> 0"]),
  (dict(round_timeout_s=0), ValueError, ["round_timeout_s=0", "> 0"]),
  (
    dict(round_timeout_s=float("inf")),
    ValueError,
    ["round_timeout_s=inf", "finite", "None: no watchdog"],
  ),
  (dict(timeout_s=-1), ValueError, ["timeout_s=-1", "> 0"]),
  (dict(timeout_s="10"), ValueError, ["timeout_s='10'", "number of seconds"]),
  (dict(timeout_s=True), ValueError, ["timeout_s=True"]),
  (
    dict(timeout_s=float("nan")),
    ValueError,
    ["timeout_s=nan", "finite number of seconds"],
  ),
  (dict(max_attempts=0), ValueError, ["max_attempts=0", "integer >= 1"]),
  (dict(max_attempts=2.0), ValueError, ["max_attempts=2.0", "integer"]),
  (dict(on_event=3), TypeError, ["on_event=3", "function", "or None"]),
  (
    dict(stall_timeout_s=60, round_timeout_s=30, timeout_s=10),
    ValueError,
    ["stall_timeout_s=60", "below round_timeout_s=30"],
  ),
  (dict(stall_timeout_s=0), ValueError, ["stall_timeout_s=0", "e.g. 30"]),
  (
    dict(round_timeout_s=300, timeout_s=600),
    ValueError,
    ["round_timeout_s=300", "above timeout_s=600", "lower timeout_s"],
  ),
  (
    dict(round_seconds=float("inf")),
    ValueError,
    ["round_seconds=inf", "finite"],
  ),
  (
    dict(work_per_step=8),
    ValueError,
    ["work_per_step=8", "round_seconds is None", "Pass round_seconds"],
  ),
  (
    dict(work_per_step=2**41, round_seconds=5),
    ValueError,
    ["work_per_step=2199023255552", "2**40"],
  ),
  (
    dict(work_per_step=1.5, round_seconds=5),
    ValueError,
    ["work_per_step=1.5", "integer >= 1"],
  ),
  (
    dict(dedicated_coordinator="yes"),
    TypeError,
    ["dedicated_coordinator='yes'", "True or False"],
  ),
  (
    dict(processes_per_island=0),
    ValueError,
    ["processes_per_island=0", "positive integer"],
  ),
]


@pytest.mark.parametrize(
  ("kwargs", "error", "words"), BAD, ids=[repr(b[0]) for b in BAD]
)
def test_every_argument_is_refused_at_construction_with_the_fix(
  kwargs, error, words
):
  with pytest.raises(error) as info:
    Island(_tx(), **kwargs)
  message = str(info.value)
  assert message.startswith("shardopt.elastic.Island: "), message
  for word in words:
    assert word in message, (word, message)


def test_a_transform_that_is_not_periodic_is_refused():
  with pytest.raises(TypeError, match="shardopt.elastic.Island"):
    Island(optax.adam(1e-3))


# --------------------------------------------------------------------------
# Weights: carried as float32 bits, never an int32 that overflows.


def test_a_weight_of_two_to_the_31_travels_and_weighs_exactly():
  """work_per_step=2**30 and two steps (issue 52: int32 raised
  OverflowError inside the round): the header carries 2**31 and 2**33
  exactly, and the round's total weight is their sum."""
  tx = _tx()
  engine = split.engine_of(tx, "test")
  params = {"w": jnp.ones((4, 3))}
  state = tx.init(params)
  heads = []
  for island, steps in enumerate((2, 8)):
    weight = jnp.float32(float(steps * 2**30))
    row, _ = rows.plain_rows(
      engine,
      island,
      island,
      1,
      state,
      params,
      jnp.zeros(2, jnp.int32),
      2,
      True,
      weight,
    )
    heads.append(np.asarray(row[0, : rows.HEADER_BYTES]).view(np.int32))
  heads = np.stack(heads)
  np.testing.assert_array_equal(rows.weights(heads), [2.0**31, 2.0**33])
  assert float(rows.total_weight(jnp.asarray(heads))) == 2.0**31 + 2.0**33


def test_island_weight_at_two_to_the_30_work_per_step_does_not_overflow():
  """Island._weight, the host's side, at work_per_step=2**30 after two
  steps (and after 2**31 - 1 steps: the largest int32 count)."""

  class Fake:
    _clocked, trains, _fresh, _count_at_commit = True, True, False, 0
    _work_per_step = 2**30

  for count, want in [(2, 2.0**31), (2**31 - 1, float((2**31 - 1) * 2**30))]:
    state = type("S", (), {"count": np.int32(count)})
    got = island_mod.Island._weight(Fake(), state)
    assert got.dtype == jnp.float32
    assert float(got) == float(np.float32(want))
    assert np.isfinite(float(got))


def test_weights_up_to_two_to_the_24_are_the_int32_rounds_bit_for_bit():
  """Small weights (every round every sync_period steps: 1) are exact in
  float32: the header's weight word reads back what was sent."""
  for w in (0, 1, 3, 2**24):
    head = rows.header(0, 1, True, _State(), 1, 0, jnp.int32(w))
    assert float(rows.weights(np.asarray(head)[None])[0]) == w


class _State:
  count = jnp.int32(5)
  sync_count = jnp.int32(1)
  skipped = jnp.int32(0)


def test_jax_x64_stays_off():
  assert not jax.config.jax_enable_x64
