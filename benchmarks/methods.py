"""The data-parallel methods the benchmarks compare, built only where shardopt has them.

Each :class:`Method` names the shardopt functions it needs and builds its
transform around an optimizer factory (``lambda: optax.adamw(lr)``). Some
transforms are written in parallel with these benchmarks; :func:`build`
returns ``(None, reason)`` when a name is missing from ``shardopt`` or a
keyword is rejected (``TypeError``), so a section records "not available"
for that method instead of failing, and measures it once it lands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax

import shardopt
from benchmarks import _common
from benchmarks import schedules

Factory = Callable[[], optax.GradientTransformation]
AXIS = _common.AXIS


@dataclasses.dataclass(frozen=True)
class Method:
  """A labelled transform recipe.

  Attributes:
    label: the row name in tables and plots.
    requires: public shardopt names it uses.
    build: ``optimizer factory -> transform``.
    schedule: which steps communicate what (:mod:`benchmarks.schedules`).
    rounds_per_step: communication rounds per step (1 = every step), for the
      "per round" view.
    quick: part of the ``--quick`` smoke run (one per code path).
  """

  label: str
  requires: tuple
  build: Callable[[Factory], optax.GradientTransformation]
  schedule: schedules.Schedule
  rounds_per_step: float = 1.0
  quick: bool = False


def build(
  method: Method, optimizer: Factory
) -> tuple[optax.GradientTransformation | None, str]:
  """``(transform, "")``, or ``(None, why)`` if this shardopt lacks it."""
  missing = [name for name in method.requires if not hasattr(shardopt, name)]
  if missing:
    return None, (
      "not available: shardopt."
      + ", shardopt.".join(missing)
      + " is not in this version"
    )
  try:
    return method.build(optimizer), ""
  except TypeError as error:  # a keyword this version does not take
    return None, f"not available: {error}"


def sync(name: str = "adamw") -> Method:
  return Method(
    f"cross_shard({name}) [sync]",
    ("cross_shard",),
    lambda opt: shardopt.cross_shard(opt(), AXIS),
    schedules.every(),
    quick=True,
  )


def accumulate(k: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"accumulate(cross_shard({name}), {k})",
    ("accumulate", "cross_shard"),
    lambda opt: shardopt.accumulate(shardopt.cross_shard(opt(), AXIS), k),
    schedules.periodic(k),
    1.0 / k,
    quick,
  )


def powersgd(rank: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"chain(powersgd(rank={rank}), {name})",
    ("powersgd",),
    lambda opt: optax.chain(shardopt.powersgd(AXIS, rank=rank), opt()),
    schedules.every(taken="min"),
    1.0,
    quick,
  )


def agn(period: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"agn({name}, T={period})",
    ("agn",),
    lambda opt: shardopt.agn(opt(), AXIS, communication_period=period),
    schedules.periodic(period),
    1.0 / period,
    quick,
  )


def local_sgd(period: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"local_sgd({name}, H={period})",
    ("local_sgd",),
    lambda opt: shardopt.local_sgd(opt(), AXIS, period=period),
    schedules.periodic(period),
    1.0 / period,
    quick,
  )


def diloco(period: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"diloco({name}, H={period})",
    ("diloco",),
    lambda opt: shardopt.diloco(opt(), AXIS, sync_period=period),
    schedules.periodic(period),
    1.0 / period,
    quick,
  )


def streaming_diloco(
  period: int, num_fragments: int, quick: bool = False, name: str = "adamw"
) -> Method:
  return Method(
    f"streaming diloco({name}, H={period}, F={num_fragments})",
    ("diloco",),
    lambda opt: shardopt.diloco(
      opt(), AXIS, sync_period=period, num_fragments=num_fragments
    ),
    schedules.fragments(period, num_fragments),
    num_fragments / period,
    quick,
  )


def hierarchical(
  period_group_sizes: dict, quick: bool = False, name: str = "adamw"
) -> Method:
  cycle = schedules.levels(period_group_sizes).period
  rounds = (
    sum(
      1
      for t in range(1, cycle + 1)
      if any(t % p == 0 for p in period_group_sizes)
    )
    / cycle
  )
  return Method(
    f"hierarchical_local_sgd({name}, {period_group_sizes})",
    ("hierarchical_local_sgd",),
    lambda opt: shardopt.hierarchical_local_sgd(
      opt(), AXIS, period_group_sizes=period_group_sizes
    ),
    schedules.levels(period_group_sizes),
    rounds,
    quick,
  )


def quality_per_byte() -> list[Method]:
  """The eleven methods of issue 15's quality-per-byte comparison."""
  return [
    sync(),
    accumulate(4),
    powersgd(1),
    powersgd(2, quick=True),
    powersgd(4),
    agn(8),
    local_sgd(16),
    diloco(16),
    diloco(64),
    streaming_diloco(64, 4, quick=True),
    hierarchical({4: 2, 16: 8}, quick=True),
  ]
