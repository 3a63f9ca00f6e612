"""Communication: the collectives in one compiled step of every transform.

For each transform, one training step of the same MLP is compiled and its HLO
read by :mod:`shardopt.measure.hlo`: how many collectives of which kind, how many
bytes they move, and whether they run every step (``top``) or only inside the
sync branch of a ``lax.cond`` (``conditional``). The per-step figures weight
each conditional branch by the steps that take it
(:func:`shardopt.measure.hlo.per_step`, asking the periodic engine's schedule): the
mean over a cycle (``top + conditional / period`` for a single sync branch)
and the peak step.

Each is compared with the minimum for its method, in all-reduce-equivalent
bytes (see :mod:`shardopt.measure.hlo`): parameter bytes for ``cross_shard``; the
same total split into reduce-scatter + all-gather for ``tower``; parameter
bytes / T per step for ``agn`` (and / period for ``local_sgd``, / H for
``diloco``); half for a bfloat16 ``comm_dtype``. design.md section 6's
transforms get a row each where this shardopt has them: ``accumulate`` (P / k),
``apply_if_finite`` (P, plus its one-scalar flag), ``powersgd`` (rank x (rows
+ cols) per compressed leaf), ``hierarchical_local_sgd`` (P per sync at
either level: P / 4 per step for ``{4: 2, 16: 8}``) and streaming ``diloco``
(P / H per step on average, about P / F at the peak). The wire dtype comes from the
lowered StableHLO, because XLA's CPU backend widens bfloat16 all-reduces to
float32 in the compiled HLO (design.md, section 3).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import shardopt
from benchmarks import methods
from benchmarks.perf import workload
from shardopt.measure import hlo
from shardopt.periodic import schedules

NAME = "communication"


def _cases(n: int) -> list[dict]:
  """label, mapping, transform factory, period, minimum (x P), quick subset."""
  axis = workload.AXIS
  adam = lambda: optax.adam(1e-3)
  half = [list(range(0, n // 2)), list(range(n // 2, n))]
  cases = [
    dict(
      label="hand-written pmean + adam",
      mapping="pmap",
      tx=adam,
      hand=True,
      period=1,
      minimum=1.0,
      quick=True,
    ),
    dict(
      label="cross_shard(adam)",
      mapping="pmap",
      tx=lambda: shardopt.cross_shard(adam(), axis),
      period=1,
      minimum=1.0,
      quick=True,
    ),
    dict(
      label="chain(cross_shard_mean, adam)",
      mapping="pmap",
      tx=lambda: optax.chain(shardopt.cross_shard_mean(axis), adam()),
      period=1,
      minimum=1.0,
    ),
    dict(
      label="cross_shard(adam)",
      mapping="shard_map",
      tx=lambda: shardopt.cross_shard(adam(), axis),
      period=1,
      minimum=1.0,
    ),
    dict(
      label="cross_shard(adam), P() params, no pcast",
      mapping="shard_map_invariant",
      tx=lambda: shardopt.cross_shard(adam(), axis),
      period=1,
      minimum=1.0,
    ),
    dict(
      label="cross_shard(adam, comm_dtype=bf16)",
      mapping="pmap",
      tx=lambda: shardopt.cross_shard(adam(), axis, comm_dtype=jnp.bfloat16),
      period=1,
      minimum=0.5,
      quick=True,
    ),
    dict(
      label=f"cross_shard(adam, groups of {n // 2})",
      mapping="pmap",
      tx=lambda: shardopt.cross_shard(adam(), axis, axis_index_groups=half),
      period=1,
      minimum=1.0,
    ),
    dict(
      label=f"cross_shard(adam, groups of {n // 2})",
      mapping="shard_map",
      tx=lambda: shardopt.cross_shard(adam(), axis, axis_index_groups=half),
      period=1,
      minimum=1.0,
      per_replica_out=True,
      quick=True,
    ),
  ]
  cases.append(
    dict(
      label="tower(adam)",
      mapping="pmap",
      tx=lambda: shardopt.tower(adam(), axis),
      period=1,
      minimum=1.0,
      quick=True,
    )
  )
  cases.append(
    dict(
      label="tower(adam, comm_dtype=bf16)",
      mapping="pmap",
      tx=lambda: shardopt.tower(adam(), axis, comm_dtype=jnp.bfloat16),
      period=1,
      minimum=0.5,
    )
  )
  for period in (4, 16):
    cases.append(
      dict(
        label=f"agn(adam, T={period})",
        mapping="pmap",
        tx=lambda p=period: shardopt.agn(adam(), axis, sync_period=p),
        period=period,
        minimum=1.0 / period,
        quick=period == 16,
      )
    )
  cases.append(
    dict(
      label="local_sgd(adam, period=16)",
      mapping="pmap",
      tx=lambda: shardopt.local_sgd(adam(), axis, sync_period=16),
      period=16,
      minimum=1.0 / 16,
    )
  )
  cases.append(
    dict(
      label="diloco(adam, H=500)",
      mapping="pmap",
      tx=lambda: shardopt.diloco(adam(), axis, sync_period=500),
      period=500,
      minimum=1.0 / 500,
      quick=True,
    )
  )
  return cases + _new_cases()


def _powersgd_minimum(rank: int) -> Callable:
  """PowerSGD's bytes per step / P: r (n + m) per compressed leaf, else all.

  design.md 6.3: a leaf is viewed as ``shape[0] x rest``, ``r = min(rank, n,
  m)``, compressed iff ``ndim >= 2`` and ``r (n + m) * 2.0 < n m``
  (min_compression_rate 2, the default).
  """

  def fraction(params) -> float:
    total = moved = 0
    for leaf in jax.tree.leaves(params):
      size = leaf.size * leaf.dtype.itemsize
      total += size
      if leaf.ndim >= 2:
        rows, cols = leaf.shape[0], leaf.size // leaf.shape[0]
        r = min(rank, rows, cols)
        if r * (rows + cols) * 2.0 < rows * cols:
          moved += r * (rows + cols) * 4  # P and Q, float32
          continue
      moved += size
    return moved / total

  return fraction


def _new_cases() -> list[dict]:
  """Rows for design.md section 6's transforms, where this shardopt has them.

  ``schedule`` weights each conditional branch by the steps that take it
  (:func:`shardopt.measure.hlo.per_step`); ``minimum`` is a fraction of P (or a
  function of the params).
  """
  adam = lambda: optax.adam(1e-3)
  recipes = [
    (methods.accumulate(4, quick=True, name="adam"), 0.25),
    (
      methods.Method(
        "apply_if_finite(cross_shard(adam))",
        ("apply_if_finite",),
        lambda opt: shardopt.apply_if_finite(
          shardopt.cross_shard(opt(), workload.AXIS),
          5,
          axis_name=workload.AXIS,
        ),
        hlo.Schedule(taken="max"),
        quick=True,
      ),
      1.0,
    ),
    (methods.powersgd(1, name="adam"), _powersgd_minimum(1)),
    (methods.powersgd(2, quick=True, name="adam"), _powersgd_minimum(2)),
    (methods.powersgd(4, name="adam"), _powersgd_minimum(4)),
    (methods.hierarchical({4: 2, 16: 8}, quick=True, name="adam"), 0.25),
    (methods.streaming_diloco(500, 4, quick=True, name="adam"), 1.0 / 500),
  ]
  cases = []
  for method, minimum in recipes:
    tx, why = methods.build(method, adam)
    label = method.label.replace(" [sync]", "")
    if tx is None:
      cases.append(dict(label=label, unavailable=why))
      continue
    cases.append(
      dict(
        label=label,
        mapping="pmap",
        tx=lambda t=tx: t,
        schedule=method.schedule,
        minimum=minimum,
        quick=method.quick,
      )
    )
  return cases


def _invariant_step(tx, mesh) -> Callable:
  """shard_map step WITHOUT the pcast: autodiff psums the gradient itself."""

  def step(params, opt_state, x, y):
    grads = jax.grad(workload.mlp_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(workload.P(),) * 2 + (workload.P(workload.AXIS),) * 2,
      out_specs=(workload.P(), workload.P()),
    )
  )


def measure(quick: bool) -> dict:
  """Compiles every case and returns ``{key: measurements}`` (no timing)."""
  sizes = (32, 64, 10) if quick else (256, 512, 10)
  per_replica = 4
  n = jax.device_count()
  mesh = jax.make_mesh((n,), (workload.AXIS,))
  params = workload.mlp_init(jax.random.key(0), sizes)
  param_bytes = workload.tree_bytes(params)
  x, y = workload.batch(jax.random.key(1), n, per_replica, sizes[0], sizes[-1])
  p_params = workload.replicate(params, n)
  s_params = workload.place(params, mesh)
  s_x = workload.place(
    x.reshape(n * per_replica, -1), mesh, workload.P(workload.AXIS)
  )
  s_y = workload.place(y.reshape(-1), mesh, workload.P(workload.AXIS))

  results, unavailable = {}, {}
  for case in _cases(n):
    if "unavailable" in case:
      unavailable[case["label"]] = case["unavailable"]
      continue
    if quick and not case.get("quick"):
      continue  # the smoke run compiles one case per code path
    tx = case["tx"]()
    hand = case.get("hand", False)
    if case["mapping"] == "pmap":
      step = workload.pmap_step(tx, hand_written=hand)
      args = (
        p_params,
        jax.pmap(tx.init, axis_name=workload.AXIS)(p_params),
        x,
        y,
      )
    elif case["mapping"] == "shard_map":
      step = workload.shard_map_step(
        tx,
        mesh,
        hand_written=hand,
        per_replica_out=case.get("per_replica_out", False),
      )
      args = (s_params, workload.place(tx.init(params), mesh), s_x, s_y)
    else:
      step = _invariant_step(tx, mesh)
      args = (s_params, workload.place(tx.init(params), mesh), s_x, s_y)
    lowered = step.lower(*args)
    compiled_ops = hlo.compiled_collectives(
      lowered.compile().as_text(), num_devices=n
    )
    lowered_ops = hlo.lowered_collectives(lowered.as_text(), num_devices=n)
    compiled = hlo.summarize(compiled_ops)
    wire = hlo.summarize(lowered_ops)
    period = case.get("period", 1)
    schedule = case.get("schedule") or (
      hlo.Schedule(schedules.every(period) if period > 1 else ())
    )
    steps = hlo.per_step(compiled_ops, schedule)
    compiled_total = sum(compiled["allreduce_equivalent_bytes"].values())
    wire_total = sum(wire["allreduce_equivalent_bytes"].values())
    wire_factor = wire_total / compiled_total if compiled_total else 1.0
    wire_per_step = steps["mean_bytes"] * wire_factor
    minimum = case["minimum"]
    minimum = (minimum(params) if callable(minimum) else minimum) * param_bytes
    key = f"{case['mapping'].replace('_invariant', '')} · {case['label']}"
    results[key] = {
      "mapping": case["mapping"],
      "label": case["label"],
      "period": period,
      "schedule": schedule.describe(),
      "param_bytes": param_bytes,
      "compiled": compiled,
      "lowered": wire,
      "compiled_bytes_per_step": steps["mean_bytes"],
      "wire_bytes_per_step": wire_per_step,
      "wire_peak_bytes_per_step": steps["peak_bytes"] * wire_factor,
      "schedule_warning": steps["warning"],
      "minimum_bytes_per_step": minimum,
      "wire_over_minimum": wire_per_step / minimum,
      "wire_over_param_bytes": wire_per_step / param_bytes,
    }
  return {
    "sizes": list(sizes),
    "param_bytes": param_bytes,
    "cases": results,
    "unavailable": unavailable,
  }


def _counts(summary: dict) -> str:
  parts = []
  for context in sorted(summary["count"]):
    kinds = ", ".join(
      f"{count} {kind}"
      for kind, count in sorted(summary["count"][context].items())
    )
    parts.append(f"{context}: {kinds}")
  return "; ".join(parts) or "none"


def run(quick: bool) -> dict:
  """Measures every case and formats the section's table."""
  measured = measure(quick)
  rows = []
  for key, m in measured["cases"].items():
    ok = m["wire_over_minimum"] <= 1.01
    rows.append(
      [
        key,
        _counts(m["compiled"]),
        ", ".join(m["lowered"]["dtypes"]) or "-",
        f"{m['compiled_bytes_per_step'] / 1e3:,.1f}",
        f"{m['wire_bytes_per_step'] / 1e3:,.1f}",
        f"{m['wire_peak_bytes_per_step'] / 1e3:,.1f}",
        f"{m['minimum_bytes_per_step'] / 1e3:,.1f}",
        f"{m['wire_over_minimum']:.3f}" + ("" if ok else " (above)"),
      ]
    )
  missing = list(measured.get("unavailable", {}))
  notes = [
    f"MLP {measured['sizes']}: parameter bytes P = {measured['param_bytes']:,}"
    f" (float32), {jax.device_count()} replicas; one training step compiled"
    " per row, XLA CPU backend.",
    "Counts come from the compiled HLO: `top` runs every step, `conditional`"
    " only in a branch of a `lax.cond`/`lax.switch`. kB per step are"
    " all-reduce-equivalent (reduce-scatter and all-gather count half their"
    " full buffer each); each branch's bytes count on the steps the"
    " transform's schedule takes it (shardopt/measure/hlo.py): kB/step is"
    " the mean over a cycle, peak the largest single step (a sync step).",
    "Wire kB/step uses the dtype of the lowered StableHLO; the compiled CPU"
    " HLO shows bf16 all-reduces widened to f32, so compiled and wire"
    " differ only for bf16 rows.",
  ]
  if any(
    m["mapping"] == "shard_map_invariant" for m in measured["cases"].values()
  ):
    notes.append(
      "The shard_map `P() params, no pcast` row has its all-reduce"
      " inside autodiff (`psum_invariant` in the transpose);"
      " cross_shard then only divides by n."
    )
  if any(
    m["label"].startswith("chain(powersgd") for m in measured["cases"].values()
  ):
    notes.append(
      "PowerSGD minimum: rank x (rows + cols) float32 per leaf it"
      " compresses (leaf viewed as shape[0] x rest, compressed iff"
      " r (n + m) x 2 < n m), the other leaves in full."
    )
  warnings = [
    f"{k}: {m['schedule_warning']}"
    for k, m in measured["cases"].items()
    if m.get("schedule_warning")
  ]
  if warnings:
    notes.append(
      "HLO does not match the schedule (check): " + "; ".join(warnings)
    )
  if missing:
    notes.append(
      "Not yet measured (not yet in shardopt when this ran): "
      + ", ".join(missing)
      + "."
    )
  return {
    "title": "3. Communication per step, from the compiled HLO",
    "table": {
      "columns": [
        "step",
        "collectives (compiled HLO)",
        "wire dtype",
        "compiled kB/step",
        "wire kB/step",
        "peak wire kB/step",
        "minimum kB/step",
        "wire / minimum",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": measured,
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``communication.png``: wire bytes per step / parameter bytes."""
  from benchmarks import _plots

  cases = result["data"]["cases"]
  return [
    _plots.bars(
      f"{directory}/communication.png",
      list(cases),
      [c["wire_over_param_bytes"] for c in cases.values()],
      title="Wire bytes per step (all-reduce-equivalent) / parameter bytes",
      xlabel="fraction of parameter bytes (log)",
      reference=1.0,
      reference_label="parameter bytes",
      log=True,
    )
  ]
