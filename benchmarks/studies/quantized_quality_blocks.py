"""benchmarks/README.md section 10b's table, from the file
:mod:`benchmarks.studies.quantized_quality` writes.

:data:`BLOCKS` registers it with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance

QUANTIZED_QUALITY = "benchmarks/results/quantized_quality.json"


def render_quantized_quality(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 10b: the study's own table (its rows as
  :mod:`benchmarks.studies.quantized_quality` formatted them from ``data``)."""
  (d,) = data
  seeds = d["seeds"]
  return (
    top_provenance(
      d,
      QUANTIZED_QUALITY,
      f"; {d['replicas']} replicas, {d['steps']} steps, mean ± std over"
      f" {len(seeds)} seeds ({', '.join(map(str, seeds))})",
    )
    + "\n\n"
    + table(d["table"]["columns"], d["table"]["rows"])
  )


BLOCKS = (
  Block(
    "quantized-quality",
    (QUANTIZED_QUALITY,),
    render_quantized_quality,
    ("benchmarks/README.md",),
  ),
)
