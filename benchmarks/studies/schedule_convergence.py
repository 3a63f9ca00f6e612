"""Convergence of the sync schedules: digits, hierarchical vs local SGD, streaming DiLoCo vs DiLoCo.

Issue 12's convergence questions on section 5's digits workload (8
replicas, a 64-64-10 MLP, Adam lr 1e-3 inside every method, batches of 16
per replica, the same seeds: params init ``100 + seed``, data order
``seed``, so the methods are compared on identical data):

1. ``local_sgd(adam, period=8)`` vs ``hierarchical_local_sgd(adam,
   period_group_sizes={2: 2, 8: 8})`` and ``{2: 2, 4: 4, 8: 8}``: the same
   number of global (whole-axis) rounds, one per 8 steps; the hierarchical
   ones add in-group rounds between them.
2. ``diloco(adam, sync_period=H)`` vs streaming ``diloco(adam,
   sync_period=H, num_fragments=4)`` for H = 16 and 32: the quality must
   match within noise at about 1/4 of the peak bytes per step.

Test accuracy and test loss (cross-entropy) are measured on the held-out
digits at steps that are multiples of every period of the comparison (16 for
the first, 32 for the second), on the **mean of the replicas' params**
(host-side, for evaluation only). At those
steps every replica holds the same params for local SGD, the hierarchies and
DiLoCo, so the mean is replica 0's params; streaming DiLoCo's fragments sync
at staggered offsets (fragment ``f`` after steps ``t`` with ``t % H == f H /
4``), so at an evaluation step fragments 1..3 have drifted for 3H/4, H/2 and
H/4 local steps: the table also shows replica 0's own accuracy and the final
``shardopt.replica_divergence``.

Bytes per step come from the compiled HLO of each method's training chunk
(:func:`shardopt.measure.hlo.compiled_collectives`, the collectives of the loop
body, i.e. one step) weighted by the method's schedule
(:func:`shardopt.measure.hlo.per_step`), as in sections 3 and 8.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import methods
from benchmarks.studies import harness
from benchmarks.studies import workload
from shardopt.measure import hlo
from shardopt.periodic import fragments

NAME = "schedule_convergence"
TITLE = (
  "5b. Convergence of the sync schedules: digits, hierarchical vs local SGD,"
  " streaming DiLoCo vs DiLoCo"
)
BATCH = 16
FRAGMENTS = 4
NOISE_RULE = (
  "|Δ mean| <= 2 sqrt(s_a² + s_b²) / sqrt(n): two standard errors of the"
  " difference of the means, s = sample std (ddof 1) over the n seeds;"
  " applied to the final test accuracy and to the final test loss"
  " separately, and 'quality matches' needs both"
)


def _adam():
  return optax.adam(workload.LEARNING_RATE)


def _comparisons(quick: bool) -> list[dict]:
  """The two comparisons: baseline first, the evaluation cadence, methods."""
  hierarchies = [{2: 2, 8: 8}] if quick else [{2: 2, 8: 8}, {2: 2, 4: 4, 8: 8}]
  periods = (16,) if quick else (16, 32)
  diloco = []
  for h in periods:
    diloco += [
      methods.diloco(h, name="adam"),
      methods.streaming_diloco(h, FRAGMENTS, name="adam"),
    ]
  return [
    {
      "key": "hierarchical",
      "title": "hierarchical vs local_sgd, same global rounds",
      "eval_every": 16,
      "methods": [methods.local_sgd(8, name="adam")]
      + [methods.hierarchical(h, name="adam") for h in hierarchies],
    },
    {
      "key": "streaming",
      "title": f"streaming DiLoCo F={FRAGMENTS} vs DiLoCo",
      "eval_every": math.lcm(*periods),
      "methods": diloco,
    },
  ]


def _rounds(schedule: hlo.Schedule, steps: int, n: int) -> tuple:
  """``(global rounds, all rounds)`` in ``steps`` steps of ``schedule``.

  A round is one step that communicates; it is global when the sync that
  runs in it spans the whole axis of ``n`` replicas. A streaming fragment
  sync is a global round of one fragment. Which sync runs in which step is
  the periodic engine's answer (:func:`shardopt.measure.hlo.fired`).
  """
  if not schedule.syncs:
    return steps, steps
  fired = hlo.fired(schedule, np.arange(1, steps + 1))
  groups = [schedule.syncs[k - 1].group_size for k in fired[fired > 0]]
  return sum(g in (None, n) for g in groups), len(groups)


def _split(params) -> dict:
  """How streaming DiLoCo splits these params into fragments (by bytes):
  the periodic engine's own split (:func:`shardopt.periodic.fragments.split`,
  whole leaves without ``layer_axes``)."""
  paths, leaves = zip(
    *jax.tree_util.tree_flatten_with_path(params)[0], strict=True
  )
  sizes = [leaf.size * leaf.dtype.itemsize for leaf in leaves]
  total = sum(sizes)
  split = fragments.split(params, FRAGMENTS, None, "diloco")
  out = [
    {
      "leaves": [jax.tree_util.keystr(paths[i]) for i in leaf_indices],
      "bytes": sum(sizes[i] for i in leaf_indices),
    }
    for leaf_indices in map(fragments.leaves_of, split)
  ]
  return {
    "leaf_bytes": dict(
      zip((jax.tree_util.keystr(p) for p in paths), sizes, strict=True)
    ),
    "total_bytes": total,
    "fragments": out,
    "largest_share": max(f["bytes"] for f in out) / total,
    # Fragments are whole leaves: no split can beat the largest leaf.
    "best_possible_share": max(sizes) / total,
  }


def _train(method: methods.Method, data, seeds, steps: int, eval_every: int):
  """Bytes per step from the HLO, then accuracy and loss curves per seed."""
  n = jax.device_count()
  tx, why = methods.build(method, _adam)
  if tx is None:
    return {"available": False, "why": why}
  train_x, train_y, test_x, test_y = data
  accuracy = jax.jit(
    lambda p: jnp.mean(jnp.argmax(workload.mlp_apply(p, test_x), -1) == test_y)
  )
  loss = jax.jit(lambda p: workload.mlp_loss(p, test_x, test_y))
  identity = jax.pmap(lambda t: t)
  init = jax.pmap(tx.init, axis_name=workload.AXIS)

  def start(seed):
    params = workload.mlp_init(jax.random.key(100 + seed), workload.SIZES)
    p_params = identity(workload.replicate(params, n))
    return params, p_params, init(p_params)

  _, p_params, state = start(seeds[0])
  chunk = (
    workload.digits_chunk(tx, eval_every, BATCH)
    .lower(p_params, state, train_x, train_y, jax.random.key(0), jnp.int32(0))
    .compile()
  )
  ops = hlo.compiled_collectives(chunk.as_text(), num_devices=n)
  step_ops = [op for op in ops if "loop" in op.context]  # one step's
  per_step = hlo.per_step(step_ops, method.schedule)
  global_rounds, all_rounds = _rounds(method.schedule, steps, n)
  curves = {"acc": [], "loss": [], "replica0_acc": []}
  divergence = []
  for seed in seeds:
    params, p_params, state = start(seed)
    key = jax.random.key(seed)
    acc, xent = [float(accuracy(params))], [float(loss(params))]
    first_acc = list(acc)
    for first in range(0, steps, eval_every):
      p_params, state, div = chunk(
        p_params, state, train_x, train_y, key, jnp.int32(first)
      )
      jax.block_until_ready(p_params)
      mean = jax.tree.map(lambda a: jnp.mean(a, 0), p_params)
      acc.append(float(accuracy(mean)))
      xent.append(float(loss(mean)))
      first_acc.append(float(accuracy(jax.tree.map(lambda a: a[0], p_params))))
    divergence.append(float(div[0]))
    curves["acc"].append(acc)
    curves["loss"].append(xent)
    curves["replica0_acc"].append(first_acc)
    print(
      f"[{NAME}] {method.label} seed {seed}: acc {acc[-1]:.4f}, loss"
      f" {xent[-1]:.4f} (replica 0 acc {first_acc[-1]:.4f}, divergence"
      f" {divergence[-1]:.3g})",
      flush=True,
    )
  ddof = 1 if len(seeds) > 1 else 0
  out = {
    "available": True,
    "schedule": method.schedule.describe(),
    "steps": list(range(0, steps + 1, eval_every)),
  }
  for name, values in curves.items():
    values = np.asarray(values)
    out.update(
      {
        f"{name}_final": values[:, -1].tolist(),
        f"{name}_final_mean": float(values[:, -1].mean()),
        f"{name}_final_std": float(values[:, -1].std(ddof=ddof)),
      }
    )
    if name != "replica0_acc":  # curves of the replica mean only: small JSON
      out[f"{name}_curve_mean"] = values.mean(0).tolist()
      out[f"{name}_curve_std"] = values.std(0, ddof=ddof).tolist()
  out.update(
    final_divergence=divergence,
    global_rounds=global_rounds,
    all_rounds=all_rounds,
    mean_bytes_per_step=per_step["mean_bytes"],
    peak_bytes_per_step=per_step["peak_bytes"],
    cycle_bytes=per_step["cycle"],
    branch_bytes={k: b["bytes"] for k, b in per_step["branches"].items()},
    collectives_outside_loop=len(ops) - len(step_ops),
    bytes_warning=per_step["warning"],
  )
  return out


def _compare(a: dict, b: dict, n: int) -> tuple[str, bool | None]:
  """``a`` vs ``b`` on final accuracy and loss under :data:`NOISE_RULE`.

  Returns the sentence and whether both are within noise (None: 1 seed).
  """
  parts, within_all = [], True
  for name, what in (("acc", "accuracy"), ("loss", "test loss")):
    ma, mb = a[f"{name}_final_mean"], b[f"{name}_final_mean"]
    sa, sb = a[f"{name}_final_std"], b[f"{name}_final_std"]
    delta = ma - mb
    bound = 2 * math.sqrt(sa**2 + sb**2) / math.sqrt(n)
    within = abs(delta) <= bound
    within_all = within_all and within
    better = delta > 0 if name == "acc" else delta < 0
    parts.append(
      f"{what} {ma:.4f} vs {mb:.4f} (Δ {delta:+.4f}, bound {bound:.4f}: "
      + (
        "no verdict with 1 seed"
        if n < 2
        else "within noise"
        if within
        else "BETTER beyond noise"
        if better
        else "WORSE beyond noise"
      )
      + ")"
    )
  return "; ".join(parts), (within_all if n > 1 else None)


def run(quick: bool) -> dict:
  """Trains both comparisons; returns the table, notes and curves."""
  steps = 32 if quick else 1024
  seeds = harness.seeds(quick)
  n = jax.device_count()
  data = workload.digits(n)
  identity = jax.pmap(lambda t: t)
  data = (*identity(data[:2]), data[2], data[3])
  split = _split(workload.mlp_init(jax.random.key(0), workload.SIZES))

  comparisons = _comparisons(quick)
  results = {}
  for comparison in comparisons:
    results[comparison["key"]] = {
      m.label: _train(m, data, seeds, steps, comparison["eval_every"])
      for m in comparison["methods"]
    }

  rows, notes = [], []
  for comparison in comparisons:
    for label, e in results[comparison["key"]].items():
      if not e["available"]:
        rows.append([comparison["key"], label] + ["not available"] + ["-"] * 8)
        continue
      rows.append(
        [
          comparison["key"],
          label,
          e["schedule"],
          f"{e['global_rounds']}",
          f"{e['all_rounds']}",
          f"{e['mean_bytes_per_step'] / 1e3:,.2f}",
          f"{e['peak_bytes_per_step'] / 1e3:,.2f}",
          f"{e['acc_final_mean']:.4f} ± {e['acc_final_std']:.4f}",
          f"{e['loss_final_mean']:.4f} ± {e['loss_final_std']:.4f}",
          f"{e['replica0_acc_final_mean']:.4f}",
          f"{max(e['final_divergence']):.3g}",
        ]
      )

  verdicts = []
  # 1. Hierarchical vs local SGD at the same number of global rounds.
  first = results["hierarchical"]
  base_label = comparisons[0]["methods"][0].label
  base = first[base_label]
  for label, e in first.items():
    if label == base_label or not (e["available"] and base["available"]):
      continue
    sentence, _ = _compare(e, base, len(seeds))
    same = e["global_rounds"] == base["global_rounds"]
    verdicts.append(
      f"**{label}** vs {base_label}: {sentence}; with {e['global_rounds']}"
      f" global rounds vs {base['global_rounds']} ("
      + ("the same" if same else "NOT the same")
      + f") and {e['all_rounds']} rounds in all vs {base['all_rounds']};"
      f" mean {e['mean_bytes_per_step'] / 1e3:,.2f} vs"
      f" {base['mean_bytes_per_step'] / 1e3:,.2f} kB/step."
    )
  # 2. Streaming DiLoCo vs DiLoCo: quality within noise, peak bytes ~1/F.
  second = results["streaming"]
  labels = [m.label for m in comparisons[1]["methods"]]
  for plain_label, stream_label in zip(labels[::2], labels[1::2], strict=True):
    plain, stream = second[plain_label], second[stream_label]
    if not (plain["available"] and stream["available"]):
      verdicts.append(f"{stream_label} vs {plain_label}: not available.")
      continue
    sentence, within = _compare(stream, plain, len(seeds))
    ratio = stream["peak_bytes_per_step"] / plain["peak_bytes_per_step"]
    verdicts.append(
      f"**{stream_label}** vs {plain_label}: {sentence}. Quality matches"
      " within noise (accuracy and loss): "
      + (
        "no verdict with 1 seed"
        if within is None
        else f"**{'PASS' if within else 'FAIL'}**"
      )
      + ". Peak bytes per step"
      f" {stream['peak_bytes_per_step'] / 1e3:,.2f} vs"
      f" {plain['peak_bytes_per_step'] / 1e3:,.2f} kB: ratio {ratio:.3f};"
      f" 1/{FRAGMENTS} of the peak (ratio <= {1 / FRAGMENTS:.2f} x 1.1):"
      f" **{'PASS' if ratio <= 1.1 / FRAGMENTS else 'FAIL'}**"
      + f"; the split's largest fragment is {split['largest_share']:.3f} of"
      " the params, and the ratio "
      + (
        "matches it"
        if abs(ratio - split["largest_share"]) < 0.01
        else "does NOT match it"
      )
      + f". Mean bytes {stream['mean_bytes_per_step'] / 1e3:,.2f} vs"
      f" {plain['mean_bytes_per_step'] / 1e3:,.2f} kB/step; replica 0's own"
      f" accuracy {stream['replica0_acc_final_mean']:.4f} (final divergence"
      f" up to {max(stream['final_divergence']):.3g})."
    )
  frags = "; ".join(
    f"{' + '.join(f['leaves'])} = {f['bytes']:,} B" for f in split["fragments"]
  )
  verdicts.append(
    f"Split of the digits MLP's {len(split['leaf_bytes'])} leaves"
    f" ({split['total_bytes']:,} B) into {FRAGMENTS} fragments"
    f" (shardopt's split_fragments): {frags}. The largest is"
    f" {split['largest_share']:.3f} of the params; since fragments are whole"
    f" leaves and the largest leaf alone (a 64x64 weight) is"
    f" {split['best_possible_share']:.3f}, no split of this model reaches"
    f" 1/{FRAGMENTS}: the peak-bytes criterion needs a model whose largest"
    " leaf is at most ~1/4 of the params (e.g. section 8's LM)."
  )
  warnings = [
    f"{label}: {e['bytes_warning']}"
    for group in results.values()
    for label, e in group.items()
    if e.get("bytes_warning")
  ]
  notes = [
    f"{n} replicas, {steps} steps of {BATCH} examples per replica, MLP"
    f" {list(workload.SIZES)}, Adam lr {workload.LEARNING_RATE} inside"
    f" every method (DiLoCo's outer step: {harness.default_outer()}), mean ±"
    f" std (ddof 1) over {len(seeds)} seed(s), the same seeds and data for"
    " every method.",
    f"Accuracy and loss (mean cross-entropy) on the {len(data[3])} held-out"
    " digits (one digit = "
    f"{1 / len(data[3]):.4f} of accuracy), of the mean of the replicas'"
    " params (host side), evaluated every"
    f" {comparisons[0]['eval_every']} steps in the first comparison and every"
    f" {comparisons[1]['eval_every']} in the second (multiples of every"
    " period there, so all replicas agree except streaming DiLoCo's drifting"
    " fragments; 'replica 0 acc' and 'divergence' show those).",
    "Rounds: steps that communicate; global = over all"
    f" {n} replicas (a streaming fragment sync is a global round of one"
    " fragment). Bytes: all-reduce-equivalent bytes per step and replica of"
    " the compiled step (HLO of the training chunk's loop body) weighted by"
    " the schedule; peak = the worst step of a cycle. An in-group round"
    " counts its full buffer too (per replica a ring all-reduce moves"
    " 2 (g - 1) / g of it in a group of g): the hierarchies' extra rounds"
    " are cheap only in that they stay on the in-group links.",
    f"Noise rule: {NOISE_RULE}.",
  ] + verdicts
  if warnings:
    notes.append(
      "HLO does not match the schedule (check): " + "; ".join(warnings)
    )
  return {
    "title": TITLE,
    "table": {
      "columns": [
        "comparison",
        "method",
        "communicates",
        "global rounds",
        "all rounds",
        "mean kB/step",
        "peak kB/step",
        "final test acc (replica mean)",
        "final test loss",
        "replica 0 acc",
        "divergence",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": {
      "total_steps": steps,
      "seeds": list(seeds),
      "batch_per_replica": BATCH,
      "noise_rule": NOISE_RULE,
      "split": split,
      "eval_every": {c["key"]: c["eval_every"] for c in comparisons},
      "results": results,
    },
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``schedule_convergence.png``: accuracy vs step, one panel each."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = {
    "hierarchical": "hierarchical vs local_sgd (same global rounds)",
    "streaming": f"streaming DiLoCo F={FRAGMENTS} vs DiLoCo",
  }
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, (key, title) in zip(axes, panels.items(), strict=True):
    low = 1.0
    for i, (label, e) in enumerate(result["data"]["results"][key].items()):
      if not e["available"]:
        continue
      mean = np.asarray(e["acc_curve_mean"])
      std = np.asarray(e["acc_curve_std"])
      style = "--" if "streaming" in label else "-"
      color = f"C{i // 2}" if key == "streaming" else f"C{i}"
      ax.plot(e["steps"], mean, style, color=color, label=label)
      ax.fill_between(
        e["steps"], mean - std, mean + std, color=color, alpha=0.15
      )
      low = min(low, float(mean[len(mean) // 4]))
    ax.set(
      xlabel="training steps",
      ylabel="test accuracy (replica mean)",
      title=title,
      ylim=(max(0.0, low - 0.05), 1.0),
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  path = os.path.join(directory, "schedule_convergence.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]
