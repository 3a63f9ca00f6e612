"""The quality studies' harness: their sections, CLI and seeds.

``python -m benchmarks.studies [--quick] [--only NAME]`` runs
:data:`SECTIONS` (each a module of this package with ``run(quick)`` and
``plot``) into ``benchmarks/results/latest.{json,md}``
(:func:`benchmarks._report.main`), merged with the performance sections
already there. The studies that run on their own (``outer_sweep``,
``outer_defaults``, ``quantized_quality``, and ``quality_per_byte`` with its
own options) write ``benchmarks/results/NAME.json`` and ``NAME.png``.

Seeds (:func:`seeds`): every method of a study trains from the same seeds,
so the methods are compared on identical data: seed ``s`` draws the data
order from ``s`` and the params from ``100 + s`` (digits) or ``1000 + s``
(the LM).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from benchmarks import _report

SECTIONS = ("convergence", "schedule_convergence", "quality_per_byte")


def seeds(quick: bool, full: int = 3) -> tuple[int, ...]:
  """A study's seeds: ``(0,)`` in a quick run, else ``0 .. full - 1``."""
  return (0,) if quick else tuple(range(full))


def default_outer() -> str:
  """``diloco``'s default outer step in words, read from the defaults its
  signature takes (``shardopt.periodic.checks.DEFAULT_OUTER``)."""
  from shardopt.periodic import checks

  d = checks.DEFAULT_OUTER
  kind = "Nesterov SGD" if d["nesterov"] else "SGD with momentum"
  return (
    f"{kind} lr {d['outer_learning_rate']:g}, momentum {d['outer_momentum']:g}"
  )


def run_section(name: str, quick: bool, results: dict, out: str) -> dict:
  """Runs section ``name`` of this package and writes its plots."""
  del results  # no study reads another section's numbers
  module = importlib.import_module(f"benchmarks.studies.{name}")
  return _report.run_module(module, quick, out)


def main(argv: Sequence[str] | None = None) -> int:
  return _report.main(
    argv,
    prog="benchmarks.studies",
    sections=SECTIONS,
    run_section=run_section,
    description="Run the quality studies (convergence, schedules, quality"
    " per byte).",
  )
