"""Chaos for elastic islands: random SIGKILLs of random islands at random
moments, restarts after random delays, then what survived (issue 41 item 5).

    python examples/elastic_launch.py --chaos SEED --duration SECONDS \
        [--kills N] --num-processes 4 --sync-period 4 --out DIR

runs the example under a dedicated coordinator (process 0 trains nothing;
``--dedicated-coordinator`` is added), kills for ``SECONDS`` (one island, or
one time in ten every island at once; a kill every 3-8 s), restarts each
killed island 1-6 s later, then restarts the dead ones and, once they train,
stops every island after its next round (a file the launcher writes, the
example's ``ELASTIC_EXAMPLE_STOP``). It writes
``DIR/chaos.json`` and prints:

- kills, and rounds committed (the coordinator's ``coordinator.jsonl``);
- rounds lost: round numbers the coordinator skipped (goal 0);
- rounds whose bits differ: a round logged by an island with params other
  than the coordinator's center of that round (goal 0);
- goodput: the islands' inner steps that reached a committed center (per
  round, its contributors times the steps since the last round) over every
  inner step any incarnation took (``DIR/steps.*``; goal >= 90%);
- per kill that left a survivor, the seconds from the kill to the next
  committed round (goal: the heartbeat timeout plus one round).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

ALL_AT_ONCE = 0.1  # the share of kills that take every island down


def environment(out) -> dict:
  """The islands' environment for a chaos run writing to ``out``: the stop
  file :func:`run` writes at the end, and 4 devices per process (4^m m!
  device orders per membership of m processes; each membership and each
  failed attempt uses one up)."""
  return {
    "ELASTIC_EXAMPLE_STOP": str(Path(out) / "stop"),
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4"
    " --xla_cpu_collective_timeout_seconds=10",
  }


def run(
  islands,
  *,
  seed: int,
  duration_s: float,
  timeout_s: float,
  gap_s: tuple[float, float] = (3.0, 8.0),
  down_s: tuple[float, float] = (1.0, 6.0),
  max_kills: int | None = None,
  rounds_after: int = 0,
) -> dict:
  """Kills and restarts ``islands`` (an ``elastic_launch.Islands`` whose
  process 0 is a dedicated coordinator) for ``duration_s``: a kill every
  ``gap_s`` seconds (uniform), each island back after ``down_s``; the
  report. ``max_kills`` ends the kills early. Once the kills end and every
  island is back, the run goes on until ``rounds_after`` rounds committed
  with every island in them (the recovery; the report's
  ``rounds_after_recovery``), within ``timeout_s``."""
  rng = random.Random(seed)
  everyone = list(range(1, islands.n))
  alive = set(everyone)
  restarts: list[tuple[float, int]] = []  # (when, island)
  kills: list[dict] = []
  islands.start_all()
  end = time.time() + duration_s
  while time.time() < end and len(kills) < (max_kills or float("inf")):
    time.sleep(rng.uniform(*gap_s))
    now = time.time()
    for when, i in sorted(restarts):
      if when <= now:
        islands.start(i)
        alive.add(i)
        restarts.remove((when, i))
    if not alive:
      continue
    victims = (
      sorted(alive)
      if rng.random() < ALL_AT_ONCE
      else [rng.choice(sorted(alive))]
    )
    for i in victims:
      islands.kill(i)
      alive.discard(i)
      restarts.append((time.time() + rng.uniform(*down_s), i))
    kills.append({"time": time.time(), "islands": victims})
    print(
      f"+{time.time() - islands.t0:6.1f}s kill {victims} (kill {len(kills)})",
      flush=True,
    )
  for _, i in sorted(restarts):  # every island back, then to the end
    islands.start(i)
  _wait_until_trained(islands, everyone, timeout_s)
  recovered = time.time()
  _wait_for_rounds(islands, everyone, recovered, rounds_after, timeout_s)
  Path(environment(islands.out)["ELASTIC_EXAMPLE_STOP"]).write_text("now")
  codes = islands.wait(timeout_s)
  result = report(islands, kills, codes)
  result["rounds_after_recovery"] = len(
    _full_rounds(islands, everyone, recovered)
  )
  return result


def _full_rounds(islands, everyone, since: float) -> set[int]:
  """The round numbers first committed after ``since`` with every island in
  them (a handshake re-logs a number it already had: not counted)."""
  logged = _logged(islands)
  before = max((r["round"] for r in logged if r["time"] <= since), default=0)
  return {
    r["round"]
    for r in logged
    if r["time"] > since
    and r["round"] > before
    and set(everyone) <= set(r["live"])
  }


def _wait_for_rounds(islands, everyone, since, rounds, timeout_s) -> None:
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    if len(_full_rounds(islands, everyone, since)) >= rounds:
      return
    time.sleep(0.5)


def _wait_until_trained(islands, everyone, timeout_s: float) -> None:
  """Until every island's latest incarnation has taken an inner step (it
  joined): an island still joining when the others stop would wait for a
  round that never comes."""
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    running = {
      i: islands.procs[i].pid
      for i in everyone
      if islands.procs[i].poll() is None
    }
    if all(
      (islands.out / f"steps.{i}.{pid}").exists() for i, pid in running.items()
    ):
      return
    time.sleep(0.5)


def _steps(path: Path) -> int:
  """The inner steps an incarnation logged (a file cut by a kill: 0)."""
  try:
    return int(json.loads(path.read_text())["steps"])
  except (ValueError, KeyError):
    return 0


def _logged(islands) -> list[dict]:
  """The coordinator's rows (``coordinator.jsonl``), one per commit."""
  path = Path(islands.out) / "coordinator.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def report(islands, kills: list[dict], codes: dict) -> dict:
  out = Path(islands.out)
  logged = _logged(islands)
  # The coordinator logs every round it commits; a handshake (the start, an
  # island joining alone, islands resuming after all died) commits no new
  # number: the rounds are the rows whose number is new.
  rounds, top = [], 0
  for r in logged:
    if r["round"] > top:
      rounds.append(r)
      top = r["round"]
  numbers = [r["round"] for r in rounds]
  lost = sorted(set(range(1, max(numbers, default=0) + 1)) - set(numbers))
  center = {r["round"]: r["params_sha256"] for r in rounds}
  differ = set()
  for i in range(1, islands.n):
    for row in islands.rows(i):
      if center.get(row["round"], row["params_sha256"]) != row["params_sha256"]:
        differ.add(row["round"])
  useful, previous = 0, 0
  for r in rounds:
    useful += len(r["contributors"]) * (r["step"] - previous)
    previous = r["step"]
  trained = sum(_steps(p) for p in out.glob("steps.*"))
  stalls = []
  for kill in kills:
    if len(kill["islands"]) == islands.n - 1:
      continue  # no survivor: nothing to stall
    after = [r["time"] for r in rounds if r["time"] > kill["time"]]
    if after:
      stalls.append(after[0] - kill["time"])
  return {
    "kills": len(kills),
    "kills_of_every_island": sum(
      len(k["islands"]) == islands.n - 1 for k in kills
    ),
    "rounds_committed": len(rounds),
    "rounds_lost": lost,
    "rounds_with_other_bits": sorted(differ),
    "inner_steps": trained,
    "inner_steps_in_committed_rounds": useful,
    "goodput": useful / trained if trained else None,
    "stall_after_kill_s": {
      "median": statistics.median(stalls) if stalls else None,
      "max": max(stalls) if stalls else None,
      "count": len(stalls),
    },
    "exit_codes": {str(i): c for i, c in sorted(codes.items())},
    "failed_attempts": sum(r["attempts"] for r in rounds),
  }


def show(result: dict) -> str:
  stall = result["stall_after_kill_s"]
  lines = [
    f"kills                      {result['kills']}"
    f" ({result['kills_of_every_island']} of every island at once)",
    f"rounds committed           {result['rounds_committed']}"
    f" ({result['failed_attempts']} failed attempts)",
    f"rounds lost                {len(result['rounds_lost'])}",
    f"rounds with other bits     {len(result['rounds_with_other_bits'])}",
    f"goodput                    {result['goodput']:.1%}"
    f" ({result['inner_steps_in_committed_rounds']} of"
    f" {result['inner_steps']} inner steps)"
    if result["goodput"] is not None
    else "goodput                    -",
    f"stall after a kill         median {stall['median']:.1f} s,"
    f" max {stall['max']:.1f} s ({stall['count']} kills with survivors)"
    if stall["median"] is not None
    else "stall after a kill         -",
    f"exit codes                 {result['exit_codes']}",
  ]
  return "\n".join(lines)
