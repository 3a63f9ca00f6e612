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

A warm-up (``warmup=W``, the periodic family's ``warmup_steps``): steps
``1..W`` take the warm-up's branch (the first in program order: the
all-reduce of the mean gradient), then the schedule runs as if step ``W``
were step 0. A lag (``lag=1``, Streaming DiLoCo's overlap) runs each sync
one step after its own. :func:`run_bytes` sums a whole run.

Bytes are all-reduce-equivalent (see :mod:`benchmarks.hlo`), or what
``per_step``'s ``measure`` counts (:func:`benchmarks.hlo.sent_bytes`).
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
  warmup: int = 0
  lag: int = 0

  def describe(self) -> str:
    warm = f"every step for {self.warmup}, then " if self.warmup else ""
    if self.kind == "every":
      return "every step"
    if self.kind == "periodic":
      return f"{warm}once per {self.period} steps"
    if self.kind == "fragments":
      return (
        f"{warm}{self.num_fragments} fragments, each once per"
        f" {self.period} steps"
      )
    return "levels " + ", ".join(
      f"every {p}: groups of {g}" for p, g in self.levels
    )


def every(taken: str = "max") -> Schedule:
  return Schedule("every", taken=taken)


def periodic(period: int, warmup: int = 0) -> Schedule:
  return Schedule("periodic", period=period, warmup=warmup)


def fragments(
  period: int, num_fragments: int, lag: int = 0, warmup: int = 0
) -> Schedule:
  return Schedule(
    "fragments",
    period=period,
    num_fragments=num_fragments,
    lag=lag,
    warmup=warmup,
  )


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


def per_step(collectives: list, schedule: Schedule, measure=None) -> dict:
  """Mean and peak all-reduce-equivalent bytes per step of ``schedule``.

  Args:
    collectives: :func:`benchmarks.hlo.compiled_collectives` of ONE step.
    schedule: which branches the steps of a cycle take.
    measure: an op's bytes (:func:`benchmarks.hlo.by_branch`'s default:
      all-reduce-equivalent).

  Returns:
    ``{"mean_bytes", "peak_bytes", "top_bytes", "cycle": [bytes of step t for
    t = 1..cycle length], "warmup_bytes": bytes of a warm-up step (0 without
    one), "branches": by_branch's branches, "warning"}``; ``warning`` is
    ``""`` unless the HLO does not look like the schedule (say, F fragments
    expected and a different number of branches found). The cycle, mean and
    peak are those after the warm-up.
  """
  split = hlo.by_branch(collectives, measure)
  top, branches = split["top"], split["branches"]
  sizes = {label: b["bytes"] for label, b in branches.items()}
  warning = ""
  warmup_bytes = 0.0
  if schedule.warmup:
    if not sizes:
      raise ValueError("per_step: a warm-up, but no branch with collectives.")
    first = min(sizes, key=_label_key)
    warmup_bytes = top + sizes.pop(first)
    if branches[first]["count"] != {"all-reduce": 1}:
      warning = (
        f"the warm-up's branch {first} is not one all-reduce:"
        f" {branches[first]['count']}"
      )
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
      # step t sits at index t - 1; a lagged sync runs lag steps later
      cycle[(offset + schedule.lag - 1) % period] += value
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
    "peak_bytes": max(cycle + ([warmup_bytes] if schedule.warmup else [])),
    "top_bytes": top,
    "cycle": cycle,
    "warmup_bytes": warmup_bytes,
    "branches": branches,
    "warning": warning,
  }


def run_bytes(measured: dict, schedule: Schedule, steps: int) -> float:
  """Bytes of a run of ``steps`` steps: the warm-up's steps, then the cycle
  of :func:`per_step`'s result ``measured`` from its start (step ``W + 1``
  takes ``cycle[0]``). A lagged sync (``schedule.lag``) of one of the last
  ``lag`` steps runs after the run and is not counted; the first ``lag``
  steps, which its cycle charges with the syncs of the steps before them,
  have none (there are none before step ``W + 1``)."""
  warm = min(schedule.warmup, steps)
  cycle = measured["cycle"]
  top = measured["top_bytes"]
  total = warm * measured["warmup_bytes"]
  for i in range(steps - warm):
    total += top if i < schedule.lag else cycle[i % len(cycle)]
  return total
