"""Overhead: one Adam step of a ~5M-parameter MLP, shardopt versus hand-written.

Baseline (A): what a user writes without shardopt, ``jax.lax.pmean(grads)``
then ``optax.adam`` in a ``pmap`` step. Candidates (B): the same step with
``optax.chain(shardopt.cross_shard_mean("batch"), optax.adam(...))`` and with
``shardopt.cross_shard(optax.adam(...), "batch")``, under ``pmap`` and under a
checking ``shard_map`` (replicated params cast to varying before ``jax.grad``;
its own hand-written ``pmean`` baseline is timed too). Goal: ratio <= 1.02.

Besides the timings it checks that every variant computes the same params as
the baseline after one step, and compares the compiled instruction mix
(:func:`instruction_mix`, over :func:`shardopt.measure.hlo.instructions`):
an identical mix means the wrapper compiles to the same program, whatever
the noisy clock says.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np
import optax

import shardopt
from benchmarks.perf import harness
from benchmarks.perf import workload
from shardopt.measure import hlo

NAME = "overhead"
GOAL = 1.02
# Instructions that move no data and compute nothing: left out of the mix.
_BOOKKEEPING = ("parameter", "get-tuple-element", "tuple", "bitcast", "copy")
_LAYOUT = re.compile(r"\{[\d,]*\}")


def instruction_mix(hlo_text: str) -> Counter:
  """``{"opcode shape": count}`` over the instructions of compiled HLO text
  (layouts dropped, bookkeeping left out). Two steps with the same mix run
  the same kernels on the same shapes: a cheap, name-independent way to
  show that a wrapper compiles away."""
  return Counter(
    f"{opcode} {_LAYOUT.sub('', shape)}"
    for opcode, shape in hlo.instructions(hlo_text)
    if opcode not in _BOOKKEEPING
  )


def mix_difference(a: Counter, b: Counter) -> int:
  """Number of instructions by which two :func:`instruction_mix` results
  differ."""
  return sum(abs(a[k] - b[k]) for k in a.keys() | b.keys())


def run(quick: bool) -> dict:
  """Times the six steps interleaved and returns the section's result."""
  sizes = (64, 128, 10) if quick else (1024, 2048, 1536, 10)
  per_replica = 8 if quick else 16
  repeats = 7 if quick else 21
  inner = 3 if quick else 2
  n = jax.device_count()
  mesh = jax.make_mesh((n,), (workload.AXIS,))
  params = workload.mlp_init(jax.random.key(0), sizes)
  x, y = workload.batch(jax.random.key(1), n, per_replica, sizes[0], sizes[-1])
  adam = optax.adam(1e-3)

  transforms = {"hand-written pmean + adam": (adam, True)}
  if not quick:  # the smoke run compiles one shardopt variant per mapping
    transforms["chain(cross_shard_mean, adam)"] = (
      optax.chain(shardopt.cross_shard_mean(workload.AXIS), adam),
      False,
    )
  transforms["cross_shard(adam)"] = (
    shardopt.cross_shard(adam, workload.AXIS),
    False,
  )
  steps, args, texts = {}, {}, {}
  identity = jax.pmap(lambda t: t)
  p_params = identity(workload.replicate(params, n))
  p_batch = identity((x, y))
  s_params = workload.place(params, mesh)
  s_x = workload.place(
    x.reshape(n * per_replica, -1), mesh, workload.P(workload.AXIS)
  )
  s_y = workload.place(y.reshape(-1), mesh, workload.P(workload.AXIS))
  for label, (tx, hand) in transforms.items():
    name = f"pmap · {label}"
    steps[name] = workload.pmap_step(tx, hand_written=hand)
    state = jax.pmap(tx.init, axis_name=workload.AXIS)(p_params)
    args[name] = (p_params, state) + p_batch
    name = f"shard_map · {label}"
    steps[name] = workload.shard_map_step(tx, mesh, hand_written=hand)
    args[name] = (s_params, workload.place(tx.init(params), mesh), s_x, s_y)
  for name, step in steps.items():
    texts[name] = step.lower(*args[name]).compile().as_text()

  baseline = "pmap · hand-written pmean + adam"
  shard_baseline = "shard_map · hand-written pmean + adam"
  # Same numbers: one step of every variant against the baseline.
  reference = np.asarray(
    jax.tree.leaves(steps[baseline](*args[baseline])[0])[0][0]
  )
  max_diff = {}
  for name, step in steps.items():
    leaf = np.asarray(jax.tree.leaves(step(*args[name])[0])[0])
    leaf = leaf[0] if name.startswith("pmap") else leaf
    max_diff[name] = float(np.max(np.abs(leaf - reference)))

  timing = harness.compare(
    {
      name: (lambda s=step, a=args[name]: s(*a)) for name, step in steps.items()
    },
    baseline=baseline,
    repeats=repeats,
    inner=inner,
  )

  mixes = {name: instruction_mix(text) for name, text in texts.items()}
  rows, data = [], {}
  for name in steps:
    own = baseline if name.startswith("pmap") else shard_baseline
    vs_own = harness.ratio(timing, name, own)
    collectives = hlo.summarize(
      hlo.compiled_collectives(texts[name], num_devices=n)
    )
    row = {
      "median_ms": timing["candidates"][name]["median_s"] * 1e3,
      "ratio_vs_pmap_hand": timing["candidates"][name]["ratio"],
      "paired_ratio_vs_pmap_hand": timing["candidates"][name]["paired_ratio"],
      "ratio_vs_same_mapping_hand": vs_own["ratio"],
      "paired_ratio_vs_same_mapping_hand": vs_own["paired_ratio"],
      "iqr_rel": timing["candidates"][name]["iqr_rel"],
      "instruction_mix_difference_vs_hand": mix_difference(
        mixes[name], mixes[own]
      ),
      "collectives": collectives["count"],
      "max_abs_param_diff_vs_baseline": max_diff[name],
    }
    data[name] = row
    rows.append(
      [
        name,
        f"{row['median_ms']:.2f}",
        f"{row['ratio_vs_pmap_hand']:.3f}",
        f"{row['ratio_vs_same_mapping_hand']:.3f}"
        f" (paired {row['paired_ratio_vs_same_mapping_hand']:.3f})",
        f"±{row['iqr_rel'] * 50:.1f}%",
        "identical"
        if row["instruction_mix_difference_vs_hand"] == 0
        else f"{row['instruction_mix_difference_vs_hand']} instr. differ",
        f"{row['max_abs_param_diff_vs_baseline']:.1e}",
      ]
    )

  shardopt_rows = {k: v for k, v in data.items() if "hand-written" not in k}
  worst = max(
    shardopt_rows, key=lambda k: shardopt_rows[k]["ratio_vs_same_mapping_hand"]
  )
  worst_ratio = shardopt_rows[worst]["ratio_vs_same_mapping_hand"]
  identical = all(
    v["instruction_mix_difference_vs_hand"] == 0 for v in shardopt_rows.values()
  )
  notes = [
    f"MLP {list(sizes)} = {workload.count_params(params):,} params, Adam,"
    f" {per_replica} examples per replica, {n} replicas; median of {repeats}"
    f" interleaved rounds ({inner} step(s) per sample), warm-up excluded.",
    "Ratio columns: median time / median time of the hand-written"
    " `pmean` + `optax.adam` step (under pmap, and under the same mapping);"
    " `paired` is the median of per-round ratios. `±` is half the"
    " interquartile range of this row's samples, relative to its median.",
    f"Goal ratio <= {GOAL}: worst shardopt row `{worst}` at"
    f" {worst_ratio:.3f} -> {'met' if worst_ratio <= GOAL else 'NOT met'}.",
    "Compiled instruction mix of every shardopt step vs its hand-written"
    f" twin: {'identical (same program)' if identical else 'differs'}.",
  ]
  if worst_ratio > GOAL and identical:
    notes.append(
      f"Why the goal reads as not met: {worst} compiles to the same"
      " instructions as its hand-written twin, so its"
      f" {(worst_ratio - 1) * 100:.1f}% is clock noise on this shared"
      f" machine (that row's spread is ±{shardopt_rows[worst]['iqr_rel'] * 50:.1f}%),"
      " not shardopt overhead."
    )
  return {
    "title": "1. Overhead: one Adam step, shardopt vs hand-written pmean",
    "table": {
      "columns": [
        "step",
        "median ms",
        "ratio vs pmap hand",
        "ratio vs same-mapping hand",
        "spread",
        "compiled mix vs hand",
        "max |Δparam|",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": {
      "params": workload.count_params(params),
      "sizes": list(sizes),
      "per_replica_batch": per_replica,
      "repeats": repeats,
      "inner": inner,
      "goal": GOAL,
      "worst": worst,
      "worst_ratio": worst_ratio,
      "goal_met": worst_ratio <= GOAL,
      "same_program": identical,
      "rows": data,
    },
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``overhead.png``: each step's time relative to its hand-written twin."""
  from benchmarks import _plots

  rows = result["data"]["rows"]
  return [
    _plots.bars(
      f"{directory}/overhead.png",
      list(rows),
      [r["ratio_vs_same_mapping_hand"] for r in rows.values()],
      title="Step time / hand-written pmean + adam (same mapping)",
      xlabel="ratio (median of interleaved rounds)",
      reference=GOAL,
      reference_label=f"goal {GOAL}",
    )
  ]
