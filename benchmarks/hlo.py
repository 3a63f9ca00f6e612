"""The HLO reader, under its old name: it lives in the package now.

:mod:`shardopt._hlo` is the one reader of what crosses the wire (the demo,
the benchmarks and the tests count bytes there; its docstring has the
conventions). This module re-exports it for notebooks and scripts written
against ``from benchmarks import hlo``; new code imports
``from shardopt import _hlo``.
"""

from shardopt._hlo import COLLECTIVE_KINDS
from shardopt._hlo import DTYPE_BYTES
from shardopt._hlo import Collective
from shardopt._hlo import Schedule
from shardopt._hlo import allreduce_equivalent_bytes
from shardopt._hlo import branch_collectives
from shardopt._hlo import by_branch
from shardopt._hlo import compiled_collectives
from shardopt._hlo import copied_bytes
from shardopt._hlo import fired
from shardopt._hlo import instruction_mix
from shardopt._hlo import lowered_collectives
from shardopt._hlo import mix_difference
from shardopt._hlo import per_step
from shardopt._hlo import run_bytes
from shardopt._hlo import sent_bytes
from shardopt._hlo import summarize

__all__ = [
  "COLLECTIVE_KINDS",
  "DTYPE_BYTES",
  "Collective",
  "Schedule",
  "allreduce_equivalent_bytes",
  "branch_collectives",
  "by_branch",
  "compiled_collectives",
  "copied_bytes",
  "fired",
  "instruction_mix",
  "lowered_collectives",
  "mix_difference",
  "per_step",
  "run_bytes",
  "sent_bytes",
  "summarize",
]
