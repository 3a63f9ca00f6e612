"""Quality per byte: validation bits per byte vs bytes sent, on a language model.

The workload is :mod:`benchmarks.studies.workload`'s LM (a byte-level transformer on the
interpreter's stdlib sources, 8 replicas under ``jax.pmap``), trained long
enough that synchronous training's validation curve has flattened. Every
method wraps the same inner optimizer, AdamW with a linear warm-up and a
cosine decay to zero (:func:`benchmarks.studies.workload.adamw`; Muon, on the
same schedule, in the MuLoCo rows), and trains from the
same seeds on the same data stream (issue 24's list, issue 33's rows and
issue 43's DeMo rows, 37 methods, about 95 min for 2 seeds on the shared
2-core machine:
:func:`benchmarks.methods.quality_per_byte`): synchronous
``cross_shard(adamw)``, ``cross_shard_mean`` on an int8 wire with error
feedback and on a top-k wire, ``accumulate`` k = 4, ``powersgd`` rank 2 and
4 on a float32 and an int8 wire, ``local_sgd`` H = 2..64 (and H = 16 on an
int4 wire with error feedback), ``diloco`` (its default outer step) for
H = 16..128 with a float32 outer gradient and int4 with and without error
feedback, the paper's outer step at H = 16, SparseLoCo (a top-k outer
gradient, outer ``sgd(1)``), MuLoCo (Muon inside, with its own sync), a
synchronous warm start, streaming DiLoCo with F = 4 fragments and overlap,
hierarchical local SGD, and DeMo (``decoupled_momentum`` at the paper's
defaults, its own sign step instead of AdamW, at 1, 0.3 and 0.1 times the
schedule's learning rate).

Bytes: each method's training chunk is compiled once; its HLO is read by
:mod:`shardopt.measure.hlo` (the loop body is one step) and weighted by the
method's schedule (:func:`shardopt.measure.hlo.per_step`, asking the periodic
engine's schedule, warm-up steps included):
bytes one replica SENDS in a bandwidth-optimal algorithm (a ring all-reduce
of ``B`` bytes in groups of ``g`` sends ``2 (g - 1) / g * B``; the quantized
wire's all-to-all and all-gather ``(g - 1) / g`` each), summed over the run.
A "step" is one minibatch per replica for every method (for ``accumulate``,
one of its k micro-steps; its inner schedule spans its ``steps / k`` updates).

Quality: validation bits per byte every ``eval_every`` steps, mean ± std over
the seeds. Verdicts: a method *loses per step* when its final loss is above
sync's by more than the seeds' spread; it *wins per byte* when sync, to
reach the same validation loss, has to send more bytes than the method did
in its whole run (read off sync's validation curve, interpolated linearly
between evaluations). The *moonshot* (issue 24): a method within 1% of
sync's final validation loss with at least 100x fewer bytes.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # standalone: 8 CPU devices before jax is imported
  import sys

  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick=bool({"--quick", "--tiny"} & set(sys.argv[1:])))

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import RESULTS  # noqa: E402
from benchmarks import methods  # noqa: E402
from benchmarks.studies import harness  # noqa: E402
from benchmarks.studies import workload  # noqa: E402
from shardopt.measure import hlo  # noqa: E402

NAME = "quality_per_byte"
SYNC = "cross_shard(adamw) [sync]"
TITLE = (
  "8. Quality per byte: byte-level LM on the stdlib, val bits/byte vs bytes"
  " sent"
)
MOONSHOT_LOSS = 0.01  # within 1% of sync's final validation loss
MOONSHOT_BYTES = 100.0  # with at least 100x fewer bytes
FLAT = 0.2  # sync has flattened: its last 20% of steps ...
FLAT_GAIN = 0.02  # ... improve its validation loss by under 2%
PARTIAL_DIR = os.path.join(RESULTS, "tmp")


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


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


def flattening(steps: Sequence[int], curve: Sequence[float]) -> dict:
  """How much the last ``FLAT`` of the steps improved ``curve`` (relative),
  the value at ``(1 - FLAT) * steps`` interpolated between evaluations."""
  start = (1 - FLAT) * steps[-1]
  at = float(np.interp(start, steps, curve))
  gain = (at - curve[-1]) / at
  return {
    "from_step": start,
    "at_from": at,
    "final": float(curve[-1]),
    "relative_gain": gain,
    "flat": bool(gain < FLAT_GAIN),
  }


def measure(
  quick: bool,
  seeds: Sequence[int] | None = None,
  only: Sequence[str] | None = None,
  *,
  tiny: bool = False,
  mapping: str = "pmap",
  **overrides,
) -> dict:
  """Trains every available method on every seed; returns curves and bytes.

  ``overrides``: fields of :class:`benchmarks.studies.workload.Config` to change (a
  longer run: ``steps=2048``). ``tiny``: :data:`workload.TINY` and
  :func:`benchmarks.methods.frontier`'s handful of methods, one seed.
  ``mapping``: the replicas under ``"pmap"`` (one per device) or ``"vmap"``
  (stacked on one device; bytes from :func:`workload.update_bytes`, the
  per-replica update compiled under ``pmap`` on the CPU devices)."""
  base = workload.TINY if tiny else workload.QUICK if quick else workload.FULL
  config = dataclasses.replace(base, **overrides)
  seeds = tuple(seeds) if seeds is not None else harness.seeds(quick or tiny, 2)
  task = workload.Workload(config, mapping)
  params = workload.init_params(config, 0)
  param_bytes = workload.tree_bytes(params)
  n = task.replicas
  sent = functools.partial(hlo.sent_bytes, num_devices=n)
  out = {}
  start = time.perf_counter()
  listed = (
    methods.frontier()
    if tiny
    else methods.quality_per_byte(config.steps, quick)
  )
  for method in listed:
    if (quick and not tiny and not method.quick) or (
      only and method.label not in only
    ):
      continue
    updates = round(config.steps * method.updates_per_step)
    optimizer = workload.OPTIMIZERS[method.optimizer](config, updates)
    tx, why = methods.build(method, optimizer)
    entry = {
      "schedule": method.schedule.describe(),
      "family": method.family,
      "optimizer": method.optimizer,
      "available": tx is not None,
    }
    out[method.label] = entry
    if tx is None:
      entry["why"] = why
      print(f"[quality_per_byte] {method.label}: {why}", flush=True)
      continue
    t0, c0 = time.perf_counter(), _cpu_seconds()
    compiled, text = task.compile(tx)
    if mapping == "pmap":
      ops = hlo.compiled_collectives(text, num_devices=n)
      per_step = hlo.per_step(ops, method.schedule, measure=sent)
      entry.update(
        collectives=hlo.summarize(ops)["count"],
        mean_bytes_per_step=per_step["mean_bytes"],
        peak_bytes_per_step=per_step["peak_bytes"],
        warmup_bytes_per_step=per_step["warmup_bytes"],
        total_bytes=hlo.run_bytes(per_step, method.schedule, config.steps),
        bytes_warning=per_step["warning"],
        bytes_from="the training chunk's compiled HLO",
      )
    else:  # no collectives under vmap: the per-replica update's
      entry.update(
        workload.update_bytes(
          tx,
          params,
          method.schedule,
          config.steps,
          devices=jax.devices("cpu")[:n],
        )
      )
    entry.update(
      compile_seconds=time.perf_counter() - t0,
      compile_cpu_seconds=_cpu_seconds() - c0,
      runs=[],
    )
    for seed in seeds:
      c0 = _cpu_seconds()
      run = task.train(tx, seed, chunk=compiled)
      run["cpu_seconds"] = _cpu_seconds() - c0
      entry["runs"].append(run)
      print(
        f"[quality_per_byte] {method.label} seed {seed}:"
        f" val {run['val_bpb'][-1]:.4f} bits/byte in {run['seconds']:.1f} s"
        f" ({run['cpu_seconds']:.0f} s CPU); {entry['total_bytes'] / 1e6:,.2f}"
        f" MB sent; {time.perf_counter() - start:.0f} s into the section",
        flush=True,
      )
    val = np.asarray([r["val_bpb"] for r in entry["runs"]])
    entry.update(
      steps=entry["runs"][0]["steps"],
      val_mean=val.mean(0).tolist(),
      val_std=val.std(0).tolist(),
      finals=val[:, -1].tolist(),
      final_mean=float(val[:, -1].mean()),
      final_std=float(val[:, -1].std()),
      seconds_per_seed=float(np.mean([r["seconds"] for r in entry["runs"]])),
      cpu_seconds_per_seed=float(
        np.mean([r["cpu_seconds"] for r in entry["runs"]])
      ),
      divergence=max(r["divergence"] for r in entry["runs"]),
    )
    for r in entry["runs"]:
      del r["train_bpb"]  # per-step training loss: nothing reads it
    if not quick and not tiny:  # what is done so far, should it not finish
      os.makedirs(PARTIAL_DIR, exist_ok=True)
      with open(os.path.join(PARTIAL_DIR, f"{NAME}.partial.json"), "w") as f:
        json.dump(out, f, default=str)
  return {
    "config": dataclasses.asdict(config),
    "seeds": list(seeds),
    "params": workload.count_params(params),
    "param_bytes": param_bytes,
    "replicas": n,
    "mapping": mapping,
    "workload": task.info,
    "methods": out,
  }


def _ratio(sync_bytes: float, bytes_: float) -> str:
  """``"1/24"``: a method's bytes as a fraction of sync's."""
  if not bytes_:
    return "0"
  r = sync_bytes / bytes_
  if abs(r - 1) < 0.005:
    return "1"
  return f"1/{r:,.3g}" if r > 1 else f"{1 / r:.3g}x"


def _verdicts(data: dict) -> tuple[dict, list[str]]:
  """Per-method comparison with sync."""
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
    # sync sends the same bytes every step
    sync_bytes = None if reach is None else reach * sync["mean_bytes_per_step"]
    ratio = None
    if reach is None:
      wins = "yes"
    else:  # within 5% of the same bytes is a tie
      ratio = (
        sync_bytes / e["total_bytes"] if e["total_bytes"] else float("inf")
      )
      wins = "yes" if ratio > 1.05 else "no" if ratio < 1 / 1.05 else "tie"
    verdicts[label] = {
      "delta_vs_sync": delta,
      "relative_delta_vs_sync": delta / sync["final_mean"],
      "bytes_ratio_to_sync": e["total_bytes"] / sync["total_bytes"],
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
        f" {e['total_bytes'] / 1e6:,.2f} MB in {total_steps} steps"
        f" ({ratio:,.1f}x): "
        + {
          "yes": "wins per byte",
          "no": "LOSES per byte",
          "tie": "a tie per byte",
        }[wins]
      )
    notes.append(
      f"**{label}**: {e['final_mean']:.3f} vs sync {sync['final_mean']:.3f}"
      f" ({delta:+.3f} bits/byte, {100 * delta / sync['final_mean']:+.1f}%): "
      + ("LOSES per step" if loses else "does not lose per step")
      + f"; {per_byte}."
    )
  return verdicts, notes


def frontier(data: dict) -> list[str]:
  """Labels on the Pareto frontier: no other method has both fewer bytes
  and a lower mean final loss. Ordered by bytes."""
  rows = sorted(
    (
      (e["total_bytes"], e["final_mean"], label)
      for label, e in data["methods"].items()
      if e["available"]
    ),
  )
  best, out = float("inf"), []
  for _, loss, label in rows:
    if loss < best:
      out.append(label)
      best = loss
  return out


def moonshot(data: dict) -> dict:
  """Issue 24's moonshot, and the best points toward it, against the best
  synchronous run of any optimizer in the study (issue 43: today Muon's,
  not AdamW's; a verdict against AdamW's alone would be met by switching
  optimizers).

  ``reference``: that run's label. ``reached``: the methods within
  ``MOONSHOT_LOSS`` (relative) of its final loss with at least
  ``MOONSHOT_BYTES`` x fewer bytes. ``fewest_bytes_within_loss``: among the
  methods within 1% of its loss, the one with the fewest bytes.
  ``best_loss_within_bytes``: among those with at least 100x fewer bytes,
  the one with the lowest loss.
  """
  m = data["methods"]
  syncs = [
    label
    for label, e in m.items()
    if label.endswith("[sync]") and e["available"]
  ]
  reference = min(syncs, key=lambda label: m[label]["final_mean"])
  sync = m[reference]
  target = sync["final_mean"] * (1 + MOONSHOT_LOSS)
  budget = sync["total_bytes"] / MOONSHOT_BYTES
  rows = [(label, e) for label, e in m.items() if e["available"]]
  close = [(label, e) for label, e in rows if e["final_mean"] <= target]
  cheap = [(label, e) for label, e in rows if e["total_bytes"] <= budget]
  reached = [label for label, e in close if e["total_bytes"] <= budget]

  def point(item):
    if item is None:
      return None
    label, e = item
    return {
      "label": label,
      "final_mean": e["final_mean"],
      "final_std": e["final_std"],
      "relative_delta": e["final_mean"] / sync["final_mean"] - 1,
      "total_bytes": e["total_bytes"],
      "bytes_reduction": sync["total_bytes"] / max(e["total_bytes"], 1e-9),
    }

  return {
    "reference": reference,
    "reference_loss": sync["final_mean"],
    "target_loss": target,
    "byte_budget": budget,
    "reached": reached,
    "fewest_bytes_within_loss": point(
      min(close, key=lambda r: r[1]["total_bytes"]) if close else None
    ),
    "best_loss_within_bytes": point(
      min(cheap, key=lambda r: r[1]["final_mean"]) if cheap else None
    ),
  }


def _period(label: str) -> int | None:
  found = re.search(r"\bH=(\d+)", label)
  return int(found.group(1)) if found else None


def _grid_notes(data: dict) -> list[str]:
  """DiLoCo by H for each outer wire, and by wire at an H that has several."""
  m, notes = data["methods"], []
  sync = m.get(SYNC)
  if not sync or not sync["available"]:
    return notes

  def cell(label):
    e = m.get(label)
    if not e or not e["available"]:
      return None
    d = 100 * (e["final_mean"] / sync["final_mean"] - 1)
    return (
      f"{e['final_mean']:.3f} ({d:+.1f}%,"
      f" 1/{sync['total_bytes'] / e['total_bytes']:,.0f} of sync's bytes)"
    )

  periods = sorted(
    {_period(label) for label in m if label.startswith("diloco(")} - {None}
  )
  wires = (
    (None, False),
    ("int8", False),
    ("float8_e4m3fn", False),
    ("int4", False),
    ("int4", True),
  )
  for wire, ef in wires:
    cells = [
      f"H={h} {c}"
      for h in periods
      if (
        c := cell(methods.diloco(h, comm_dtype=wire, error_feedback=ef).label)
      )
    ]
    if len(cells) > 1:
      name = methods.wire_name(wire, ef) or "float32"
      notes.append(f"DiLoCo by H, {name} outer gradient: " + "; ".join(cells))
  muon = m.get(methods.sync("muon").label)
  if muon and muon["available"]:
    cells = [
      f"{label} {e['final_mean']:.3f}"
      f" ({100 * (e['final_mean'] / muon['final_mean'] - 1):+.1f}% vs Muon's"
      f" sync, {100 * (e['final_mean'] / sync['final_mean'] - 1):+.1f}% vs"
      " AdamW's)"
      for label, e in m.items()
      if e.get("optimizer") == "muon" and e["available"] and e is not muon
    ]
    notes.append(
      f"MuLoCo (Muon inside): Muon's own sync {muon['final_mean']:.3f}"
      f" ({100 * (muon['final_mean'] / sync['final_mean'] - 1):+.1f}% vs"
      " AdamW's sync); " + "; ".join(cells)
    )
  for h in periods:
    cells = [
      f"{methods.wire_name(wire, ef) or 'float32'} {c}"
      for wire, ef in wires
      if (
        c := cell(methods.diloco(h, comm_dtype=wire, error_feedback=ef).label)
      )
    ]
    if len(cells) > 3:
      notes.append(f"DiLoCo H={h} by outer wire: " + "; ".join(cells))
  return notes


def run(
  quick: bool,
  seeds: Sequence[int] | None = None,
  only: Sequence[str] | None = None,
  **options,
) -> dict:
  """Runs :func:`measure` and formats the section (table, notes, data)."""
  start = time.perf_counter()
  data = measure(quick, seeds, only, **options)
  return report(data, time.perf_counter() - start)


def report(data: dict, seconds_in_all: float) -> dict:
  """The section (table, notes, data) from :func:`measure`'s ``data``; also
  rebuilds a section from a saved one's ``data`` (``--report FILE``)."""
  verdicts, verdict_notes = _verdicts(data)
  data["verdicts"] = verdicts
  m = data["methods"]
  sync = m.get(SYNC) if m.get(SYNC, {}).get("available") else None
  rows, missing = [], []
  for label, e in m.items():
    if not e["available"]:
      missing.append(label)
      rows.append([label, e["schedule"]] + ["not available"] + ["-"] * 6)
      continue
    v = verdicts.get(label, {})
    if label == SYNC:
      reach = "-"
    elif v.get("sync_bytes_to_same_loss") is None:
      reach = "never"
    else:
      reach = f"{v['sync_bytes_to_same_loss'] / 1e6:,.1f}"
    rows.append(
      [
        label,
        e["schedule"],
        f"{e['total_bytes'] / 1e6:,.2f}",
        _ratio(sync["total_bytes"], e["total_bytes"]) if sync else "-",
        f"{e['peak_bytes_per_step'] / 1e3:,.1f}",
        f"{e['final_mean']:.3f} ± {e['final_std']:.3f}",
        "-"
        if label == SYNC or not sync
        else f"{v['delta_vs_sync']:+.3f} ({100 * v['relative_delta_vs_sync']:+.1f}%)",
        reach,
        "-" if label == SYNC else v.get("wins_per_byte", "-"),
      ]
    )
  c = data["config"]
  w = data["workload"]
  seconds = [
    e["seconds_per_seed"] for e in m.values() if e.get("seconds_per_seed")
  ]
  compile_seconds = sum(e.get("compile_seconds", 0) for e in m.values())
  notes = [
    f"Byte-level transformer ({c['depth']} blocks, width {c['width']},"
    f" {c['heads']} heads, context {c['context']}; {data['params']:,} params,"
    f" {data['param_bytes']:,} bytes float32), {data['replicas']} replicas"
    f" under {data.get('mapping', 'pmap')}, {c['batch_per_replica']}"
    f" windows of {c['context']} bytes per replica per step, {c['steps']}"
    " steps; inside every method AdamW"
    f" (or Muon where the label says so: consistent RMS 0.2, the same"
    f" schedule; weight decay {c['weight_decay']}), learning rate warmed up linearly"
    f" from 0 to {c['learning_rate']} over {c['warmup_fraction']:.0%} of its"
    f" updates, then cosine decay to {c['learning_rate'] * c['end_fraction']:g} at the last"
    " (optax.warmup_cosine_decay_schedule); DiLoCo's outer step unless its"
    f" label says otherwise: shardopt's default, {harness.default_outer()}. Mean"
    f" ± std over {len(data['seeds'])} seed(s) {data['seeds']}.",
    f"Text: {w['train_files']} train / {w['validation_files']} validation"
    f" files of {w['stdlib']}/*.py (split by CRC-32 of the file name),"
    f" {w['train_bytes']:,} / {w['validation_bytes']:,} bytes; validation ="
    f" {w['validation_windows'][0]} windows evenly spread, every"
    f" {c['eval_every']} steps, of the replica-averaged params (host-side,"
    " for evaluation only).",
    "Bytes: what one replica sends over the run, from the compiled step's"
    " collectives (top level every step, each conditional branch on the"
    " steps its schedule takes it, a warm-up's all-reduce on its steps): a"
    " ring all-reduce of B bytes in groups of g sends 2 (g - 1) / g x B, an"
    " all-to-all or all-gather (g - 1) / g x B. 'sync's MB to same loss' ="
    " sync's bytes up to the step where its validation curve (interpolated"
    " between evaluations) reaches the method's final loss; 'wins per"
    " byte' = that is more than the method's whole run (within 5%: a tie).",
  ]
  if data.get("mapping") == "vmap":
    notes.append(
      "Replicas under vmap on one device: no collectives to read there; the"
      " bytes are those of each method's per-replica update compiled (not"
      " run) under pmap on the CPU devices (workload.update_bytes)."
    )
  if sync:
    flat = flattening(sync["steps"], sync["val_mean"])
    data["sync_flattening"] = flat
    notes.append(
      f"Sync's validation curve over the last {FLAT:.0%} of the steps (step"
      f" {flat['from_step']:.0f} -> {c['steps']}): {flat['at_from']:.4f} ->"
      f" {flat['final']:.4f} bits/byte, {100 * flat['relative_gain']:.2f}%"
      f" better: {'flattened' if flat['flat'] else 'NOT flattened'} (goal"
      f" under {FLAT_GAIN:.0%})."
    )
    shot = moonshot(data)
    data["moonshot"] = shot
    data["frontier"] = frontier(data)

    def describe(p):
      return (
        f"{p['label']} {p['final_mean']:.3f} ± {p['final_std']:.3f}"
        f" ({100 * p['relative_delta']:+.1f}% vs {shot['reference']}) with"
        f" {p['total_bytes'] / 1e6:,.2f} MB ({p['bytes_reduction']:,.0f}x"
        " fewer bytes)"
      )

    best_close = shot["fewest_bytes_within_loss"]
    best_cheap = shot["best_loss_within_bytes"]
    notes.append(
      f"**Moonshot** (within {MOONSHOT_LOSS:.0%} of the best synchronous"
      f" run, {shot['reference']}'s final {shot['reference_loss']:.3f}, i.e."
      f" <= {shot['target_loss']:.3f}, with"
      f" >= {MOONSHOT_BYTES:.0f}x fewer bytes, i.e. <="
      f" {shot['byte_budget'] / 1e6:,.2f} MB): "
      + (
        "REACHED by " + ", ".join(shot["reached"])
        if shot["reached"]
        else "NOT reached"
      )
      + ". Fewest bytes within 1%: "
      + (describe(best_close) if best_close else "none but sync")
      + ". Best loss with >= 100x fewer bytes: "
      + (describe(best_cheap) if best_cheap else "no method is that cheap")
      + "."
    )
    notes.append(
      "Pareto frontier (fewer bytes and lower loss than every point to its"
      " right): "
      + " -> ".join(
        f"{label} ({m[label]['total_bytes'] / 1e6:,.2f} MB,"
        f" {m[label]['final_mean']:.3f})"
        for label in data["frontier"]
      )
      + "."
    )
  notes += _grid_notes(data)
  notes += verdict_notes
  notes += data.get("added", [])  # rows run later (--add-to)
  warnings = [
    f"{label}: {e['bytes_warning']}"
    for label, e in m.items()
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
  runs = sum(len(e.get("runs", [])) for e in m.values())
  notes.append(
    f"Time: {runs} runs, {np.mean(seconds) if seconds else 0:.0f} s each on"
    f" average (min {min(seconds, default=0):.0f}, max"
    f" {max(seconds, default=0):.0f}), {compile_seconds:.0f} s compiling;"
    f" {seconds_in_all:.0f} s in all."
  )
  return {
    "title": TITLE,
    "table": {
      "columns": [
        "method",
        "communicates",
        "MB sent per replica",
        "bytes vs sync",
        "peak kB/step",
        "final val bits/byte",
        "Δ vs sync",
        "sync's MB to same loss",
        "wins per byte",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": data,
  }


FAMILY_COLORS = {
  "sync": "black",
  "accumulate": "tab:gray",
  "powersgd": "tab:purple",
  "local_sgd": "tab:olive",
  "diloco": "tab:blue",
  "streaming": "tab:cyan",
  "hierarchical": "tab:brown",
  "topk": "magenta",
  "muon": "darkorange",
}


# A label's variant -> its marker, the first match wins.
MARKERS = (
  ("topk", "v"),
  ("int4+EF", "P"),
  ("int4", "X"),
  ("int8+EF", "D"),
  ("int8", "s"),
  ("float8", "^"),
  ("warm-up", "*"),
)


def _style(label: str, e: dict, index: int) -> dict:
  """Color by family, marker by variant (wire, warm-up)."""
  family = e.get("family", "")
  color = FAMILY_COLORS.get(family, f"C{index % 10}")
  if family == "diloco":
    color = {
      16: "tab:blue",
      32: "navy",
      64: "tab:green",
      128: "tab:red",
    }.get(_period(label), "tab:blue")
  elif family == "local_sgd":
    color = {
      2: "yellowgreen",
      4: "olivedrab",
      8: "darkkhaki",
      16: "tab:olive",
      64: "darkolivegreen",
    }.get(_period(label), "tab:olive")
  elif family == "powersgd":
    color = "tab:pink" if "rank=2" in label else "tab:purple"
  marker = next((m for part, m in MARKERS if part in label), None)
  if marker is None:
    marker = "h" if family == "muon" else "o"
  return {"color": color, "marker": marker}


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``quality_per_byte.png``: the frontier (final loss vs bytes, log
  x) and the validation curves vs step."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  data = result["data"]
  entries = {k: e for k, e in data["methods"].items() if e["available"]}
  fig, (left, right) = plt.subplots(
    1, 2, figsize=(16, 10), gridspec_kw={"width_ratios": [1.3, 1]}
  )
  sync = entries.get(SYNC)
  for i, (label, e) in enumerate(entries.items()):
    style = _style(label, e, i)
    x = e["total_bytes"] / 1e6
    left.errorbar(
      x,
      e["final_mean"],
      yerr=e["final_std"],
      fmt=style["marker"],
      color=style["color"],
      markersize=8 if style["marker"] == "*" else 6,
      capsize=3,
      label=label,
    )
    left.scatter(
      [x] * len(e["finals"]),
      e["finals"],
      s=6,
      color=style["color"],
      alpha=0.5,
    )
    mean = np.asarray(e["val_mean"])
    right.plot(
      e["steps"],
      mean,
      color=style["color"],
      lw=2.0 if label == SYNC else 0.9,
      ls="-" if style["marker"] in "o*h" else "--",
    )
  front = data.get("frontier", [])
  if front:
    left.step(
      [entries[k]["total_bytes"] / 1e6 for k in front],
      [entries[k]["final_mean"] for k in front],
      where="post",
      color="0.5",
      lw=0.8,
      ls=":",
      zorder=0,
    )
  if sync:
    # sync's own curve against the bytes it had sent by each evaluation: a
    # point below it beats sync at equal bytes
    sent = np.asarray(sync["steps"][1:]) * sync["mean_bytes_per_step"] / 1e6
    left.plot(
      sent,
      sync["val_mean"][1:],
      color="black",
      lw=0.8,
      alpha=0.6,
      label="sync's validation curve vs bytes sent so far",
    )
    shot = moonshot(data)
    target = shot["target_loss"]
    budget = shot["byte_budget"] / 1e6
    left.axhline(target, color="black", lw=0.6, ls="--")
    left.axvline(budget, color="black", lw=0.6, ls="--")
    left.annotate(
      "moonshot box (lower left of the dashed lines): within 1% of the\n"
      f"best synchronous run's loss ({shot['reference']}), >= 100x fewer"
      " bytes",
      (budget, target),
      xytext=(-6, 6),
      textcoords="offset points",
      ha="right",
      fontsize=7,
    )
    finals = [e["final_mean"] for e in entries.values()]
    left.set_ylim(min(finals) - 0.08, max(finals) + 0.08)
    right.set_ylim(min(finals) - 0.05, max(finals) + 0.15)
  left.set(
    xscale="log",
    xlabel="MB sent per replica over the run (log)",
    ylabel="final validation bits per byte",
    title="Quality per byte: mean ± std over seeds, dots = seeds",
  )
  right.set(
    xlabel="training steps",
    ylabel="validation bits per byte (mean over seeds)",
    title="Validation loss vs step (dashed: a narrow wire)",
  )
  for ax in (left, right):
    ax.grid(alpha=0.3, which="both")
  handles, labels = left.get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7.5)
  rows = -(-len(labels) // 3)
  fig.tight_layout(rect=(0, 0.02 + 0.0165 * rows, 1, 1))
  path = os.path.join(directory, "quality_per_byte.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]


def calibrate(config: workload.Config, seed: int = 0) -> dict:
  """Trains the LM's synchronous baseline alone and prints its validation
  curve and how much its last :data:`FLAT` of the steps improved it (how
  :data:`workload.FULL` was chosen: long enough for sync to flatten)."""
  import shardopt

  task = workload.Workload(config)
  params = workload.init_params(config, 0)
  print(
    f"[{NAME}] {task.info}; params {workload.count_params(params):,}"
    f" ({workload.tree_bytes(params):,} bytes); {config}"
  )
  tx = shardopt.cross_shard(workload.adamw(config)(), workload.AXIS)
  t0 = time.perf_counter()
  result = task.train(tx, seed, chunk=workload.train_chunk(tx, config))
  print(
    f"[{NAME}] sync: {time.perf_counter() - t0:.1f} s in all,"
    f" {result['seconds']:.1f} s after the first call"
  )
  for s, v in zip(result["steps"], result["val_bpb"], strict=True):
    print(f"  step {s:5d}  val {v:.3f} bits/byte")
  flat = flattening(result["steps"], result["val_bpb"])
  print(
    f"[{NAME}] the last {FLAT:.0%} of the steps ({flat['from_step']:.0f} ->"
    f" {config.steps}): {flat['at_from']:.4f} -> {flat['final']:.4f}"
    f" bits/byte, {100 * flat['relative_gain']:.2f}% better"
  )
  return flat


def summarize(data: dict) -> dict:
  """``--json``'s content: per method its final validation bits per byte
  (mean over the seeds) and the bytes one replica sent over the run."""
  return {
    "config": data["config"],
    "replicas": data["replicas"],
    "mapping": data.get("mapping", "pmap"),
    "seeds": data["seeds"],
    "params": data["params"],
    "methods": {
      label: {
        "val_bits_per_byte": e["final_mean"],
        "bytes_per_replica": e["total_bytes"],
      }
      if e["available"]
      else {"why": e.get("why", "not available")}
      for label, e in data["methods"].items()
    },
  }


def main(argv=None) -> int:
  """``python -m benchmarks.studies.quality_per_byte [--quick | --tiny]
  [--replicas {pmap,vmap}] [--seeds N] [--only LABEL] [--steps N] [--out
  DIR] [--json PATH]``, or ``--calibrate [--steps N]
  [--seed S] [--set FIELD=VALUE]``: the sync baseline alone, or ``--report
  FILE [--out DIR]``: the table, notes and plot again from a saved run
  (``benchmarks/results/latest.json`` or a section's JSON), training
  nothing. ``--only LABEL ... --add-to benchmarks/results/latest.json``:
  those rows run and join the committed report."""
  import argparse

  argv = list(argv) if argv is not None else sys.argv[1:]
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument(
    "--tiny",
    action="store_true",
    help="a tiny LM, 64 steps, one seed and a handful of methods"
    " (benchmarks.methods.frontier): a couple of minutes on a CPU",
  )
  parser.add_argument(
    "--replicas",
    choices=workload.MAPPINGS,
    default="pmap",
    help="the replicas under jax.pmap, one per device (default), or"
    " stacked on one device under jax.vmap (8 of them)",
  )
  parser.add_argument(
    "--json",
    default=None,
    metavar="PATH",
    help="write each method's final val bits/byte and bytes per replica"
    ' here ({"methods": {label: {"val_bits_per_byte", "bytes_per_replica"}}})',
  )
  parser.add_argument(
    "--seeds",
    type=int,
    default=None,
    help="number of seeds (default 2, quick 1)",
  )
  parser.add_argument(
    "--only", action="append", default=None, help="a method label (repeatable)"
  )
  parser.add_argument("--out", default=None, help="write the section JSON here")
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="steps per run (default: the workload's FULL or QUICK config)",
  )
  parser.add_argument(
    "--calibrate",
    action="store_true",
    help="train the sync baseline alone and print its curve and its last"
    f" {FLAT:.0%}".replace("%", "%%"),  # argparse formats help with %
  )
  parser.add_argument(
    "--report",
    default=None,
    metavar="FILE",
    help="rebuild the section from a saved run's data (latest.json or a"
    " section JSON) without training",
  )
  parser.add_argument(
    "--add-to",
    default=None,
    metavar="LATEST_JSON",
    help="run the --only methods, add them to that report's section (the"
    " same configuration and seeds) and rewrite the report: the JSON, its"
    " latest.md, benchmarks/README.md's results block, the plot",
  )
  parser.add_argument(
    "--merge",
    action="append",
    default=None,
    metavar="SECTION_JSON",
    help="with --add-to: add the rows of a section saved by --out (its"
    " quality_per_byte.json; repeatable) to that report without training;"
    " rows the report has already (the section's own sync) are left as the"
    " report has them",
  )
  parser.add_argument(
    "--seed", type=int, default=0, help="--calibrate's seed (default 0)"
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="change a workload.Config field (repeatable): --set end_fraction=0.1",
  )
  args = parser.parse_args(argv)
  overrides = {} if args.steps is None else {"steps": args.steps}
  base = (
    workload.TINY
    if args.tiny
    else workload.QUICK
    if args.quick
    else workload.FULL
  )
  for item in args.set:
    field, _, value = item.partition("=")
    if field not in workload.Config.__dataclass_fields__:
      parser.error(f"--set {item}: workload.Config has no field {field!r}")
    overrides[field] = type(getattr(base, field))(value)
  if args.calibrate:
    calibrate(dataclasses.replace(base, **overrides), args.seed)
    return 0
  seeds = None if args.seeds is None else range(args.seeds)
  start = time.perf_counter()
  if args.merge:
    if not args.add_to:
      parser.error("--merge adds saved rows to a report: name it with --add-to")
    section = merge_rows(args.merge, args.add_to, argv)
  elif args.report:
    with open(args.report) as f:
      saved = json.load(f)
    saved = saved.get("sections", {}).get(NAME, saved)
    section = report(saved["data"], saved.get("seconds", 0.0))
  else:
    section = run(
      args.quick,
      seeds,
      args.only,
      tiny=args.tiny,
      mapping=args.replicas,
      **overrides,
    )
    if args.add_to:
      if not args.only:
        parser.error("--add-to runs the --only methods: name them")
      section = add_rows(
        section, args.add_to, argv, time.perf_counter() - start
      )
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
  if args.json:
    summary = summarize(section["data"])
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=1)
  return 0


def _committed(path: str) -> str:
  """The commit (short hash) and date that last changed ``path`` in git,
  else that it is not committed."""
  import subprocess  # noqa: PLC0415

  done = subprocess.run(
    ["git", "log", "-1", "--format=%h %cI", "--", path],
    capture_output=True,
    text=True,
    check=False,
  )
  return done.stdout.strip() or "not committed"


def merge_rows(sections: Sequence[str], path: str, argv) -> dict:
  """The rows of sections saved by ``--out`` (each a ``quality_per_byte.json``)
  added to the report in ``path`` as :func:`add_rows` adds a fresh run's,
  without training: rows the report has already are kept as it has them.
  The provenance note names each file and the commit that added it."""
  with open(path) as f:
    have = set(json.load(f)["sections"][NAME]["data"]["methods"])
  merged = None
  origins = []
  for saved_path in sections:
    with open(saved_path) as f:
      saved = json.load(f)
    saved = saved.get("sections", {}).get(NAME, saved)
    data = dict(saved["data"])
    data["methods"] = {
      k: v for k, v in data["methods"].items() if k not in have
    }
    if merged is None:
      merged = data
    else:
      for key in ("config", "seeds", "replicas"):
        if merged.get(key) != data.get(key):
          raise SystemExit(
            f"--merge {saved_path}: its {key} differs from"
            f" {sections[0]}'s; rows of other runs would not compare."
          )
      merged["methods"] = {**merged["methods"], **data["methods"]}
    origins.append(f"{saved_path} (committed {_committed(saved_path)})")
  if not merged or not merged["methods"]:
    raise SystemExit(f"--merge: no rows that {path} does not have already")
  note = "from " + "; ".join(origins)
  return add_rows({"data": merged}, path, argv, 0.0, origin=note)


def add_rows(
  new: dict, path: str, argv, seconds: float = 0.0, origin: str = ""
) -> dict:
  """``new``'s methods added to the section saved in ``path`` (a report's
  JSON, e.g. ``benchmarks/results/latest.json``), which is rebuilt and
  written back with its ``latest.md``, ``benchmarks/README.md``'s results
  block (for the committed report) and the plot. Refuses a section run with
  another configuration or other seeds: its rows would not compare."""
  from benchmarks import _report  # noqa: PLC0415 (only this path writes it)

  with open(path) as f:
    results = json.load(f)
  old = results["sections"][NAME]
  for key in ("config", "seeds", "replicas"):
    if old["data"].get(key) != new["data"].get(key):
      raise SystemExit(
        f"--add-to {path}: its {key} is {old['data'].get(key)!r}, this run's"
        f" {new['data'].get(key)!r}; rows of other runs would not compare."
      )
  data = dict(old["data"])
  data["methods"] = {**old["data"]["methods"], **new["data"]["methods"]}
  seconds += old.get("seconds", 0.0)
  added = ", ".join(new["data"]["methods"])
  machine = _report.machine()
  data["added"] = list(old["data"].get("added", [])) + [
    f"Rows added {machine['date_utc']} at commit {machine['git_commit']} by"
    f" `python -m benchmarks.studies.quality_per_byte {' '.join(argv or [])}`"
    f"{' ' + origin if origin else ''}"
    f" ({len(new['data']['methods'])} rows): {added}."
  ]
  section = report(data, seconds)
  section["ran_on"] = old.get("ran_on", {})
  out = os.path.dirname(os.path.abspath(path))
  section["plots"] = [os.path.relpath(p, out) for p in plot(section, out)]
  section["seconds"] = seconds
  results["sections"][NAME] = section
  with open(path, "w") as f:
    json.dump(results, f, indent=1, default=str)
  with open(os.path.join(out, "latest.md"), "w") as f:
    f.write(_report.markdown(results))
  if os.path.normpath(out) == os.path.normpath(RESULTS):
    _report.update_readme(results)
  return section


if __name__ == "__main__":
  raise SystemExit(main())
