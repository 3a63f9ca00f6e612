"""docs/diloco.md's digits results: sections 5 and 5b of
``benchmarks/results/latest.json`` (:mod:`benchmarks.studies.convergence`
and :mod:`benchmarks.studies.schedule_convergence`).

:data:`BLOCKS` registers the table with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import LATEST
from benchmarks._blocks_format import Block
from benchmarks._blocks_format import section_provenance
from benchmarks._blocks_format import table

CONVERGENCE_SYNC = "cross_shard(adam) [sync]"
DIGITS_ROWS = {
  CONVERGENCE_SYNC: "sync `cross_shard(adam)`",
  "local_sgd(adam, period=8)": "`local_sgd` H = 8",
  "diloco(adam, H=16)": "`diloco` H = 16",
}


def render_digits_convergence(data: Sequence[dict]) -> str:
  """docs/diloco.md: DiLoCo on the digits MLP (sections 5 and 5b of the
  latest report): accuracy per step, and streaming DiLoCo against DiLoCo."""
  (results,) = data
  sections = results["sections"]
  convergence = sections["convergence"]["data"]
  target = convergence["target"]
  summary = convergence["summary"]
  per_step = table(
    ["method", "all-reduces", "final test accuracy", f"steps to {target:.0%}"],
    [
      [
        words,
        f"{summary[key]['rounds_total']:,}",
        f"{summary[key]['final_accuracy']:.3f}"
        f" ± {summary[key]['final_accuracy_std']:.3f}",
        "never"
        if summary[key]["steps_to_target"] is None
        else f"{summary[key]['steps_to_target']:,}",
      ]
      for key, words in DIGITS_ROWS.items()
    ],
    "lrrr",
  )
  schedules = sections["schedule_convergence"]["table"]
  column = {name: i for i, name in enumerate(schedules["columns"])}
  streaming = table(
    [
      "method",
      "mean kB/step",
      "peak kB/step",
      "final test accuracy",
      "final test loss",
    ],
    [
      [
        f"`{row[column['method']]}`",
        row[column["mean kB/step"]],
        row[column["peak kB/step"]],
        row[column["final test acc (replica mean)"]],
        row[column["final test loss"]],
      ]
      for row in schedules["rows"]
      if row[column["comparison"]] == "streaming"
    ],
    "lrrrr",
  )
  verdicts = [
    note
    for note in sections["schedule_convergence"]["notes"]
    if note.startswith("**streaming diloco")
  ]
  steps = convergence["total_steps"]
  seeds = len(convergence["seeds"])
  replicas = sections["convergence"]["ran_on"]["device_count"]
  return "\n\n".join(
    [
      section_provenance(results, "convergence", LATEST),
      f"{steps:,} steps, {replicas} replicas, mean ± std over {seeds} seeds:",
      per_step,
      section_provenance(results, "schedule_convergence", LATEST),
      streaming,
      *(f"- {v}" for v in verdicts),
    ]
  )


BLOCKS = (
  Block(
    "digits-convergence",
    (LATEST,),
    render_digits_convergence,
    ("docs/diloco.md",),
  ),
)
