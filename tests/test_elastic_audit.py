"""The chaos run's audit (``examples/elastic_chaos.py``) on synthetic logs:
goodput in island-seconds, and every way a contribution can be lost.

No processes: the logs are written here, each as the example writes it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from shardopt.elastic import rows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_spec = importlib.util.spec_from_file_location(
  "elastic_chaos", EXAMPLES / "elastic_chaos.py"
)
chaos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)


def _run():
  """Two islands (processes 1 and 2) from t=0 to t=100: island 1 sends to
  rounds 1 and 2 (4 steps of 2 s each time), island 2 to round 1 only, then
  dies and comes back at t=50 without contributing again. The coordinator
  combined every contribution in its round."""
  reference = [
    {"round": 1, "contributions": {"1": [11, 1.0], "2": [21, 1.0]}},
    {"round": 2, "contributions": {"1": [12, 1.0]}},
  ]

  def sent(round_, digest, incarnation):
    return {
      "round": round_,
      "digest": digest,
      "weight": 1.0,
      "counted": True,
      "steps": 4,
      "inner_seconds": 8.0,
      "incarnation": incarnation,
    }

  islands = {
    1: {
      "incarnations": [{"started": 0.0, "steps": 9, "inner_seconds": 18.0}],
      "sent": [sent(1, 11, 100), sent(1, 11, 100), sent(2, 12, 100)],
      "told": [
        {"round": 1, "contributions": dict(reference[0]["contributions"])},
        {"round": 2, "contributions": dict(reference[1]["contributions"])},
      ],
    },
    2: {
      "incarnations": [
        {"started": 10.0, "steps": 6, "inner_seconds": 12.0},
        {"started": 50.0, "steps": 0, "inner_seconds": 0.0},
      ],
      "sent": [sent(1, 21, 200)],
      "told": [
        {"round": 1, "contributions": dict(reference[0]["contributions"])}
      ],
    },
  }
  return reference, islands


def test_goodput_is_island_seconds_in_combined_inner_steps_over_wall_time():
  reference, islands = _run()
  got = chaos.audit(reference, islands, end=100.0)
  assert got["contributions_lost"] == []
  # Island 1: rounds 1 and 2 combined, 16 s of its 100; island 2: round 1,
  # 8 s of its 90 (from its first start; the dead time counts).
  assert got["goodput_by_island"] == pytest.approx({"1": 0.16, "2": 8 / 90})
  assert got["goodput"] == pytest.approx(24 / 190)
  assert got["useful_island_seconds"] == pytest.approx(24.0)
  assert got["island_seconds"] == pytest.approx(190.0)
  # The step-based figure beside it: 12 of the 15 inner steps taken.
  assert got["inner_step_ratio"] == pytest.approx(12 / 15)
  assert got["contributions_combined"] == 3


def test_a_dropped_contribution_is_reported_lost():
  """The check fails where it should: the coordinator's round 2 no longer
  combines island 1's contribution, which island 1 was told it did."""
  reference, islands = _run()
  reference[1]["contributions"] = {}
  got = chaos.audit(reference, islands, end=100.0)
  assert got["contributions_lost"] == [
    {
      "process": 1,
      "round": 2,
      "digest": 12,
      "why": "told it committed, not in the center",
    }
  ]
  assert got["goodput_by_island"]["1"] == pytest.approx(0.08)


def test_a_contribution_applied_twice_is_reported_lost():
  reference, islands = _run()
  reference[1]["contributions"]["2"] = [21, 1.0]
  got = chaos.audit(reference, islands, end=100.0)
  assert [(e["process"], e["round"]) for e in got["contributions_lost"]] == [
    (2, 1)
  ]
  assert "2 rounds" in got["contributions_lost"][0]["why"]
  assert got["goodput_by_island"]["2"] == 0.0  # not counted as useful


def test_a_contribution_applied_to_another_round_is_reported_lost():
  reference, islands = _run()
  reference[1]["contributions"] = {"1": [11, 1.0]}
  reference[0]["contributions"] = {"2": [21, 1.0], "1": [12, 1.0]}
  got = chaos.audit(reference, islands, end=100.0)
  whys = {(e["round"], e["why"]) for e in got["contributions_lost"]}
  assert (1, "told round 1, in [2]") in whys, whys
  assert (2, "told round 2, in [1]") in whys, whys


def test_a_contribution_combined_with_another_weight_is_reported_lost():
  reference, islands = _run()
  reference[0]["contributions"]["2"] = [21, 0.5]
  got = chaos.audit(reference, islands, end=100.0)
  assert [e["why"] for e in got["contributions_lost"]] == [
    "told weight 1.0, combined 0.5"
  ]


def test_the_digest_tells_contributions_apart():
  """rows.digest: the same bits give the same digest; one word changed, or
  two words swapped, another."""
  a = [jnp.arange(6, dtype=jnp.float32), jnp.ones(3, jnp.float32)]
  same = [jnp.asarray(np.arange(6, dtype=np.float32)), jnp.ones(3)]
  changed = [a[0].at[5].set(5.5), a[1]]
  swapped = [a[0][jnp.array([1, 0, 2, 3, 4, 5])], a[1]]
  assert int(rows.digest(a)) == int(rows.digest(same))
  assert int(rows.digest(a)) != int(rows.digest(changed))
  assert int(rows.digest(a)) != int(rows.digest(swapped))
  assert int(rows.digest([])) == 0
