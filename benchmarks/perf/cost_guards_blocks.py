"""The finite guards' tables (README.md, benchmarks/README.md section 9c,
docs/reliability.md), from the file :mod:`benchmarks.perf.cost_guards`
writes.

:data:`BLOCKS` registers them with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import spread
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance
from benchmarks._blocks_format import when

GUARDS = "benchmarks/results/cost_guards.json"
# (group, a substring of the comparison's name) -> which comparison.
FREE = "apply_if_finite(adam, 5, axis_name=None)"
FLAG = "apply_if_finite(cross_shard(adam)"
TOWER = "apply_if_finite(tower(adam)"
FLOOR = "finite check"


def _comparisons(d: dict, group: str, key: str, donated: bool) -> list[dict]:
  """The comparison ``(group, key)`` of every run, in run order."""
  out = []
  for run in d["runs"]:
    found = [
      v
      for name, v in run["comparisons"].items()
      if v["group"] == group and key in name and v["donated"] == donated
    ]
    if len(found) != 1:
      raise ValueError(
        f"{GUARDS}: {len(found)} comparisons ({group!r}, {key!r},"
        f" donated={donated}) in a run, expected 1"
      )
    out.append(found[0])
  return out


def guard_ratios(d: dict, group: str, key: str, fmt=spread) -> str:
  """``not donated / donated``, each over the runs, e.g. ``1.10 / 1.12-1.13``."""
  return " / ".join(
    fmt([c["ratio"] for c in _comparisons(d, group, key, donated)])
    for donated in (False, True)
  )


def _each(values: Sequence[float]) -> str:
  """Every run's value: ``1.107, 1.111``."""
  return ", ".join(f"{v:.3f}" for v in values)


def _copied(copies: dict) -> str:
  total = copies["top"] + sum(copies["conditional"].values())
  return "0" if total == 0 else f"{total / 1e6:.3g}"


def guard_copies(d: dict, group: str, key: str, baseline: bool = False) -> str:
  """Copied MB/step of the first run, ``not donated / donated``."""
  field = "baseline_copied_bytes" if baseline else "copied_bytes"
  return " / ".join(
    _copied(_comparisons(d, group, key, donated)[0][field])
    for donated in (False, True)
  )


def guards_conditions(d: dict) -> str:
  """The runs' dates, loads, spreads and workload, as one sentence."""
  runs = d["runs"]
  spreads = [
    c["iqr_rel"] * 50 for run in runs for c in run["comparisons"].values()
  ]
  sizes = runs[0]["sizes"]
  starts = ", ".join(when(r["started_utc"])[11:16] for r in runs)
  loads = ", ".join(f"{r['load_average_at_start'][0]:.1f}" for r in runs)
  rounds = re.search(r"median of (\d+) interleaved", runs[0]["notes"][0])
  return (
    f"{len(runs)} runs, started {starts} UTC (load average {loads} at the"
    f" start, {d['machine']['cpu_count']} cores; spreads"
    f" ±{min(spreads):.0f}-{max(spreads):.0f}%); MLP {sizes}"
    f" ({runs[0]['params'] / 1e6:.2f}M params), Adam,"
    f" {d['machine']['device_count']} {d['machine']['platform'].upper()}"
    " devices,"
    f" median of {rounds.group(1) if rounds else '?'} interleaved rounds"
  )


def render_guards_readme(data: Sequence[dict]) -> str:
  """README's guard table: step time over the unguarded step, and over
  optax's guard in the same place; not donated / donated, over the runs."""
  (d,) = data
  rows = [
    [
      "already reduced (`cross_shard_mean`)",
      "`chain(cross_shard_mean(axis), apply_if_finite(adam, n, axis_name=None))`",
      "none",
      guard_ratios(d, "guard", FREE),
      guard_ratios(d, "vs optax guard", FREE),
    ],
    [
      "per replica (`cross_shard`)",
      "`apply_if_finite(cross_shard(adam), n, axis_name=axis)`",
      "a 4-byte flag, combined with the gradient's all-reduce",
      guard_ratios(d, "guard", FLAG),
      guard_ratios(d, "vs optax guard", FLAG),
    ],
    [
      "per replica (`tower`)",
      "`apply_if_finite(tower(adam), n, axis_name=axis)`",
      "a 4-byte flag",
      guard_ratios(d, "guard", TOWER),
      "deadlocks",
    ],
    [
      "floor: the check alone, deciding nothing",
      "-",
      "-",
      guard_ratios(d, "floor", FLOOR),
      "-",
    ],
  ]
  return (
    top_provenance(d, GUARDS, f"; {guards_conditions(d)}")
    + "\n\n"
    + table(
      [
        "where the gradients are",
        "guard",
        "collectives it adds",
        "step time",
        "vs `optax.apply_if_finite` there",
      ],
      rows,
    )
  )


def render_guards_benchmarks(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 9c: every run's ratio, and the copies."""
  (d,) = data
  rows = [
    [
      "floor: `chain(cross_shard_mean, adam + all_finite(grads))`, deciding"
      " nothing",
      guard_ratios(d, "floor", FLOOR, _each),
      "-",
      guard_copies(d, "floor", FLOOR),
    ],
    [
      "free guard `chain(cross_shard_mean, apply_if_finite(adam, 5,"
      " axis_name=None))`",
      guard_ratios(d, "guard", FREE, _each),
      guard_ratios(d, "vs optax guard", FREE, _each),
      f"{guard_copies(d, 'guard', FREE)} (optax's:"
      f" {guard_copies(d, 'vs optax guard', FREE, baseline=True)})",
    ],
    [
      "flag `apply_if_finite(cross_shard(adam), 5, axis_name=axis)`",
      guard_ratios(d, "guard", FLAG, _each),
      guard_ratios(d, "vs optax guard", FLAG, _each),
      f"{guard_copies(d, 'guard', FLAG)} (optax's:"
      f" {guard_copies(d, 'vs optax guard', FLAG, baseline=True)})",
    ],
    [
      "flag `apply_if_finite(tower(adam), 5, axis_name=axis)`",
      guard_ratios(d, "guard", TOWER, _each),
      "- (optax's deadlocks)",
      f"{guard_copies(d, 'guard', TOWER)} (unguarded tower:"
      f" {guard_copies(d, 'guard', TOWER, baseline=True)})",
    ],
  ]
  return (
    top_provenance(d, GUARDS, f"; {guards_conditions(d)}")
    + "\n\n"
    + table(
      [
        "step",
        "vs unguarded",
        "vs `optax.apply_if_finite` in the same place",
        "copied MB/step (HLO, not donated / donated)",
      ],
      rows,
    )
  )


def render_guards_reliability(data: Sequence[dict]) -> str:
  """docs/reliability.md's table: which guard each transform needs, what it
  adds and (where timed) what it costs; every run's ratio."""
  (d,) = data
  rows = [
    [
      "`cross_shard_mean` then anything, e.g. `chain(cross_shard_mean(axis),"
      " adam)`",
      "free: `chain(cross_shard_mean(axis), apply_if_finite(adam, n,"
      " axis_name=None))`",
      "none: the compiled step has exactly one all-reduce, the gradient's"
      " (`tests/test_finite.py::test_free_guard_step_has_exactly_one_all_reduce`)",
      guard_ratios(d, "guard", FREE, _each),
      guard_ratios(d, "vs optax guard", FREE, _each),
    ],
    [
      "`cross_shard(inner)`",
      "flag: `apply_if_finite(cross_shard(inner), n, axis_name=axis)`, or the"
      " free guard after `cross_shard_mean`",
      "the 4-byte flag, which XLA combines with the gradient's all-reduce: one"
      " all-reduce of 4 bytes more"
      " (`tests/test_finite.py::"
      "test_the_guard_adds_only_the_4_byte_flag_to_the_inner_collectives`)",
      guard_ratios(d, "guard", FLAG, _each),
      guard_ratios(d, "vs optax guard", FLAG, _each)
      + " (optax's deadlocks under pmap on a one-replica NaN)",
    ],
    [
      "`tower(inner)` (each replica updates its own slice)",
      "flag: `apply_if_finite(tower(inner), n, axis_name=axis)`",
      "one 4-byte all-reduce",
      guard_ratios(d, "guard", TOWER, _each),
      "- (deadlocks)",
    ],
    [
      "`powersgd` (each replica keeps its own error)",
      "flag: `apply_if_finite(chain(powersgd(axis), opt), n, axis_name=axis)`",
      "one 4-byte all-reduce",
      "not timed",
      "-",
    ],
    [
      "`accumulate(inner, k)`",
      "flag inside: `accumulate(apply_if_finite(inner, n, axis_name=axis), k)`",
      "the 4-byte all-reduce, at emit steps only (see below)",
      "not timed",
      "-",
    ],
    [
      "`agn`, `local_sgd`, `diloco`, `hierarchical_local_sgd`",
      "none needed for the sync: a non-finite replica is left out of its"
      " group's average",
      "-",
      "-",
      "-",
    ],
    [
      "the floor: `chain(cross_shard_mean(axis), adam)` plus"
      " `all_finite(grads)` deciding nothing (one more read of the gradients)",
      "-",
      "-",
      guard_ratios(d, "floor", FLOOR, _each),
      "-",
    ],
  ]
  return (
    top_provenance(d, GUARDS, f"; {guards_conditions(d)}; each cell: every run")
    + "\n\n"
    + table(
      [
        "transform",
        "guard",
        "collectives the guard adds",
        "step time vs unguarded (not donated / donated)",
        "vs `optax.apply_if_finite` in the same place (not donated / donated)",
      ],
      rows,
    )
  )


BLOCKS = (
  Block("guards", (GUARDS,), render_guards_readme, ("README.md",)),
  Block(
    "guards-each-run",
    (GUARDS,),
    render_guards_benchmarks,
    ("benchmarks/README.md",),
  ),
  Block(
    "guards-which",
    (GUARDS,),
    render_guards_reliability,
    ("docs/reliability.md",),
  ),
)
