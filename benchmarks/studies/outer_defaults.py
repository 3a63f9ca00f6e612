"""DiLoCo's outer-step defaults on the digits MLP: never behind plain averaging?

``python -m benchmarks.studies.outer_defaults [--steps N] [--seeds S]
[--periods 4,8,...] [--outer "0.7,0.9;1,0"]`` trains the digits MLP of
:mod:`benchmarks.studies.workload` (8 replicas under ``pmap``, Adam lr 1e-3,
16 examples per replica per step) with ``diloco(adam, sync_period=H)`` for
every ``H`` of ``--periods`` and every outer Nesterov step ``(lr, momentum)``
of ``--outer``; ``(1, 0)`` is plain averaging, ``local_sgd``'s numbers. It
prints, per ``H``, the final test accuracy (mean ± std over the seeds; the
run length is a multiple of every ``H``, so the replicas have just synced)
and, for each outer step, the worst margin against plain averaging over all
``H`` in units of the seeds' spread, then saves
``benchmarks/results/outer_defaults.json``. Issue 33 asks for defaults under
which ``diloco`` is never behind ``local_sgd`` at the same ``H`` beyond the
seeds' spread; :mod:`benchmarks.studies.outer_sweep` asks the same of
section 8's language model.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick=False)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402

import optax  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import RESULTS  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks.studies import workload  # noqa: E402

NAME = "outer_defaults"
PLAIN = (1.0, 0.0)  # outer lr 1, no momentum: the mean of the replicas


def _label(lr: float, momentum: float) -> str:
  return f"lr {lr:g} momentum {momentum:g}"


def run(steps: int, seeds: int, periods, outer_steps) -> dict:
  """Final test accuracies: ``runs[H][label] = [one per seed]``."""
  runs = {}
  total = len(periods) * len(outer_steps)
  done = 0
  for period in periods:
    runs[str(period)] = {}
    for lr, momentum in outer_steps:
      tx = shardopt.diloco(
        optax.adam(workload.LEARNING_RATE),
        workload.AXIS,
        sync_period=period,
        outer_learning_rate=lr,
        outer_momentum=momentum,
      )
      per_seed, divergence = workload.train_digits(tx, range(seeds), steps)
      finals = [acc[-1] for acc in per_seed]
      runs[str(period)][_label(lr, momentum)] = finals
      done += 1
      print(
        f"[{done}/{total}] H={period}, {_label(lr, momentum)}: final test"
        f" accuracy {statistics.mean(finals):.4f} (divergence {divergence})",
        flush=True,
      )
  return {
    "name": NAME,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "steps": steps,
    "seeds": seeds,
    "outer_steps": [list(o) for o in outer_steps],
    "runs": runs,
  }


def margins(section: dict) -> dict:
  """Per outer step, the worst (lowest) ``(mean - plain mean) / spread`` over
  the periods, where spread is the larger of the two runs' seed std (at
  least 1e-4): below -1, that outer step loses to plain averaging somewhere
  beyond the seeds' spread."""
  plain = _label(*PLAIN)
  out = {}
  for lr, momentum in section["outer_steps"]:
    label = _label(lr, momentum)
    worst = None
    for by_label in section["runs"].values():
      mine, ref = by_label[label], by_label[plain]
      spread = max(_std(mine), _std(ref), 1e-4)
      margin = (statistics.mean(mine) - statistics.mean(ref)) / spread
      worst = margin if worst is None else min(worst, margin)
    out[label] = worst
  return out


def _std(values) -> float:
  return statistics.stdev(values) if len(values) > 1 else 0.0


def table(section: dict) -> str:
  labels = [_label(*o) for o in section["outer_steps"]]
  lines = [
    "| H | " + " | ".join(labels) + " |",
    "|---" * (len(labels) + 1) + "|",
  ]
  for period, by_label in section["runs"].items():
    cells = [
      f"{statistics.mean(v):.4f} ± {_std(v):.4f}"
      for v in (by_label[label] for label in labels)
    ]
    lines.append(f"| {period} | " + " | ".join(cells) + " |")
  worst = margins(section)
  lines.append(
    "| worst margin vs plain (spreads) | "
    + " | ".join(f"{worst[label]:+.2f}" for label in labels)
    + " |"
  )
  return "\n".join(lines)


def lm_finals(paths) -> dict:
  """Final val bits/byte of :mod:`.outer_sweep` runs merged from its JSON
  files: ``{H: {"lr L momentum M": {seed: value}}}`` (the sync run under
  ``H = "sync"``)."""
  sections = []
  for path in paths:
    with open(path) as f:
      sections.append(json.load(f))
  return lm_finals_of(sections)


def lm_finals_of(sections) -> dict:
  """:func:`lm_finals` of the loaded JSON of each file."""
  import re  # noqa: PLC0415

  out = {}
  for section in sections:
    first = section.get("first_seed", 0)
    for label, run_ in section["runs"].items():
      m = re.match(
        r"diloco H=(\d+), outer lr ([\d.]+) momentum ([\d.]+)", label
      )
      period, outer = (
        ("sync", "sync")
        if m is None
        else (int(m.group(1)), _label(float(m.group(2)), float(m.group(3))))
      )
      for i, curve in enumerate(run_["val_bpb"]):
        out.setdefault(period, {}).setdefault(outer, {})[first + i] = curve[-1]
  return out


def lm_table(finals: dict) -> str:
  """Per H: each outer step's mean over seeds and its mean paired difference
  from plain averaging (the same seed's lr 1 momentum 0 run; positive: worse),
  plain's seed spread (std), and per outer step the worst paired difference
  over H in units of that spread (above +1: behind plain beyond the spread).
  Outer steps run on fewer seeds than plain are compared on theirs."""
  plain = _label(*PLAIN)
  periods = sorted(p for p in finals if p != "sync")
  labels = sorted(
    {label for p in periods for label in finals[p] if label != plain},
    key=lambda s: [float(x) for x in s.split()[1::2]],
  )
  lines = [
    "| H | plain: mean ± seed std | "
    + " | ".join(f"{label}: Δ" for label in labels)
    + " |",
    "|---" * (len(labels) + 2) + "|",
  ]
  worst = dict.fromkeys(labels, None)
  for period in periods:
    ref = finals[period][plain]
    spread = statistics.stdev(ref.values()) if len(ref) > 1 else 0.0
    cells = []
    for label in labels:
      mine = finals[period].get(label, {})
      diffs = [mine[s] - ref[s] for s in mine if s in ref]
      if not diffs:
        cells.append("-")
        continue
      delta = statistics.mean(diffs)
      seeds = f" ({len(diffs)} seed)" if len(diffs) < len(ref) else ""
      cells.append(f"{delta:+.3f}{seeds}")
      if spread:
        margin = delta / spread
        worst[label] = (
          margin if worst[label] is None else max(worst[label], margin)
        )
    lines.append(
      f"| {period} | {statistics.mean(ref.values()):.3f} ± {spread:.3f} | "
      + " | ".join(cells)
      + " |"
    )
  lines.append(
    "| worst Δ / plain's spread | | "
    + " | ".join(
      "-" if worst[label] is None else f"{worst[label]:+.2f}"
      for label in labels
    )
    + " |"
  )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--lm-report",
    nargs="+",
    metavar="JSON",
    help="instead of training: merge outer_sweep results files (section 8's"
    " LM) and print each outer step against plain averaging",
  )
  parser.add_argument("--steps", type=int, default=512)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--periods", default="4,8,16,32,64,128")
  parser.add_argument(
    "--outer",
    default="0.7,0.9;1,0;0.7,0.5;0.5,0.5",
    help="outer Nesterov steps as lr,momentum;lr,momentum",
  )
  args = parser.parse_args(argv)
  if args.lm_report:
    print(lm_table(lm_finals(args.lm_report)))
    return 0
  periods = [int(p) for p in args.periods.split(",")]
  if any(args.steps % p for p in periods):
    parser.error(f"--steps {args.steps} must be a multiple of every period")
  outer = tuple(
    tuple(float(x) for x in pair.split(",")) for pair in args.outer.split(";")
  )
  if PLAIN not in outer:
    outer = (*outer, PLAIN)
  section = run(args.steps, args.seeds, periods, outer)
  print(table(section))
  # What produced the numbers, for the tables generated from this file
  # (python -m benchmarks.blocks; renderers in outer_defaults_blocks.py).
  section["command"] = " ".join(
    [
      "python -m benchmarks.studies.outer_defaults",
      *(sys.argv[1:] if argv is None else argv),
    ]
  )
  section["commit"] = _report.git_commit()
  path = os.path.join(RESULTS, f"{NAME}.json")
  with open(path, "w") as f:
    json.dump(section, f, indent=1)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
