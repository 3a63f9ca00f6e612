"""The README's demo table, from what ``python -m examples.demo --json
benchmarks/results/demo.json`` (:mod:`examples.demo`) writes.

:data:`BLOCKS` registers it with :mod:`benchmarks.blocks`, which writes and
checks the table in the README.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import fraction
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance

DEMO = "benchmarks/results/demo.json"


def render_demo(data: Sequence[dict]) -> str:
  """README's ``make demo`` table: accuracy and bytes of the four methods."""
  (d,) = data
  labels = {
    "sync": "sync (`cross_shard`)",
    "powersgd": "`powersgd`, rank 2",
    "diloco": f"`diloco`, H = {d['sync_period']}",
    "streaming": (
      f"streaming `diloco`, 2 fragments, {d['outer_dtype']} outer gradient"
    ),
  }
  sync = next(m for m in d["methods"] if m["method"] == "sync")
  rows = [
    [
      labels.get(m["method"], m["method"]),
      f"{m['test_accuracy']:.1%}",
      f"{m['bytes_per_replica'] / 1e6:,.2f} MB",
      fraction(sync["bytes_per_replica"] / m["bytes_per_replica"]),
    ]
    for m in d["methods"]
  ]
  return (
    top_provenance(
      d,
      DEMO,
      f"; {d['devices']} {d['platform'].upper()} devices, {d['steps']} steps per"
      " method",
    )
    + "\n\n"
    + table(
      ["method", "test accuracy", "bytes sent per replica", "vs sync"], rows
    )
  )


BLOCKS = (Block("demo", (DEMO,), render_demo, ("README.md",)),)
