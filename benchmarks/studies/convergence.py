"""Convergence: digits on 8 replicas, synchronous vs periodic communication.

The digits workload (:mod:`benchmarks.studies.workload`: scikit-learn's
bundled digits, 80/20 split, the training part dealt out to 8 replicas, each
drawing its own minibatches from its own share). A 64-64-10 MLP is trained
with Adam (lr 1e-3) by

* ``cross_shard(adam)``: averages gradients every step (1 round per step);
* ``agn(adam, T)`` for T in {4, 16}: local Adam steps, the normalised
  accumulated gradient is averaged and applied to the center every T steps;
* ``local_sgd(adam, period=8)``: local Adam steps, params averaged every 8;
* ``diloco(adam, sync_period=16)``: inner Adam, diloco's default outer step
  (``shardopt.periodic.checks.DEFAULT_OUTER``, named in the section's notes)
  every 16 steps (DiLoCo's H=500 scaled down to this short run).

Test accuracy is measured every 16 steps (a multiple of every period, so all
replicas hold the same params) and plotted against steps and against
communication rounds (one round = one all-reduce of the params/gradients).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import optax

import shardopt
from benchmarks.studies import harness
from benchmarks.studies import workload

NAME = "convergence"
SIZES = workload.SIZES
LEARNING_RATE = workload.LEARNING_RATE
EVAL_EVERY = workload.EVAL_EVERY
TARGET = 0.95


def _methods(quick: bool = False) -> dict:
  axis = workload.AXIS
  adam = lambda: optax.adam(LEARNING_RATE)
  methods = {
    "cross_shard(adam) [sync]": (lambda: shardopt.cross_shard(adam(), axis), 1)
  }
  for period in (4,) if quick else (4, 16):  # smoke run: one agn
    methods[f"agn(adam, T={period})"] = (
      lambda p=period: shardopt.agn(adam(), axis, sync_period=p),
      period,
    )
  methods["local_sgd(adam, period=8)"] = (
    lambda: shardopt.local_sgd(adam(), axis, sync_period=8),
    8,
  )
  methods["diloco(adam, H=16)"] = (
    lambda: shardopt.diloco(adam(), axis, sync_period=16),
    16,
  )
  return methods


def run(quick: bool) -> dict:
  """Trains every method, returns accuracy curves, table and notes."""
  total_steps = 32 if quick else 1024
  seeds = harness.seeds(quick)
  batch_size = 16
  n = jax.device_count()
  test_count = len(workload.digits(n)[3])

  curves, final_divergence = {}, {}
  for name, (make_tx, period) in _methods(quick).items():
    per_seed, final_divergence[name] = workload.train_digits(
      make_tx(), seeds, total_steps, batch_size
    )
    steps = list(range(0, total_steps + 1, EVAL_EVERY))
    curves[name] = {
      "period": period,
      "steps": steps,
      "rounds": [s // period for s in steps],
      "accuracy_mean": np.mean(per_seed, 0).tolist(),
      "accuracy_std": np.std(per_seed, 0).tolist(),
    }

  round_budget = total_steps // 16  # what agn T=16 spends in the whole run
  rows, summary = [], {}
  for name, c in curves.items():
    acc = np.asarray(c["accuracy_mean"])
    reach = next((i for i, a in enumerate(acc) if a >= TARGET), None)
    at_budget = max(i for i, r in enumerate(c["rounds"]) if r <= round_budget)
    summary[name] = {
      "final_accuracy": float(acc[-1]),
      "final_accuracy_std": float(c["accuracy_std"][-1]),
      "rounds_total": c["rounds"][-1],
      "steps_to_target": None if reach is None else c["steps"][reach],
      "rounds_to_target": None if reach is None else c["rounds"][reach],
      "accuracy_at_round_budget": float(acc[at_budget]),
      "final_replica_divergence": final_divergence[name],
    }
    s = summary[name]
    rows.append(
      [
        name,
        f"{s['rounds_total']}",
        f"{s['final_accuracy']:.3f} ± {s['final_accuracy_std']:.3f}",
        "never" if s["steps_to_target"] is None else f"{s['steps_to_target']}",
        "never"
        if s["rounds_to_target"] is None
        else f"{s['rounds_to_target']}",
        f"{s['accuracy_at_round_budget']:.3f}",
      ]
    )

  base = summary["cross_shard(adam) [sync]"]
  verdicts = []
  for name, s in summary.items():
    if name == "cross_shard(adam) [sync]":
      continue
    per_step = s["final_accuracy"] - base["final_accuracy"]
    slower = base["steps_to_target"] is not None and (
      s["steps_to_target"] is None
      or s["steps_to_target"] > base["steps_to_target"]
    )
    per_round = s["accuracy_at_round_budget"] - base["accuracy_at_round_budget"]
    parts = [
      f"**{name}**: final accuracy {s['final_accuracy']:.3f} vs sync"
      f" {base['final_accuracy']:.3f} ({per_step:+.3f}) after"
      f" {total_steps} steps with {s['rounds_total']} rounds instead of"
      f" {base['rounds_total']}"
    ]
    if per_step < -0.005 or slower:
      if base["steps_to_target"] is None:
        parts.append("it LOSES per step")
      else:
        reach = (
          "never reaches"
          if s["steps_to_target"] is None
          else f"needs {s['steps_to_target']} steps to reach"
        )
        parts.append(
          f"it LOSES per step ({reach} {TARGET:.0%}; sync needs"
          f" {base['steps_to_target']})"
        )
    else:
      parts.append("it does not lose per step")
    parts.append(
      f"at an equal budget of {round_budget} rounds it scores"
      f" {s['accuracy_at_round_budget']:.3f} vs sync's"
      f" {base['accuracy_at_round_budget']:.3f}"
      + (
        " (LOSES per round too)"
        if per_round < -0.005
        else " (wins per round)"
        if per_round > 0.005
        else " (a tie per round)"
      )
    )
    verdicts.append("; ".join(parts) + ".")
  notes = [
    f"{n} replicas, {total_steps} steps of {batch_size} examples per replica,"
    f" MLP {list(SIZES)}, Adam lr {LEARNING_RATE}, mean of {len(seeds)}"
    f" seed(s) (± = std); test set: {test_count} held-out digits. Rounds ="
    " steps / period (one all-reduce of gradients or params each). DiLoCo's"
    f" outer step: {harness.default_outer()}.",
    f"Columns: steps/rounds to reach {TARGET:.0%} test accuracy;"
    f" 'acc @ {round_budget} rounds' = accuracy when each method has used"
    f" {round_budget} communication rounds (what agn T=16 uses in the whole"
    " run).",
  ] + verdicts
  return {
    "title": "5. Convergence: digits, 8 replicas, accuracy vs steps and rounds",
    "table": {
      "columns": [
        "method",
        "rounds",
        "final test acc",
        f"steps to {TARGET:.0%}",
        f"rounds to {TARGET:.0%}",
        f"acc @ {round_budget} rounds",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": {
      "total_steps": total_steps,
      "seeds": list(seeds),
      "batch_per_replica": batch_size,
      "target": TARGET,
      "round_budget": round_budget,
      "curves": curves,
      "summary": summary,
    },
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``convergence.png`` (accuracy vs steps and vs rounds)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  curves = result["data"]["curves"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for name, c in curves.items():
    mean = np.asarray(c["accuracy_mean"])
    std = np.asarray(c["accuracy_std"])
    left.plot(c["steps"], mean, label=name)
    left.fill_between(c["steps"], mean - std, mean + std, alpha=0.15)
    rounds = np.maximum(np.asarray(c["rounds"]), 0.5)  # log axis: step 0 at 0.5
    right.plot(rounds, mean, label=name)
  left.set(
    xlabel="training steps",
    ylabel="test accuracy",
    title="Accuracy vs steps",
    ylim=(0, 1),
  )
  right.set(
    xlabel="communication rounds (log)",
    ylabel="test accuracy",
    title="Accuracy vs communication rounds",
    xscale="log",
    ylim=(0, 1),
  )
  left.grid(alpha=0.3)
  right.grid(alpha=0.3)
  right.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  path = os.path.join(directory, "convergence.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]
