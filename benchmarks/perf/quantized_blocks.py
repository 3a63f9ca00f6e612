"""benchmarks/README.md section 10's table, from the files
:mod:`benchmarks.perf.quantized` writes (this run's and the one before
issue 33's changes).

:data:`BLOCKS` registers it with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance
from benchmarks._blocks_format import when

QUANTIZED = "benchmarks/results/quantized.json"
QUANTIZED_BEFORE = "benchmarks/results/quantized_2026-11-25.json"
# Section 10's rows: the results file's label -> the table's.
QUANTIZED_ROWS = {
  "float32 wire": "float32",
  "bfloat16 wire": "bfloat16",
  "int8": "int8",
  "int8 + error feedback": "int8 + error feedback",
  "float8_e4m3fn": "float8_e4m3fn",
  "float8_e4m3fn + error feedback": "float8_e4m3fn + error feedback",
  "int4": "int4",
  "int4 + error feedback": "int4 + error feedback",
  "topk(64) + error feedback": (
    "`topk(64)` + error feedback (64 of every 4096, 2-bit values)"
  ),
  "float32 wire + an error buffer's read and write": (
    "**floor**: float32 wire + an error buffer's read and write"
  ),
}


def _pays_off(label: str, row: dict) -> str:
  """The link speed below which the wire is faster than float32's."""
  if label.startswith("float32 wire"):
    return "-"
  per_second = row.get("break_even_bytes_per_s")
  return "always" if per_second is None else f"{per_second * 8 / 1e9:.1f} Gb/s"


def _times(ratio: float) -> str:
  """A step-time ratio: ``1.498``, or ``29.5`` from 10 up."""
  return f"{ratio:.1f}" if ratio >= 10 else f"{ratio:.3f}"


def render_quantized(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 10: each wire's step time over the
  float32 wire's, beside the run before issue 33's changes."""
  now, before = data
  rows = []
  for label, words in QUANTIZED_ROWS.items():
    r = now["rows"][label]
    old = before["rows"].get(label)
    rows.append(
      [
        words,
        f"{r['bytes_per_replica'] / 1e6:.3g} MB",
        _times(r["ratio"]),
        "-" if old is None else _times(old["ratio"]),
        _pays_off(label, r),
        r["fusions"],
        r["sorts"],
        r["topk_calls"],
      ]
    )
  return (
    top_provenance(
      now,
      QUANTIZED,
      f"; a {now['params'] / 1e6:.2f}M-parameter MLP, interleaved medians of"
      f" {now['repeats']}",
    )
    + " "  # one paragraph: the block's first line names both files
    + top_provenance(
      before,
      QUANTIZED_BEFORE,
      f" ({before['saved_from']}): the column 'before'",
    )
    + "\n\n"
    + table(
      [
        "wire",
        "bytes per replica per step",
        "step time vs float32 wire",
        f"before ({when(before['date'])})",
        "pays off on links below",
        "fusions",
        "full sorts",
        "TopK calls",
      ],
      rows,
      "lrrrrrrr",
    )
  )


BLOCKS = (
  Block(
    "quantized",
    (QUANTIZED, QUANTIZED_BEFORE),
    render_quantized,
    ("benchmarks/README.md",),
  ),
)
