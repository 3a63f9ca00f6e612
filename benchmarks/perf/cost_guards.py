"""The finite guards' cost (group 5 of :mod:`benchmarks.perf.cost`), run N times.

``python -m benchmarks.perf.cost_guards [--runs 2] [--quick]`` runs
``cost.run(quick, only_guards=True)`` ``--runs`` times one after the other
(8 forced CPU devices) and writes every run's comparisons, with the command,
the date, the commit and the machine, to
``benchmarks/results/cost_guards.json`` (``results/quick/`` with
``--quick``). The guard tables of README.md, docs/reliability.md and
benchmarks/README.md are generated from that file by ``python -m
benchmarks.blocks`` (the renderers: :mod:`benchmarks.perf.cost_guards_blocks`).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick="--quick" in sys.argv[1:])

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from benchmarks import _report  # noqa: E402

FILENAME = "cost_guards.json"


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
    timespec="seconds"
  )


def run(quick: bool, runs: int) -> dict:
  """``runs`` runs of the guard group, each with its start time and load."""
  from benchmarks.perf import cost  # imports jax: after the flags

  out = []
  for i in range(runs):
    started, load, t0 = _now(), list(os.getloadavg()), time.perf_counter()
    print(f"[cost_guards] run {i + 1} of {runs} ...", flush=True)
    section = cost.run(quick, only_guards=True)
    seconds = time.perf_counter() - t0
    print(f"[cost_guards] run {i + 1} done in {seconds:.0f} s", flush=True)
    out.append(
      {
        "started_utc": started,
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
        "seconds": seconds,
        "table": section["table"],
        "notes": section["notes"],
        "sizes": section["data"]["sizes"],
        "params": section["data"]["params"],
        "comparisons": section["data"]["comparisons"],
      }
    )
  return {"runs": out}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.perf.cost_guards",
    description=__doc__.split("\n\n")[0],
  )
  parser.add_argument("--quick", action="store_true", help="smoke sizes")
  parser.add_argument(
    "--runs", type=int, default=2, help="how many runs (default 2)"
  )
  args = parser.parse_args(argv)
  command = "python -m benchmarks.perf.cost_guards" + (
    " --quick" if args.quick else ""
  )
  if args.runs != 2:
    command += f" --runs {args.runs}"
  machine = _report.machine()
  result = {
    "command": command,
    "measured_utc": machine["date_utc"],
    "commit": machine["git_commit"],
    "machine": machine,
    **run(args.quick, args.runs),
  }
  path = _report.write_json(FILENAME, result, quick=args.quick)
  for i, r in enumerate(result["runs"]):
    print(f"run {i + 1}:", *r["table"]["rows"], sep="\n")
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
