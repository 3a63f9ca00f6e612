"""Quality per byte: validation bits per byte vs bytes communicated, on a language model.

The workload is :mod:`benchmarks.lm` (a byte-level transformer on the
interpreter's stdlib sources, 8 replicas under ``jax.pmap``). Every method
wraps the same ``optax.adamw`` and trains from the same seeds on the same
data stream (issue 15's list, see :func:`benchmarks.methods.quality_per_byte`):
synchronous ``cross_shard(adamw)``, ``accumulate(cross_shard(adamw), 4)``,
``chain(powersgd(rank r), adamw)`` for r = 1, 2, 4, ``agn`` T = 8,
``local_sgd`` H = 16, ``diloco`` H = 16 and 64, streaming ``diloco`` H = 64
with F = 4 fragments, ``hierarchical_local_sgd`` ``{4: 2, 16: 8}``. A method
whose transform this shardopt does not have yet is listed as "not
available".

Bytes: each method's training chunk is compiled once; its HLO is read by
:mod:`benchmarks.hlo` (the loop body is one step) and weighted by the
method's schedule (:mod:`benchmarks.schedules`): mean and peak
all-reduce-equivalent bytes per step and per replica, and the total over the
run. A "step" is one minibatch per replica for every method (for
``accumulate``, one of its k micro-steps).

Quality: validation bits per byte every ``eval_every`` steps, mean ± std over
the seeds. Verdicts: a method *loses per step* when its final loss is above
sync's by more than the seeds' spread; it *wins per byte* when sync, to
reach the same validation loss, has to communicate more bytes than the method
did in its whole run (read off sync's validation curve, interpolated
linearly between evaluations).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # standalone: 8 CPU devices before jax is imported
  if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
    )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _common  # noqa: E402
from benchmarks import hlo  # noqa: E402
from benchmarks import lm  # noqa: E402
from benchmarks import methods  # noqa: E402
from benchmarks import schedules  # noqa: E402

NAME = "quality_per_byte"
SYNC = "cross_shard(adamw) [sync]"
TITLE = (
  "8. Quality per byte: byte-level LM on the stdlib, val bits/byte vs bytes"
)


def _sync_steps_to_reach(
  target: float, steps: Sequence[int], curve: Sequence[float]
) -> float | None:
  """First step at which sync's validation curve reaches ``target`` (linear)."""
  for i in range(1, len(curve)):
    if curve[i] <= target:
      high, low = curve[i - 1], curve[i]
      if high <= target:
        return float(steps[i - 1])
      frac = (high - target) / (high - low)
      return steps[i - 1] + frac * (steps[i] - steps[i - 1])
  return None


def measure(
  quick: bool,
  seeds: Sequence[int] | None = None,
  only: Sequence[str] | None = None,
) -> dict:
  """Trains every available method on every seed; returns curves and bytes."""
  config = lm.QUICK if quick else lm.FULL
  seeds = tuple(seeds) if seeds is not None else ((0,) if quick else (0, 1, 2))
  workload = lm.Workload(config)
  params = lm.init_params(config, 0)
  param_bytes = _common.tree_bytes(params)
  n = workload.replicas
  out = {}
  for method in methods.quality_per_byte():
    if (quick and not method.quick) or (only and method.label not in only):
      continue
    tx, why = methods.build(method, lm.adamw(config))
    entry = {
      "schedule": method.schedule.describe(),
      "available": tx is not None,
    }
    out[method.label] = entry
    if tx is None:
      entry["why"] = why
      print(f"[quality_per_byte] {method.label}: {why}", flush=True)
      continue
    t0 = time.perf_counter()
    compiled, text = workload.compile(tx)
    ops = hlo.compiled_collectives(text, num_devices=n)
    per_step = schedules.per_step(ops, method.schedule)
    entry.update(
      compile_seconds=time.perf_counter() - t0,
      collectives=hlo.summarize(ops)["count"],
      mean_bytes_per_step=per_step["mean_bytes"],
      peak_bytes_per_step=per_step["peak_bytes"],
      total_bytes=per_step["mean_bytes"] * config.steps,
      bytes_warning=per_step["warning"],
      runs=[],
    )
    for seed in seeds:
      run = workload.train(tx, seed, chunk=compiled)
      entry["runs"].append(run)
      print(
        f"[quality_per_byte] {method.label} seed {seed}:"
        f" val {run['val_bpb'][-1]:.3f} bits/byte in {run['seconds']:.1f} s",
        flush=True,
      )
    val = np.asarray([r["val_bpb"] for r in entry["runs"]])
    train = np.asarray([r["train_bpb"] for r in entry["runs"]])
    entry.update(
      steps=entry["runs"][0]["steps"],
      val_mean=val.mean(0).tolist(),
      val_std=val.std(0).tolist(),
      train_mean=train.mean(0).tolist(),
      final_mean=float(val[:, -1].mean()),
      final_std=float(val[:, -1].std()),
      seconds_per_seed=float(np.mean([r["seconds"] for r in entry["runs"]])),
      divergence=max(r["divergence"] for r in entry["runs"]),
    )
    for r in entry["runs"]:
      del r["train_bpb"]  # kept as the mean only: the JSON stays small
  return {
    "config": dataclasses.asdict(config),
    "seeds": list(seeds),
    "params": _common.count_params(params),
    "param_bytes": param_bytes,
    "replicas": n,
    "workload": workload.info,
    "methods": out,
  }


def _verdicts(data: dict) -> tuple[dict, list[str]]:
  """Per-method comparison with sync, and the family notes."""
  m = data["methods"]
  sync = m.get(SYNC)
  if not sync or not sync["available"]:
    return {}, []
  total_steps = data["config"]["steps"]
  verdicts, notes = {}, []
  for label, e in m.items():
    if label == SYNC or not e["available"]:
      continue
    spread = max(2 * max(e["final_std"], sync["final_std"]), 0.01)
    delta = e["final_mean"] - sync["final_mean"]
    loses = delta > spread
    reach = _sync_steps_to_reach(
      e["final_mean"], sync["steps"], sync["val_mean"]
    )
    sync_bytes = None if reach is None else reach * sync["mean_bytes_per_step"]
    if reach is None:
      wins = "yes"
    else:  # within 5% of the same bytes is a tie
      ratio = (
        sync_bytes / e["total_bytes"] if e["total_bytes"] else float("inf")
      )
      wins = "yes" if ratio > 1.05 else "no" if ratio < 1 / 1.05 else "tie"
    verdicts[label] = {
      "delta_vs_sync": delta,
      "loses_per_step": loses,
      "sync_steps_to_same_loss": reach,
      "sync_bytes_to_same_loss": sync_bytes,
      "wins_per_byte": wins,
    }
    if reach is None:
      per_byte = "sync never reaches it in this run: wins per byte outright"
    else:
      per_byte = (
        f"sync reaches that loss at step {reach:.0f} after"
        f" {sync_bytes / 1e6:,.1f} MB vs this method's"
        f" {e['total_bytes'] / 1e6:,.1f} MB in {total_steps} steps"
        f" ({ratio:,.1f}x): "
        + {
          "yes": "wins per byte",
          "no": "LOSES per byte",
          "tie": "a tie per byte",
        }[wins]
      )
    notes.append(
      f"**{label}**: {e['final_mean']:.3f} vs sync {sync['final_mean']:.3f}"
      f" ({delta:+.3f} bits/byte): "
      + ("LOSES per step" if loses else "does not lose per step")
      + f"; {per_byte}."
    )

  def family(prefix: str, what: str) -> None:
    rows = [
      (label, e)
      for label, e in m.items()
      if label.startswith(prefix) and e["available"]
    ]
    if len(rows) > 1:
      notes.append(
        f"{what}: "
        + "; ".join(f"{label} {e['final_mean']:.3f}" for label, e in rows)
        + f" (sync {sync['final_mean']:.3f})."
      )

  family("chain(powersgd", "PowerSGD by rank")
  family("diloco(", "DiLoCo by H")
  return verdicts, notes


def run(
  quick: bool,
  seeds: Sequence[int] | None = None,
  only: Sequence[str] | None = None,
) -> dict:
  """Runs :func:`measure` and formats the section (table, notes, data)."""
  data = measure(quick, seeds, only)
  verdicts, verdict_notes = _verdicts(data)
  data["verdicts"] = verdicts
  p = data["param_bytes"]
  rows, missing = [], []
  for label, e in data["methods"].items():
    if not e["available"]:
      missing.append(label)
      rows.append(
        [label, e["schedule"], "not available", "-", "-", "-", "-", "-"]
      )
      continue
    v = verdicts.get(label, {})
    rows.append(
      [
        label,
        e["schedule"],
        f"{e['mean_bytes_per_step'] / 1e3:,.2f} ({e['mean_bytes_per_step'] / p:.3g} P)",
        f"{e['peak_bytes_per_step'] / 1e3:,.1f}",
        f"{e['total_bytes'] / 1e6:,.2f}",
        f"{e['final_mean']:.3f} ± {e['final_std']:.3f}",
        "-" if label == SYNC else f"{v.get('delta_vs_sync', 0):+.3f}",
        "-" if label == SYNC else v.get("wins_per_byte", "-"),
      ]
    )
  c = data["config"]
  w = data["workload"]
  notes = [
    f"Byte-level transformer ({c['depth']} blocks, width {c['width']},"
    f" {c['heads']} heads, context {c['context']}; {data['params']:,} params,"
    f" P = {p:,} bytes float32), {data['replicas']} replicas under pmap,"
    f" {c['batch_per_replica']} windows of {c['context']} bytes per replica"
    f" per step, {c['steps']} steps, adamw lr {c['learning_rate']}"
    f" (weight decay {c['weight_decay']}) inside every method; mean ± std"
    f" over {len(data['seeds'])} seed(s).",
    f"Text: {w['train_files']} train / {w['validation_files']} validation"
    f" files of {w['stdlib']}/*.py (split by CRC-32 of the file name),"
    f" {w['train_bytes']:,} / {w['validation_bytes']:,} bytes; validation ="
    f" {w['validation_windows'][0]} windows evenly spread, replica-averaged"
    " params (host-side, for evaluation only).",
    "Bytes per step and replica: all-reduce-equivalent bytes of the"
    " compiled step's collectives (top level every step, each conditional"
    " branch on the steps its schedule takes it), mean over a cycle, and"
    " the peak step; total = mean x steps. 'wins per byte' = sync needs"
    " more bytes than the method's whole run to reach the method's final"
    " validation loss (sync's curve interpolated between evaluations;"
    " within 5% is a tie).",
  ] + verdict_notes
  warnings = [
    f"{label}: {e['bytes_warning']}"
    for label, e in data["methods"].items()
    if e.get("bytes_warning")
  ]
  if warnings:
    notes.append(
      "HLO does not match the schedule (check): " + "; ".join(warnings)
    )
  if missing:
    notes.append(
      "Not available in this shardopt (skipped): " + ", ".join(missing) + "."
    )
  return {
    "title": TITLE,
    "table": {
      "columns": [
        "method",
        "communicates",
        "mean kB/step",
        "peak kB/step",
        "MB per replica (run)",
        "final val bits/byte",
        "Δ vs sync",
        "wins per byte",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": data,
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``quality_per_byte.png``: final loss vs bytes, and loss vs step."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  entries = {
    k: e for k, e in result["data"]["methods"].items() if e["available"]
  }
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
  for i, (label, e) in enumerate(entries.items()):
    color = f"C{i % 10}"
    left.errorbar(
      e["total_bytes"] / 1e6,
      e["final_mean"],
      yerr=e["final_std"],
      fmt="o",
      color=color,
      capsize=3,
      label=label,
    )
    mean, std = np.asarray(e["val_mean"]), np.asarray(e["val_std"])
    right.plot(e["steps"], mean, color=color, label=label)
    right.fill_between(
      e["steps"], mean - std, mean + std, color=color, alpha=0.15
    )
  left.set(
    xscale="log",
    xlabel="MB communicated per replica in the run (log)",
    ylabel="final validation bits per byte",
    title="Quality per byte (lower left is better)",
  )
  right.set(
    xlabel="training steps",
    ylabel="validation bits per byte",
    title="Validation loss vs step",
  )
  finals = [e["final_mean"] for e in entries.values()]
  if finals:
    right.set_ylim(min(finals) - 0.2, max(finals) + 1.5)
  for ax in (left, right):
    ax.grid(alpha=0.3)
  left.legend(fontsize=7, loc="best")
  fig.tight_layout()
  path = os.path.join(directory, "quality_per_byte.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]


def main(argv=None) -> int:
  """``python -m benchmarks.quality_per_byte [--quick] [--seeds N] [--only LABEL]``."""
  import argparse
  import json

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument(
    "--seeds",
    type=int,
    default=None,
    help="number of seeds (default 3, quick 1)",
  )
  parser.add_argument(
    "--only", action="append", default=None, help="a method label (repeatable)"
  )
  parser.add_argument("--out", default=None, help="write the section JSON here")
  args = parser.parse_args(argv)
  seeds = None if args.seeds is None else range(args.seeds)
  start = time.perf_counter()
  section = run(args.quick, seeds, args.only)
  table = section["table"]
  print("| " + " | ".join(table["columns"]) + " |")
  for row in table["rows"]:
    print("| " + " | ".join(str(c) for c in row) + " |")
  for note in section["notes"]:
    print(f"- {note}")
  print(
    f"[quality_per_byte] {time.perf_counter() - start:.0f} s on"
    f" {jax.device_count()} devices"
  )
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quality_per_byte.json"), "w") as f:
      json.dump(section, f, indent=1, default=str)
    plot(section, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
