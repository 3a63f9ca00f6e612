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


# ------------------------------------------------------ asynchronous rounds


def _asynchronous_run():
  """Asynchronous islands 1 and 2 from t=0 to t=100 (the coordinator's
  versions 1-3). Island 1 joins (version 0, nothing offered), exchanges
  offer 11 after 4 s of inner steps (version 1 applies it) and offer 12
  after 4 s more (version 3). Island 2 joins at t=10, offers 21 after 6 s
  (version 2), dies, and its second incarnation (from t=50) joins at
  version 3 and offers nothing more."""
  versions = [
    {"version": 1, "params_sha256": "a", "offers": [[1, 11, 4.0]]},
    {"version": 2, "params_sha256": "b", "offers": [[2, 21, 3.0]]},
    {"version": 3, "params_sha256": "c", "offers": [[1, 12, 4.0]]},
  ]

  def x(incarnation, version, offer, weight, inner_seconds):
    sha = {0: "z", 1: "a", 2: "b", 3: "c"}[version]
    return {
      "incarnation": incarnation,
      "version": version,
      "params_sha256": sha,
      "offer": offer,
      "weight": weight,
      "inner_seconds": inner_seconds,
    }

  islands = {
    1: {
      "incarnations": [{"started": 0.0, "steps": 9, "inner_seconds": 9.0}],
      "exchanges": [x(100, 0, None, 0.0, 0.0), x(100, 1, 11, 4.0, 4.0)]
      + [x(100, 3, 12, 4.0, 8.0)],
    },
    2: {
      "incarnations": [
        {"started": 10.0, "steps": 3, "inner_seconds": 6.0},
        {"started": 50.0, "steps": 0, "inner_seconds": 0.0},
      ],
      "exchanges": [x(200, 0, None, 0.0, 0.0), x(200, 2, 21, 3.0, 6.0)]
      + [x(201, 3, None, 0.0, 0.0)],
    },
  }
  return versions, islands


def test_asynchronous_goodput_counts_the_seconds_behind_applied_offers():
  versions, islands = _asynchronous_run()
  got = chaos.audit_asynchronous(versions, islands, end=100.0)
  assert got["contributions_lost"] == []
  assert got["contributions_applied_twice"] == []
  assert got["versions_with_other_bits"] == []
  # Island 1: 8 s of its 100 reached a center; island 2: 6 s of its 90
  # (from its first start: the dead time and the restart count).
  assert got["goodput_by_island"] == pytest.approx({"1": 0.08, "2": 6 / 90})
  assert got["goodput"] == pytest.approx(14 / 190)
  # Steps: 11 of the 12 taken (island 1's ninth never reached a center).
  assert got["inner_step_ratio"] == pytest.approx(11 / 12)
  assert got["contributions_combined"] == 3


def test_an_offer_no_version_applied_is_lost_and_counts_no_goodput():
  versions, islands = _asynchronous_run()
  versions[2]["offers"] = []
  got = chaos.audit_asynchronous(versions, islands, end=100.0)
  assert got["contributions_lost"] == [
    {"process": 1, "offer": 12, "why": "not applied"}
  ]
  assert got["goodput_by_island"]["1"] == pytest.approx(0.04)


def test_an_offer_applied_twice_or_with_another_weight_is_reported():
  versions, islands = _asynchronous_run()
  versions[2]["offers"].append([2, 21, 3.0])
  got = chaos.audit_asynchronous(versions, islands, end=100.0)
  assert [e["offer"] for e in got["contributions_applied_twice"]] == [21]
  versions, islands = _asynchronous_run()
  versions[1]["offers"] = [[2, 21, 1.5]]
  got = chaos.audit_asynchronous(versions, islands, end=100.0)
  assert [e["offer"] for e in got["contributions_lost"]] == [21]


def test_a_version_received_with_other_bits_is_reported():
  versions, islands = _asynchronous_run()
  islands[2]["exchanges"][2]["params_sha256"] = "not c"
  islands[1]["exchanges"][1]["version"] = 7  # never made
  got = chaos.audit_asynchronous(versions, islands, end=100.0)
  assert got["versions_with_other_bits"] == [
    {"process": 1, "version": 7, "why": "not logged"},
    {"process": 2, "version": 3, "why": "other bits"},
  ]


def test_exchange_gaps_and_restarts_behind_the_newest_version():
  """A kill at t=10 of island 2: island 1's gap across it (9 -> 12) is
  counted, island 2's own are not; island 2's second incarnation began its
  first exchange at t=20, after version 2 was logged (t=15), and was handed
  version 1: behind."""
  rows = {
    1: [
      {"incarnation": 1, "wall": w, "version": 1, "exchange_seconds": 0.1}
      for w in (3.0, 6.0, 9.0, 12.0)
    ],
    2: [
      {"incarnation": 2, "wall": 4.0, "version": 1, "exchange_seconds": 0.1},
      {"incarnation": 2, "wall": 9.5, "version": 1, "exchange_seconds": 0.1},
      {"incarnation": 3, "wall": 21.0, "version": 1, "exchange_seconds": 1.0},
    ],
  }
  gaps = chaos.exchange_gaps(rows, [{"time": 10.0, "islands": [2]}])
  assert gaps["spanning_a_kill_s"] == {"median": 3.0, "max": 3.0, "count": 1}
  assert gaps["every_s"]["count"] == 4  # 3 of island 1's, 1 of island 2's
  versions = [{"version": 1, "time": 2.0}, {"version": 2, "time": 15.0}]
  assert chaos.restarts_behind(versions, rows) == [
    {"process": 2, "version": 1, "newest": 2}
  ]
  rows[2][2]["version"] = 2
  assert chaos.restarts_behind(versions, rows) == []
