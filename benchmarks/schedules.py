"""Bytes per step: a compiled step's collectives, weighted by the transform's schedule.

One compiled training step holds every collective the transform can ever run:
those at the top level run on every step, those inside a ``conditional``
branch only on the steps that take that branch. :func:`benchmarks.hlo.by_branch`
gives the bytes of the top level and of each branch; the schedule says which
branch a step takes, so together they give the bytes of every step of a
cycle, their mean (what a run communicates on average) and their peak (what
the link must carry on the worst step).

Schedules (``t`` = local step, 1-based, as the transforms count):

* :func:`every`: the same collectives every step (``cross_shard``,
  ``powersgd``, ``apply_if_finite``). If the step has conditional branches
  with collectives, ``taken`` says which one a steady-state step takes:
  ``"max"`` (``apply_if_finite``: the finite branch, which runs the inner
  transform's collectives) or ``"min"`` (``powersgd`` after its warm-up: the
  compressed branch).
* :func:`periodic`: every branch with collectives runs together once per
  ``period`` steps (``accumulate``'s emit step, the sync step of ``agn``,
  ``local_sgd``, ``diloco``).
* :func:`fragments`: streaming DiLoCo, ``num_fragments`` fragments, each
  synchronised once per ``period`` at its own offset. With one branch per
  fragment (F branches found) each branch runs once per period; with a single
  branch for every fragment sync, it runs F times per period.
* :func:`levels`: ``hierarchical_local_sgd``'s ``{period: group size}``:
  after step ``t`` the largest period dividing ``t`` wins; its branch is the
  one whose largest collective runs in groups of that size.

Bytes are all-reduce-equivalent (see :mod:`benchmarks.hlo`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from benchmarks import hlo


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which conditional branches a step takes; see the module docstring."""

  kind: str
  period: int = 1
  num_fragments: int = 1
  levels: tuple = ()
  taken: str = "max"

  def describe(self) -> str:
    if self.kind == "every":
      return "every step"
    if self.kind == "periodic":
      return f"once per {self.period} steps"
    if self.kind == "fragments":
      return (
        f"{self.num_fragments} fragments, each once per {self.period} steps"
      )
    return "levels " + ", ".join(
      f"every {p}: groups of {g}" for p, g in self.levels
    )


def every(taken: str = "max") -> Schedule:
  return Schedule("every", taken=taken)


def periodic(period: int) -> Schedule:
  return Schedule("periodic", period=period)


def fragments(period: int, num_fragments: int) -> Schedule:
  return Schedule("fragments", period=period, num_fragments=num_fragments)


def levels(period_group_sizes: Mapping[int, int]) -> Schedule:
  return Schedule(
    "levels",
    levels=tuple(period_group_sizes.items()),
    period=math.lcm(*period_group_sizes),
  )


def _main_group_size(collectives: list, label: str) -> int:
  """Group size of the branch's largest collective (a flag may span more)."""
  ops = [op for op in collectives if op.branch == label]
  return max(ops, key=hlo.allreduce_equivalent_bytes).group_size


def _label_key(label: str) -> tuple:
  """Branch labels (``conditional.12#1``) in numeric order: one cond per
  fragment, numbered in program order, so ``.9`` comes before ``.10``."""
  return tuple(int(n) for n in re.findall(r"\d+", label))


def per_step(collectives: list, schedule: Schedule) -> dict:
  """Mean and peak all-reduce-equivalent bytes per step of ``schedule``.

  Args:
    collectives: :func:`benchmarks.hlo.compiled_collectives` of ONE step.
    schedule: which branches the steps of a cycle take.

  Returns:
    ``{"mean_bytes", "peak_bytes", "top_bytes", "cycle": [bytes of step t for
    t = 1..cycle length], "branches": by_branch's branches, "warning"}``;
    ``warning`` is ``""`` unless the HLO does not look like the schedule
    (say, F fragments expected and a different number of branches found).
  """
  split = hlo.by_branch(collectives)
  top, branches = split["top"], split["branches"]
  sizes = {label: b["bytes"] for label, b in branches.items()}
  warning = ""
  if schedule.kind == "every":
    extra = 0.0
    if sizes:
      extra = (max if schedule.taken == "max" else min)(sizes.values())
    cycle = [top + extra]
  elif schedule.kind == "periodic":
    cycle = [top] * (schedule.period - 1) + [top + sum(sizes.values())]
  elif schedule.kind == "fragments":
    period, count = schedule.period, schedule.num_fragments
    offsets = [(f * period) // count for f in range(count)]
    cycle = [top] * period
    if len(sizes) == count:
      per_fragment = [sizes[label] for label in sorted(sizes, key=_label_key)]
    else:
      total = sum(sizes.values())
      per_fragment = (
        [total] * count if len(sizes) == 1 else [total / count] * count
      )
      warning = (
        f"expected {count} branches with collectives (one per"
        f" fragment), found {len(sizes)}"
      )
    for offset, value in zip(offsets, per_fragment):
      cycle[(offset - 1) % period] += value  # step t sits at index t - 1
  elif schedule.kind == "levels":
    by_size: dict = {}
    for label in sizes:
      size = _main_group_size(collectives, label)
      by_size[size] = by_size.get(size, 0.0) + sizes[label]
    cycle = []
    for t in range(1, schedule.period + 1):
      due = [(p, g) for p, g in schedule.levels if t % p == 0]
      cycle.append(top + (by_size.get(max(due)[1], 0.0) if due else 0.0))
    expected = {g for _, g in schedule.levels}
    if set(by_size) != expected:
      warning = (
        f"expected branches in groups of {sorted(expected)}, found"
        f" {sorted(by_size)}"
      )
  else:
    raise ValueError(f"per_step: unknown schedule kind {schedule.kind!r}.")
  return {
    "mean_bytes": sum(cycle) / len(cycle),
    "peak_bytes": max(cycle),
    "top_bytes": top,
    "cycle": cycle,
    "branches": branches,
    "warning": warning,
  }
