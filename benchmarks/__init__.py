"""shardopt's benchmarks (scripts, not tests), in two packages.

* :mod:`benchmarks.perf`: what a step costs (overhead, groups, bytes on the
  wire, memory, the projection to real links, powersgd's cost, the cost of
  every new path, the quantized wire's cost, accumulate's copies, elastic
  timing). ``python -m benchmarks.perf [--quick] [--only NAME]``.
* :mod:`benchmarks.studies`: what training reaches (convergence on digits,
  the sync schedules, quality per byte on a byte-level LM, the outer-step
  sweeps, the quantized wire's quality). ``python -m benchmarks.studies
  [--quick] [--only NAME]``.

Each package has one harness module (its CLI; timing or seeding) and one
workload module (perf: the MLP's training steps; studies: the digits data
and MLP, and the byte-level LM). ``python -m benchmarks.run`` runs both
packages' sections into one report (``benchmarks/results/latest.{json,md}``,
written by :mod:`benchmarks._report`). Shared helpers at this level:
``_report``, ``_plots``, ``_xla_flags`` and ``methods`` (the
data-parallel methods both sides compare). Bytes are read with
:mod:`shardopt.measure.hlo`, the package's one internal door for the
benchmarks and the tests.
"""

import os

# Where every script writes its results (committed: what the READMEs quote).
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
