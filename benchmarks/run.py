"""Run every benchmark: ``python -m benchmarks.run [--quick] [--only NAME]``.

The performance sections (:mod:`benchmarks.perf.harness`) and the quality
studies (:mod:`benchmarks.studies.harness`) in one report: writes
``benchmarks/results/latest.json`` (every number, plus the machine it came
from), ``benchmarks/results/latest.md`` (the tables) and one PNG per
section, and prints the tables. ``--quick`` is the CI smoke run: tiny
sizes, written to ``benchmarks/results/quick/`` so it never overwrites the
committed full results. ``--only NAME`` (repeatable) runs some sections and
merges them into the existing ``latest.json``; ``python -m benchmarks.perf``
and ``python -m benchmarks.studies`` run one package's sections the same
way.

All timings run on 8 forced CPU devices (``XLA_FLAGS`` is set here before jax
is imported, unless it already forces a device count). ``--quick`` also turns
XLA's backend optimisation off to compile faster: its timings mean nothing.
"""

from __future__ import annotations

import sys

from benchmarks._xla_flags import force_cpu_devices

force_cpu_devices(quick="--quick" in sys.argv[1:])

from benchmarks import _report  # noqa: E402
from benchmarks.perf import harness as perf  # noqa: E402
from benchmarks.studies import harness as studies  # noqa: E402

SECTIONS = _report.ORDER
if sorted(SECTIONS) != sorted(perf.SECTIONS + studies.SECTIONS):
  raise RuntimeError(
    f"benchmarks.run: the report's sections {SECTIONS} are not the"
    f" performance sections {perf.SECTIONS} and the studies' sections"
    f" {studies.SECTIONS}; add a new section to both _report.ORDER and its"
    " harness's SECTIONS."
  )


def run_section(name: str, quick: bool, results: dict, out: str) -> dict:
  harness = perf if name in perf.SECTIONS else studies
  return harness.run_section(name, quick, results, out)


def main(argv=None) -> int:
  return _report.main(
    argv,
    prog="benchmarks.run",
    sections=SECTIONS,
    run_section=run_section,
    description=__doc__.split("\n\n")[0],
  )


if __name__ == "__main__":
  sys.exit(main())
