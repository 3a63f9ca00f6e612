"""``python -m benchmarks.perf.elastic --asynchronous [--seconds 30]
[--repeats 2]``: asynchronous rounds (issue 50) against rounds on the clock.

``examples/elastic_diloco.py`` under a dedicated coordinator, 3 islands, 2
CPU devices each, H = 8, a sleep per inner step standing in for compute:
equal islands (0.03 s a step each) and islands at 1x, 3x and 9x (0.01,
0.03, 0.09 s). Each run trains for ``--seconds`` of wall time after the
first island's first exchange, then every island stops after its next
round. Four setups per speed profile:

- ``asynchronous, every 8 steps``: ``--asynchronous`` (quorum 1, delayed
  Nesterov with the library's outer lr 0.8 and momentum 0.2, period 3);
- ``asynchronous, every 2 s``: the same, each island's exchange due 2 s
  after its last (``--round-seconds 2``: the cadence of the next setup);
- ``on the clock``: synchronous rounds every 2 s (``--round-seconds 2``),
  each island weighted by its steps;
- ``asynchronous, island 3 killed``: SIGKILL at half time, back 3 s later.

Per run: each island's share of its wall time in inner steps (its
``steps.{I}.{pid}`` files: seconds in inner steps over seconds since it
joined, summed over incarnations; the rest is the example's host work per
step, its batch and its log, and the exchanges), the share inside its
exchanges (asynchronous runs: the rows' ``exchange_seconds`` over the same
seconds, each incarnation's joining exchange left out: it comes before
them), the time-based goodput of asynchronous runs (island-seconds in
inner steps whose contribution reached a center, i.e. up to the
incarnation's last exchange, over island-seconds since each island's first
start, start-ups and restarts included), the outer steps
(versions) or rounds, the center's held-out loss when the islands are done
(the coordinator's last line), and for the kill: island 1's longest gap
between two exchanges from 1 s before the kill to 20 s after the restart,
and whether the restarted island's first exchange handed it a version at
least as new as every version made before it joined. Timing differs run to
run (the machine's load); ``--repeats`` runs each setup that many times
(the example's data and init are fixed: the spread is the runs' timing).
Saved to ``benchmarks/results/elastic_async.json``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

H = 8
SPEEDS = {"equal": "0,0.03,0.03,0.03", "1x 3x 9x": "0,0.01,0.03,0.09"}
SETUPS = {
  "asynchronous, every 8 steps": (("--asynchronous",), False),
  "asynchronous, every 2 s": (
    ("--asynchronous", "--round-seconds", "2"),
    False,
  ),
  "on the clock (2 s)": (("--round-seconds", "2"), False),
  "asynchronous, island 3 killed": (("--asynchronous",), True),
}
_LOSS = re.compile(r"the center's loss ([0-9.]+)")


def _incarnations(out: Path, island: int) -> list[dict]:
  return [json.loads(p.read_text()) for p in out.glob(f"steps.{island}.*")]


def run(launch, speeds: str, extra: tuple, seconds: float, kill: bool) -> dict:
  """One run (module docstring)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp)
    with launch.Islands(
      out,
      num_processes=4,
      steps=10**6,
      sync_period=H,
      step_seconds=speeds,
      env={"ELASTIC_EXAMPLE_STOP": str(out / "stop")},
      extra=("--dedicated-coordinator", *extra),
    ) as islands:
      islands.start_all()
      if not islands.wait_for_step(1, 1, 180):
        raise RuntimeError(islands.log(1)[-3000:])
      start = time.time()
      killed_at = restarted_at = None
      if kill:
        time.sleep(seconds / 2)
        killed_at = time.time()
        islands.kill(3)
        time.sleep(3.0)
        islands.start(3)
        restarted_at = time.time()
      time.sleep(max(0.0, start + seconds - time.time()))
      (out / "stop").write_text("now")
      codes = islands.wait(180)
      end = time.time()
      loss = _LOSS.findall(islands.log(0))
      result = {
        "exit_codes": {str(i): c for i, c in sorted(codes.items())},
        "center_loss": float(loss[-1]) if loss else None,
        "coordinator_rows": len(launch._jsonl(out / "coordinator.jsonl")),
      }
      shares, waits, useful, lived = {}, {}, 0.0, 0.0
      for i in (1, 2, 3):
        runs = _incarnations(out, i)
        shares[str(i)] = sum(r["inner_seconds"] for r in runs) / max(
          sum(r["seconds"] for r in runs), 1e-9
        )
        rows = islands.rows(i)
        if "--asynchronous" in extra:  # time inside its exchanges
          # after each incarnation joined (its joining exchange is before
          # the seconds counted, as the inner-step share counts them)
          waits[str(i)] = sum(
            r["exchange_seconds"] for r in rows if not r["joined"]
          ) / max(sum(r["seconds"] for r in runs), 1e-9)
        last = {}
        for r in rows:
          last[r["incarnation"]] = r.get("inner_seconds", 0.0)
        useful += sum(last.values())
        first = min((r["started"] for r in runs), default=end)
        lived += end - first
      result["inner_share_by_island"] = shares
      result["exchange_share_by_island"] = waits
      if "--asynchronous" in extra:
        result["goodput"] = useful / lived
      if kill:
        walls = [r["wall"] for r in islands.rows(1)]
        gaps = [
          b - a
          for a, b in zip(walls, walls[1:], strict=False)
          if b > killed_at - 1 and a < restarted_at + 20
        ]
        result["island_1_longest_gap_s"] = max(gaps) if gaps else None
        result["island_1_median_gap_s"] = (
          statistics.median(gaps) if gaps else None
        )
        rows3 = islands.rows(3)
        back = [r for r in rows3 if r["incarnation"] != rows3[0]["incarnation"]]
        versions = launch._jsonl(out / "coordinator.jsonl")
        if back:
          made = [
            r["version"] for r in versions if r["time"] < back[0]["wall"] - 0.5
          ]
          result["restarted_first_version"] = back[0]["version"]
          result["newest_version_before_it_joined"] = max(made, default=0)
  return result


def measure(launch, seconds: float, repeats: int) -> dict:
  """Every run; prints one table row per run."""
  out = {"seconds": seconds, "sync_period": H, "speeds_s": SPEEDS, "runs": []}
  out["load_average"] = {"start": list(os.getloadavg())}  # 1, 5, 15 min
  print(
    "| speeds | setup | run | inner-step share per island |"
    " exchange share per island | goodput |"
    " outer steps | center loss | island 1 longest gap | exit codes |"
  )
  print("|---|---|---:|---|---|---:|---:|---:|---:|---|")
  for speed, profile in SPEEDS.items():
    for setup, (extra, kill) in SETUPS.items():
      for k in range(1 if kill else repeats):
        r = run(launch, profile, extra, seconds, kill)
        r.update(speeds=speed, setup=setup, repeat=k)
        out["runs"].append(r)
        share = ", ".join(
          f"{v:.1%}" for v in r["inner_share_by_island"].values()
        )
        goodput = f"{r['goodput']:.1%}" if "goodput" in r else "-"
        waits = (
          ", ".join(f"{v:.1%}" for v in r["exchange_share_by_island"].values())
          or "-"
        )
        gap = r.get("island_1_longest_gap_s")
        print(
          f"| {speed} | {setup} | {k + 1} | {share} | {waits} | {goodput} |"
          f" {r['coordinator_rows']} | {r['center_loss']} |"
          f" {'-' if gap is None else f'{gap:.2f} s'} | {r['exit_codes']} |",
          flush=True,
        )
  out["load_average"]["end"] = list(os.getloadavg())
  return out
