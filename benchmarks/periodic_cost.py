"""Periodic cost: what a step that does *not* synchronise costs.

Every periodic transform (``agn``, ``local_sgd``, ``diloco``,
``hierarchical_local_sgd``, streaming ``diloco(num_fragments=4)``) wraps
``optax.adam``; the baseline is the same plain ``optax.adam`` local step
without shardopt. The period is 10**6, so every timed step is a local step:
nothing is communicated, and the ratio is the engine's own overhead. Each
candidate is timed twice, with the training step donating its params and
state (``jax.pmap(step, donate_argnums=(0, 1))``, what training loops do) and
without, each against the plain step compiled the same way.

Besides the times it counts, in the compiled HLO, the ``copy`` instructions of
param-shaped arrays: without donation XLA copies what a sync may change (the
center, the global optimizer state, agn's accumulator) into fresh output
buffers on every step.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

import shardopt
from benchmarks import _common
from benchmarks import _timing

NAME = "periodic_cost"
GOAL = 1.03
NEVER = 10**6   # a period no benchmark reaches: every step is a local step


def _transforms(adam) -> dict:
  """Name -> a function that builds the transform (built only when run)."""
  axis = _common.AXIS
  return {
      "plain adam": lambda: adam,
      "local_sgd(adam)": lambda: shardopt.local_sgd(adam, axis, period=NEVER),
      "diloco(adam)": lambda: shardopt.diloco(adam, axis, sync_period=NEVER),
      "agn(adam)": lambda: shardopt.agn(adam, axis, communication_period=NEVER),
      "hierarchical_local_sgd(adam, {T/2: 2, T: 8})":
          lambda: shardopt.hierarchical_local_sgd(
              adam, axis, period_group_sizes={NEVER // 2: 2, NEVER: 8}),
      "diloco(adam, num_fragments=4)": lambda: shardopt.diloco(
          adam, axis, sync_period=NEVER, num_fragments=4),
  }


def param_copies(hlo_text: str, params) -> int:
  """``copy`` instructions of arrays shaped like a param leaf."""
  shapes = {",".join(map(str, p.shape)) for p in jax.tree.leaves(params)}
  found = re.findall(r"= f32\[(?:1,)?([\d,]*)\]\{[\d,]*\} copy\(", hlo_text)
  return sum(shape in shapes for shape in found)


def run(quick: bool) -> dict:
  """Times every transform's local step against plain adam, both donations."""
  sizes = (32, 64, 32) if quick else (512, 1024, 1024, 512)
  per_replica = 4 if quick else 16
  repeats = 7 if quick else 21
  inner = 2 if quick else 3
  n = jax.device_count()
  params = _common.mlp_init(jax.random.key(0), sizes)
  x, y = _common.batch(jax.random.key(1), n, per_replica, sizes[0], sizes[-1])
  identity = jax.pmap(lambda t: t)
  stacked = identity(_common.replicate(params, n))
  batch = identity((x, y))
  transforms = _transforms(optax.adam(1e-3))
  if quick:
    transforms = {k: transforms[k] for k in ("plain adam", "diloco(adam)")}

  rows, data = [], {}
  for donate in (True, False):
    label = "donated" if donate else "not donated"
    calls, copies = {}, {}
    for name, make in transforms.items():
      calls[name], copies[name] = _timed_step(make(), stacked, batch, donate)
    timing = _timing.compare(calls, baseline="plain adam", repeats=repeats,
                             inner=inner)
    for name in transforms:
      c = timing["candidates"][name]
      key = f"{name} · {label}"
      data[key] = {"median_ms": c["median_s"] * 1e3, "ratio": c["ratio"],
                   "paired_ratio": c["paired_ratio"], "iqr_rel": c["iqr_rel"],
                   "param_copies": copies[name], "donated": donate}
      rows.append([name, label, f"{c['median_s'] * 1e3:.2f}",
                   f"{c['ratio']:.3f} (paired {c['paired_ratio']:.3f})",
                   f"±{c['iqr_rel'] * 50:.1f}%", str(copies[name])])
  donated = {k: v for k, v in data.items()
             if v["donated"] and not k.startswith("plain")}
  worst = max(donated, key=lambda k: donated[k]["paired_ratio"])
  notes = [
      f"MLP {list(sizes)} = {_common.count_params(params):,} params, Adam,"
      f" {per_replica} examples per replica, {n} replicas under pmap; period"
      f" {NEVER}, so every step is a local step. Median of {repeats}"
      f" interleaved rounds ({inner} steps per sample), warm-up excluded.",
      "Ratio: median time / median time of the plain `optax.adam` step"
      " compiled with the same donation; `paired` is the median of per-round"
      " ratios. Copies: param-shaped `copy` instructions in the compiled step.",
      f"Goal <= {GOAL} for a donated step: worst `{worst}` at paired"
      f" {donated[worst]['paired_ratio']:.3f}.",
      "Not donated, XLA copies what a sync may change (center, global"
      " optimizer state, agn's accumulator) into fresh output buffers every"
      " step. Donated under pmap, XLA:CPU copies even in the plain step"
      f" ({data['plain adam · donated']['param_copies']} param copies here);"
      " the guard that keeps the global state when no replica of a group is"
      " finite makes XLA copy the global state (diloco, agn), and multi-branch"
      " schedules (hierarchy, fragments) copy the local step's results.",
  ]
  return {
      "title": "Periodic cost: a step without a sync vs plain optax.adam",
      "table": {"columns": ["transform", "state", "median ms",
                            "ratio vs plain adam", "spread", "param copies"],
                "rows": rows},
      "notes": notes,
      "data": {"params": _common.count_params(params), "sizes": list(sizes),
               "repeats": repeats, "inner": inner, "goal": GOAL,
               "rows": data},
  }


def _timed_step(tx, stacked, batch, donate):
  """A zero-argument call running one step (feeding its outputs back), and
  the number of param-shaped copies in its compiled HLO."""
  def step(params, opt_state, x, y):
    grads = jax.grad(_common.mlp_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.pmap(step, axis_name=_common.AXIS,
                  donate_argnums=(0, 1) if donate else ())
  state = jax.pmap(tx.init)(stacked)
  text = step.lower(stacked, state, *batch).compile().as_text()
  box = {"params": jax.tree.map(jnp.copy, stacked),
         "state": jax.tree.map(jnp.copy, state)}

  def call():
    box["params"], box["state"] = step(box["params"], box["state"], *batch)
    return box["params"]

  return call, param_copies(text, jax.tree.map(lambda p: p[0], stacked))
