"""The accelerator tables (README.md, benchmarks/README.md), from the files
:mod:`benchmarks.accelerator` writes (its run on an H100, and its
``frontier`` section).

:data:`BLOCKS` registers them with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import fraction
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance
from benchmarks.studies.quality_per_byte_blocks import LM_ROWS
from benchmarks.studies.quality_per_byte_blocks import LM_SYNC
from benchmarks.studies.quality_per_byte_blocks import frontier_table

ACCELERATOR = "benchmarks/results/accelerator_h100.json"
ACCELERATOR_FRONTIER = "benchmarks/results/accelerator_h100_frontier.json"


def _device(d: dict) -> str:
  """The device a results file names: its runtime's words (device kind,
  platform version, NVIDIA driver) where the run wrote them."""
  if d.get("device"):  # the 2026-11-27 files, written before provenance()
    return d["device"]
  if "device_kind" not in d:
    return d["sections"]["backend"]["device_kind"]
  driver = d.get("driver") or {}
  words = [f"{d['device_kind']} ({d['platform']}"]
  if driver.get("platform_version"):
    words.append(f", runtime {driver['platform_version']}")
  if driver.get("nvidia_driver"):
    words.append(f", {driver['nvidia_driver']}")
  return "".join(words) + f", JAX {d['jax']})"


def render_accelerator_frontier(data: Sequence[dict]) -> str:
  """The section 8 LM on one GPU, 8 vmap replicas (``frontier`` section)."""
  (d,) = data
  f = d["sections"]["frontier"]
  rows_in = f["rows"]
  sync = rows_in[LM_SYNC]
  rows = []
  for label, r in rows_in.items():
    if "val_bits_per_byte" not in r:
      continue
    bits, sent = r["val_bits_per_byte"], r["bytes_per_replica"]
    rows.append(
      [
        LM_ROWS.get(label, f"`{label}`"),
        f"{sent / 1e6:,.1f}",
        fraction(sync["bytes_per_replica"] / sent),
        f"{bits:.3f}",
        "-"
        if label == LM_SYNC
        else f"{bits / sync['val_bits_per_byte'] - 1:+.1%}",
      ]
    )
  config = f["config"]
  skipped = f.get("skipped", [])
  return (
    top_provenance(d, ACCELERATOR_FRONTIER, f"; {_device(d)}")
    + "\n\n"
    + frontier_table(rows)
    + "\n\n"
    + f"{f['params']:,} params, {f['replicas']} replicas under `jax.vmap`"
    f" on the one device, {config['steps']} steps of"
    f" {config['batch_per_replica']} x {config['context']} bytes per"
    f" replica, one seed; each method's training took"
    f" {min(r['train_seconds'] for r in rows_in.values() if 'train_seconds' in r):.0f}-"
    f"{max(r['train_seconds'] for r in rows_in.values() if 'train_seconds' in r):.0f} s"
    f" and its compiles"
    f" {min(r['compile_seconds'] for r in rows_in.values() if 'compile_seconds' in r):.0f}-"
    f"{max(r['compile_seconds'] for r in rows_in.values() if 'compile_seconds' in r):.0f} s."
    + (
      f" Not run (the section's time ran out): {', '.join(f'`{k}`' for k in skipped)}."
      if skipped
      else ""
    )
  )


def _first_line(text: str) -> str:
  """An error's first line, without JAX's invitation to file a request."""
  line = text.strip().splitlines()[0]
  return line.replace(" Please open a feature request!", "")


def _table_with_notes(columns, rows, align) -> str:
  """:func:`table` whose last column (notes) goes where no row has one."""
  if any(row[-1] for row in rows):
    return table(columns, rows, align)
  return table(columns[:-1], [row[:-1] for row in rows], align[:-1])


def _measured_rows(rows: dict, key: str, cells, width: int, why) -> list:
  """Table rows ``name, *cells(r), ""`` (``width`` cells) for the rows that
  hold ``key``; dashes and ``why(r)`` for the others (failed, skipped,
  unsupported)."""
  return [
    [f"`{k}`"] + (cells(r) + [""] if key in r else ["-"] * width + [why(r)])
    for k, r in rows.items()
  ]


def render_accelerator(data: Sequence[dict]) -> str:
  """The accelerator command's transforms, wires and overhead sections."""
  (d,) = data
  sec = d["sections"]
  t = sec["transforms"]
  transforms = _measured_rows(
    t["rows"],
    "max_abs_diff",
    lambda r: [
      f"{r['max_abs_diff']:.2e}",
      f"{r['moved']:.3g}",
      f"{r['replica_spread']:.2e}",
    ],
    3,
    lambda r: _first_line(r.get("error") or r["unsupported"]),
  )
  w = sec["wires"]
  wires = _measured_rows(
    w["rows"],
    "gbps",
    lambda r: [
      f"{r['gbps']:,.0f}",
      f"{r['ratio_to_copy']:.2f}",
      f"{r['share_of_step']:.1%}",
    ],
    3,
    lambda r: r.get("error") or r.get("skipped", ""),
  )
  o = sec["overhead"]
  overhead = [
    [f"`{k}`", f"{r['seconds'] * 1e3:.3f}", f"{r['ratio']:.2f}"]
    + _overhead_bytes(r, "bytes_accessed" in r)
    for k, r in o["rows"].items()
    if "ratio" in r
  ]
  both = any("bytes_accessed" in r for r in o["rows"].values())
  m = w["model_step"]
  return (
    top_provenance(
      d,
      ACCELERATOR,
      f"; {_device(d)}; {d['seconds']:.0f} s in all",
    )
    + "\n\n"
    + f"**Transforms**: {t['steps']} steps of {t['replicas']} replicas under"
    f" `jax.vmap` on the GPU against the same run on the machine's CPU"
    f" backend (matmuls at `{t['matmul_precision']}` precision); moved: the"
    f" largest change of a param; spread: the largest difference between"
    f" replicas (0 for a reduced step, nonzero for a local method's replicas"
    f" between syncs)."
    + "\n\n"
    + _table_with_notes(
      ["transform", "max abs diff vs CPU", "moved", "replica spread", ""],
      transforms,
      "lrrrl",
    )
    + "\n\n"
    + f"**Wires**: `cross_shard_mean`'s encode + mean + decode over the vmapped"
    f" axis of {w['replicas']}, {w['floats_per_replica']:,} float32 per replica;"
    f" GB/s of float32 input, against the device's copy (`x + 1`:"
    f" {w['copy_gbps']:,.0f} GB/s in the same unit); the share of a step is one"
    f" replica's wire against the forward and backward pass of the LM at"
    f" {m['params']:,} params ({m['batch']} x {m['context']} bytes,"
    f" {m['seconds'] * 1e3:.2f} ms)."
    + "\n\n"
    + _table_with_notes(
      ["wire", "GB/s", "/ copy", "share of a step", ""], wires, "lrrrl"
    )
    + "\n\n"
    + f"**Overhead**: a step that syncs nothing against plain `optax.adam`,"
    f" {o['replicas']} vmap replicas of {o['params_per_replica']:,} params,"
    f" donated, interleaved medians."
    + (
      " Each schedule both ways: host-scheduled (`sync=0`, the program"
      " `shardopt.due` picks; goal: at most"
      f" {o['goal']}x its floor, Adam or for `agn` Adam plus an accumulator"
      " add) and in-graph (the schedule's `lax.cond` in the step); XLA's"
      " bytes accessed and the bytes of `copy` instructions of each"
      " compiled step (in branches: on the steps that take them)."
      if both
      else ""
    )
    + "\n\n"
    + (
      table(
        ["step", "ms", "/ optax adam", "/ floor", "MB accessed", "MB copied"],
        overhead,
        "lrrrrr",
      )
      if both
      else table(["step", "ms", "/ optax adam"], overhead, "lrr")
    )
  )


def _overhead_bytes(row: dict, measured: bool) -> list:
  """The accelerator overhead row's floor ratio and bytes (files since
  issue 54), or nothing (the 2026-11-27 file)."""
  if not measured:
    return []
  branches = sum((row.get("copied_bytes_in_branches") or {}).values())
  return [
    f"{row['ratio_to_floor']:.2f}" if "ratio_to_floor" in row else "-",
    f"{row['bytes_accessed'] / 1e6:,.1f}",
    f"{row['copied_bytes'] / 1e6:,.1f}"
    + (f" + {branches / 1e6:,.1f} in branches" if branches else ""),
  ]


BLOCKS = (
  Block(
    "accelerator",
    (ACCELERATOR,),
    render_accelerator,
    ("benchmarks/README.md",),
  ),
  Block(
    "accelerator-frontier",
    (ACCELERATOR_FRONTIER,),
    render_accelerator_frontier,
    ("README.md", "benchmarks/README.md"),
  ),
)
