"""Convergence: digits on 8 replicas, synchronous vs periodic communication.

scikit-learn's bundled digits data set (1,797 8x8 images, no download), split
80/20 with a fixed seed; the training part is dealt out to 8 replicas, each of
which draws its own minibatches from its own share. A 64-64-10 MLP is trained
with Adam (lr 1e-3) by

* ``cross_shard(adam)``: averages gradients every step (1 round per step);
* ``agn(adam, T)`` for T in {4, 16}: local Adam steps, the normalised
  accumulated gradient is averaged and applied to the center every T steps;
* ``local_sgd(adam, period=8)``: local Adam steps, params averaged every 8;
* ``diloco(adam, sync_period=16)``: inner Adam, outer Nesterov SGD (0.7, 0.9)
  every 16 steps (DiLoCo's H=500 scaled down to this short run).

Test accuracy is measured every 16 steps (a multiple of every period, so all
replicas hold the same params) and plotted against steps and against
communication rounds (one round = one all-reduce of the params/gradients).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardopt
from benchmarks import _common

NAME = "convergence"
SIZES = (64, 64, 10)
LEARNING_RATE = 1e-3
EVAL_EVERY = 16
TARGET = 0.95


def _digits(replicas: int):
  from sklearn.datasets import load_digits  # bundled with scikit-learn

  data = load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  test_count = len(x) // 5
  test, train = order[:test_count], order[test_count:]
  per_replica = len(train) // replicas
  train = train[: per_replica * replicas]
  return (
    x[train].reshape(replicas, per_replica, -1),
    y[train].reshape(replicas, per_replica),
    x[test],
    y[test],
  )


def _methods(quick: bool = False) -> dict:
  axis = _common.AXIS
  adam = lambda: optax.adam(LEARNING_RATE)
  methods = {
    "cross_shard(adam) [sync]": (lambda: shardopt.cross_shard(adam(), axis), 1)
  }
  if _common.has("agn"):
    for period in (4,) if quick else (4, 16):  # smoke run: one agn
      methods[f"agn(adam, T={period})"] = (
        lambda p=period: shardopt.agn(adam(), axis, sync_period=p),
        period,
      )
  if _common.has("local_sgd"):
    methods["local_sgd(adam, period=8)"] = (
      lambda: shardopt.local_sgd(adam(), axis, sync_period=8),
      8,
    )
  if _common.has("diloco"):
    methods["diloco(adam, H=16)"] = (
      lambda: shardopt.diloco(adam(), axis, sync_period=16),
      16,
    )
  return methods


def _train_chunk(tx, steps: int, batch_size: int):
  """pmap-ed: ``steps`` local steps from ``first_step``, returns params/state."""

  def chunk(params, state, x, y, key, first_step):
    replica = jax.lax.axis_index(_common.AXIS)

    def one(carry, step):
      params, state = carry
      k = jax.random.fold_in(jax.random.fold_in(key, step), replica)
      idx = jax.random.randint(k, (batch_size,), 0, x.shape[0])
      grads = jax.grad(_common.mlp_loss)(params, x[idx], y[idx])
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(
      one, (params, state), first_step + jnp.arange(steps)
    )
    divergence = shardopt.replica_divergence(params, _common.AXIS)
    return params, state, divergence

  return jax.pmap(
    chunk, axis_name=_common.AXIS, in_axes=(0, 0, 0, 0, None, None)
  )


def train(tx, seeds, total_steps: int, batch_size: int = 16):
  """Trains the digits MLP with ``tx`` on 8 replicas, once per seed.

  Returns:
    ``(per_seed, divergence)``: test accuracy every ``EVAL_EVERY`` steps
    (step 0 first) for each seed, and the largest final
    ``replica_divergence`` of the params over the seeds.
  """
  n = jax.device_count()
  train_x, train_y, test_x, test_y = _digits(n)
  identity = jax.pmap(lambda t: t)
  train_x, train_y = identity((train_x, train_y))
  accuracy = jax.jit(
    lambda p: jnp.mean(jnp.argmax(_common.mlp_apply(p, test_x), -1) == test_y)
  )
  chunk = _train_chunk(tx, EVAL_EVERY, batch_size)
  per_seed, final_divergence = [], 0.0
  for seed in seeds:
    params = _common.mlp_init(jax.random.key(100 + seed), SIZES)
    p_params = identity(_common.replicate(params, n))
    state = jax.pmap(tx.init, axis_name=_common.AXIS)(p_params)
    key = jax.random.key(seed)
    acc = [float(accuracy(params))]
    for first in range(0, total_steps, EVAL_EVERY):
      p_params, state, divergence = chunk(  # first as an array: no retrace
        p_params, state, train_x, train_y, key, jnp.int32(first)
      )
      acc.append(float(accuracy(jax.tree.map(lambda a: a[0], p_params))))
    final_divergence = max(final_divergence, float(divergence[0]))
    per_seed.append(acc)
  return per_seed, final_divergence


def run(quick: bool) -> dict:
  """Trains every method, returns accuracy curves, table and notes."""
  total_steps = 32 if quick else 1024
  seeds = (0,) if quick else (0, 1, 2)
  batch_size = 16
  n = jax.device_count()
  test_count = len(_digits(n)[3])

  curves, final_divergence = {}, {}
  for name, (make_tx, period) in _methods(quick).items():
    per_seed, final_divergence[name] = train(
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
  missing = [m for m in ("agn", "local_sgd", "diloco") if not _common.has(m)]
  notes = [
    f"{n} replicas, {total_steps} steps of {batch_size} examples per replica,"
    f" MLP {list(SIZES)}, Adam lr {LEARNING_RATE}, mean of {len(seeds)}"
    f" seed(s) (± = std); test set: {test_count} held-out digits. Rounds ="
    " steps / period (one all-reduce of gradients or params each).",
    f"Columns: steps/rounds to reach {TARGET:.0%} test accuracy;"
    f" 'acc @ {round_budget} rounds' = accuracy when each method has used"
    f" {round_budget} communication rounds (what agn T=16 uses in the whole"
    " run).",
  ] + verdicts
  if missing:
    notes.append(
      "Not yet in shardopt when this ran: " + ", ".join(missing) + "."
    )
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
