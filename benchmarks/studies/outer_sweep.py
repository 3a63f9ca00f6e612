"""DiLoCo's outer step on section 8's language model: what breaks first.

``python -m benchmarks.studies.outer_sweep [--steps N] [--seeds S]
[--periods 16,64] [--outer "0.7,0.9;1,0"] [--batch-per-replica B]
[--end-fraction F] [--name N]`` trains section 8's byte-level transformer
(:mod:`benchmarks.studies.workload`, its FULL config and data: 8 replicas
under ``pmap``, 4 windows of 64 bytes per replica per step, AdamW on
warm-up + cosine) with

* sync, ``cross_shard(adamw)``;
* ``diloco(adamw, sync_period=H)`` for each ``H`` of ``--periods`` with four
  outer steps: the paper's Nesterov SGD (lr 0.7, momentum 0.9, shardopt's
  default), Nesterov lr 0.7 with momentum 0.5, lr 1.0 with momentum 0.5, and
  lr 1.0 with no momentum (plain averaging: ``local_sgd``'s numbers).

Section 8 found every DiLoCo variant 37-42% behind sync, and H = 16 *worse*
than H = 128, backwards for a method that gains from syncing more often. This
sweep separates the outer step from the local phase: it prints the final
validation bits per byte (replica-averaged params, section 8's 256 windows)
of each run, and saves ``benchmarks/results/outer_sweep.json`` and
``outer_sweep.png`` (validation curves). Run on its own: 9 runs of 384 steps
take about 3 minutes on the shared 2-core machine.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick=False)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import RESULTS  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks.studies import workload as lm  # noqa: E402

NAME = "outer_sweep"
OUTER_STEPS = (  # (learning rate, momentum), all Nesterov SGD
  (0.7, 0.9),  # the DiLoCo paper's, shardopt's default
  (0.7, 0.5),
  (1.0, 0.5),
  (1.0, 0.0),  # plain averaging: local SGD
)


def methods(periods, outer_steps=OUTER_STEPS) -> dict:
  """Label -> a factory of the transform, given the inner optimizer's."""
  out = {
    "sync cross_shard(adamw)": lambda opt: shardopt.cross_shard(opt(), lm.AXIS)
  }
  for period in periods:
    for lr, momentum in outer_steps:
      out[f"diloco H={period}, outer lr {lr} momentum {momentum}"] = (
        lambda opt, period=period, lr=lr, momentum=momentum: shardopt.diloco(
          opt(),
          lm.AXIS,
          sync_period=period,
          outer_learning_rate=lr,
          outer_momentum=momentum,
        )
      )
  return out


def run(
  steps: int,
  seeds: int,
  periods,
  outer_steps=OUTER_STEPS,
  first_seed: int = 0,
  **overrides,
) -> dict:
  """``overrides``: fields of :class:`benchmarks.studies.workload.Config`
  to change."""
  config = dataclasses.replace(lm.FULL, steps=steps, **overrides)
  workload = lm.Workload(config)
  runs = {}
  todo = methods(periods, outer_steps)
  for i, (label, make) in enumerate(todo.items(), 1):
    curves = []
    for seed in range(first_seed, first_seed + seeds):
      result = workload.train(make(lm.adamw(config)), seed)
      curves.append(result)
      print(
        f"[{i}/{len(todo)}] {label}, seed {seed}: final val"
        f" {result['val_bpb'][-1]:.3f} bits/byte ({result['seconds']:.0f} s)",
        flush=True,
      )
    finals = [c["val_bpb"][-1] for c in curves]
    runs[label] = {
      "steps": curves[0]["steps"],
      "val_bpb": [c["val_bpb"] for c in curves],
      "final_mean": statistics.mean(finals),
      "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
    }
  return {
    "name": NAME,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "config": dataclasses.asdict(config),
    "seeds": seeds,
    "first_seed": first_seed,
    "runs": runs,
  }


def table(section: dict) -> str:
  sync = section["runs"]["sync cross_shard(adamw)"]["final_mean"]
  lines = [
    "| method | final val bits/byte | Δ vs sync |",
    "|---|---|---|",
  ]
  for label, r in section["runs"].items():
    delta = r["final_mean"] - sync
    spread = f" ± {r['final_std']:.3f}" if section["seeds"] > 1 else ""
    lines.append(
      f"| {label} | {r['final_mean']:.3f}{spread} |"
      f" {delta:+.3f} ({100 * delta / sync:+.1f}%) |"
    )
  return "\n".join(lines)


def plot(section: dict, directory: str, name: str = NAME) -> str:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  for label, r in section["runs"].items():
    mean = [statistics.mean(v) for v in zip(*r["val_bpb"], strict=True)]
    style = (
      "-" if label.startswith("sync") else ("--" if "H=16" in label else ":")
    )
    ax.plot(r["steps"][1:], mean[1:], style, marker=".", label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("validation bits per byte")
  c = section["config"]
  ax.set_title(
    "DiLoCo's outer step on section 8's LM (8 replicas,"
    f" {c['batch_per_replica']} windows each per step)"
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  path = os.path.join(directory, f"{name}.png")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=384)
  parser.add_argument("--seeds", type=int, default=1)
  parser.add_argument(
    "--first-seed",
    type=int,
    default=0,
    help="seeds first-seed .. first-seed + seeds - 1 (default 0)",
  )
  parser.add_argument("--periods", default="16,64")
  parser.add_argument(
    "--outer",
    default=None,
    help="outer steps as lr,momentum;lr,momentum (default: all four)",
  )
  parser.add_argument(
    "--batch-per-replica",
    type=int,
    default=None,
    help="windows per replica per step (default: section 8's)",
  )
  parser.add_argument(
    "--end-fraction",
    type=float,
    default=None,
    help="where the cosine ends, a fraction of the peak (default: section"
    " 8's; the 2026-11-24 21:03 sweep ran with 0.1)",
  )
  parser.add_argument(
    "--name",
    default=NAME,
    help="results/NAME.json and .png (default %(default)s)",
  )
  args = parser.parse_args(argv)
  periods = [int(p) for p in args.periods.split(",")]
  outer = (
    OUTER_STEPS
    if args.outer is None
    else tuple(
      tuple(float(x) for x in pair.split(",")) for pair in args.outer.split(";")
    )
  )
  overrides = {
    field: value
    for field, value in (
      ("batch_per_replica", args.batch_per_replica),
      ("end_fraction", args.end_fraction),
    )
    if value is not None
  }
  section = run(
    args.steps, args.seeds, periods, outer, args.first_seed, **overrides
  )
  print(table(section))
  directory = RESULTS
  png = plot(section, directory, args.name)
  # What produced the numbers, for the tables generated from this file
  # (python -m benchmarks.blocks; renderers in outer_sweep_blocks.py).
  section["command"] = " ".join(
    [
      "python -m benchmarks.studies.outer_sweep",
      *(sys.argv[1:] if argv is None else argv),
    ]
  )
  section["commit"] = _report.git_commit()
  path = os.path.join(directory, f"{args.name}.json")
  with open(path, "w") as f:
    json.dump(section, f, indent=1)
  print(f"wrote {path} and {png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
