"""The generated block of :mod:`benchmarks.perf.step_bytes` (issue 54):
XLA's bytes accessed of each periodic transform's step, in-graph and
host-scheduled, for every wire (benchmarks/README.md)."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance

STEP_BYTES = "benchmarks/results/step_bytes.json"
# The three programs of a row, in the table's order (step_bytes.PROGRAMS).
STEP_PROGRAMS = ("in-graph", "host sync=0", "host sync=1")


def _mb(value: float) -> str:
  return f"{value / 1e6:,.2f}"


def step_bytes_table(d: dict) -> str:
  """:mod:`benchmarks.perf.step_bytes`'s floors line and table."""
  floors = d["floors"]
  rows = []
  for row in d["rows"]:
    if "refused" in row:
      rows.append(
        [row["transform"], row["wire"], f"refused: {row['refused']}"] + [""] * 6
      )
      continue
    programs = [row[p] for p in STEP_PROGRAMS]
    rows.append(
      [
        row["transform"],
        row["wire"],
        _mb(floors[row["floor"]]["bytes_accessed"]),
        *(
          f"{_mb(p['bytes_accessed'])} ({p['ratio_to_floor']:.3f})"
          for p in programs
        ),
        " / ".join(str(p["conditionals"]) for p in programs),
        " / ".join(str(p["collectives"]) for p in programs),
        " / ".join(_mb(p["copied_bytes"]) for p in programs),
      ]
    )
  floor_text = "; ".join(
    f"{name}: {_mb(f['bytes_accessed'])} MB accessed, {f['conditionals']}"
    f" conditionals, {f['collectives']} collectives, {_mb(f['copied_bytes'])}"
    " MB copied"
    for name, f in floors.items()
  )
  return (
    f"MLP {d['mlp']} ({d['params']:,} params), {d['replicas']} replicas of"
    f" {d['per_replica_batch']} examples, donated `jax.jit` +"
    " `shard_map(check_vma=False)` step, compiled and read, not run; MB ="
    f" 1e6 bytes, XLA's `bytes accessed`. Floors: {floor_text}."
    + "\n\n"
    + table(
      [
        "transform",
        "wire",
        "floor MB",
        "in-graph MB (/ floor)",
        "host sync=0 MB (/ floor)",
        "host sync=1 MB (/ floor)",
        "conditionals (in-graph / 0 / 1)",
        "collectives (in-graph / 0 / 1)",
        "copied MB (in-graph / 0 / 1)",
      ],
      rows,
      "llrrrrrrr",
    )
  )


def render_step_bytes(data: Sequence[dict]) -> str:
  """benchmarks/README.md's step-bytes table (issue 54)."""
  (d,) = data
  return (
    top_provenance(
      d,
      STEP_BYTES,
      f"; {d['device_kind']} ({d['platform']}), JAX {d['jax']},"
      f" {d['seconds']:.0f} s",
    )
    + "\n\n"
    + step_bytes_table(d)
  )


BLOCKS = (
  Block(
    "step-bytes",
    (STEP_BYTES,),
    render_step_bytes,
    ("benchmarks/README.md",),
  ),
)
