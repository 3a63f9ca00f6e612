"""Schedules of the periodic family: which leaves, over which group of
replicas, after which local step.

A schedule is a tuple of :class:`Sync` records. :func:`every`,
:func:`hierarchy` and :func:`streaming` build the family's three; a step
picks the sync that fires from the replicated step counter
(:func:`firing`), and the engine runs at most one per step. A new schedule
is a new function here returning its ``Sync`` records (and, if it needs
one, a field on :class:`Sync`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardopt import _args
from shardopt import _axes
from shardopt.periodic.fragments import layer_mask


class Sync(NamedTuple):
  """One synchronisation of a schedule.

  Attributes:
    period: with ``phase``: the sync fires after local step ``t`` (1, 2, ...)
      iff ``t % period == phase``. When several fire at the same step, the
      last one in the schedule wins.
    phase: see ``period``.
    fragment: index of the fragment of the params' leaves it synchronises.
    group_size: replicas per contiguous group (replica ``i`` is in group
      ``i // group_size``); None: the transform's ``axis_index_groups``, or
      the whole axis.
    lag: the sync of step ``t`` runs in the update of step ``t + lag``
      (overlap: with ``lag=1`` its all-reduce reads the params the update
      is given, not that step's gradient). For a merge
      (:func:`merges`), the steps from the sync to the merge.
    states: names of fields of the local optimizer's state (``"mu"``,
      ``"nu"``: :mod:`.moments`) whose leaves this sync also averages, in
      the same collective round (DES-LOC, :func:`desloc`); () for none.
    params: whether the sync moves the params' fragment (False: a sync of
      ``states`` alone).
  """

  period: int
  phase: int = 0
  fragment: int = 0
  group_size: int | None = None
  lag: int = 0
  states: tuple = ()
  params: bool = True


def every(period: int) -> tuple[Sync, ...]:
  """Everything, over the whole axis (or each group), after T, 2T, ..."""
  return (Sync(period),)


def hierarchy(period_group_sizes: dict) -> tuple[Sync, ...]:
  """One level per ``{period: group_size}``; the largest period wins."""
  return tuple(Sync(p, 0, 0, s) for p, s in period_group_sizes.items())


def streaming(
  period: int, num_fragments: int, lag: int = 0, offset: int = 0
) -> tuple[Sync, ...]:
  """Fragment ``f`` after step t iff ``t % period == ((f * period) // F +
  offset) % period`` (run ``lag`` steps later)."""
  return tuple(
    Sync(period, ((f * period) // num_fragments + offset) % period, f, lag=lag)
    for f in range(num_fragments)
  )


def desloc(periods: dict) -> tuple[Sync, ...]:
  """DES-LOC's schedule: ``periods`` maps ``"params"`` and state field names
  to their own period; after step ``t`` every part whose period divides
  ``t`` is averaged, in one sync.

  One :class:`Sync` per set of parts that can fire together, the set's
  period the lcm of its parts' periods, ordered by the set's size so that
  the largest set that fires wins (:func:`firing`); a set that only ever
  fires with a larger one (``{"mu"}`` when the params' period divides the
  moment's) is left out, so that :func:`firing` numbers the syncs that do
  run (``shardopt.due``)::

    >>> [(s.period, s.params, s.states)
    ...  for s in desloc({"params": 16, "mu": 48, "nu": 96})]
    [(16, True, ()), (48, True, ('mu',)), (96, True, ('mu', 'nu'))]
  """
  names = list(periods)
  sets = [
    frozenset(c)
    for r in range(1, len(names) + 1)
    for c in itertools.combinations(names, r)
  ]
  period = {s: math.lcm(*(periods[n] for n in s)) for s in sets}
  live = [
    s for s in sets if not any(s < o and period[o] == period[s] for o in sets)
  ]
  return tuple(
    Sync(
      period[s],
      params="params" in s,
      states=tuple(n for n in names if n in s and n != "params"),
    )
    for s in live
  )


def merges(
  period: int, num_fragments: int, overlap_steps: int, offset: int = 0
) -> tuple[Sync, ...]:
  """When each fragment of :func:`streaming` rejoins the center:
  ``overlap_steps`` after its sync."""
  return streaming(period, num_fragments, lag=overlap_steps, offset=offset)


def replica_groups(
  group_size: int | None,
  axis_index_groups,
  size: int,
  transform: str,
  axis_name: Any,
) -> tuple | None:
  """A sync's replica groups: contiguous ones of ``group_size``, or the
  transform's ``axis_index_groups`` (None: the whole axis)."""
  if group_size is None:
    return _axes.validate_groups(axis_index_groups, size, transform, axis_name)
  if size % group_size:
    raise ValueError(
      f"{transform}: group size {group_size} does not divide the size"
      f" {size} of axis {axis_name!r}; every group size in"
      " period_group_sizes must divide the axis size (contiguous groups of"
      f" that many replicas), e.g. one of {_divisors(size)}."
    )
  if group_size == size:
    return None
  return tuple(
    tuple(range(g, g + group_size)) for g in range(0, size, group_size)
  )


def _divisors(size: int) -> list[int]:
  return [d for d in range(1, size + 1) if size % d == 0]


def counts_whole_axis(syncs: Sequence[Sync]) -> bool:
  """Whether skips are counted over the whole axis (replicated ``skipped``);
  a schedule of contiguous groups (hierarchical) counts within them."""
  return all(s.group_size is None for s in syncs)


# --------------------------------------------------------------------------
# At trace time of a step.


def firing(step, syncs: Sequence[Sync], warmup_steps: int = 0):
  """Which sync runs in the update of ``step`` (0: none; later syncs win):
  the one of step ``step - lag``, counted from the end of the warm-up (step
  ``warmup_steps`` is step 0 of the schedule).

  ``step`` is the replicated counter inside a step (an int32 scalar array:
  an int32 array comes back), or a Python int on the host, where the
  schedule is chosen before tracing (``shardopt.due``,
  ``shardopt.elastic``): a Python int comes back, from the same rule.
  """
  on_host = _args.is_integer(step)
  index = 0 if on_host else jnp.zeros([], jnp.int32)
  for k, sync in enumerate(syncs):
    shift = sync.lag + warmup_steps
    t = step - shift if shift else step
    fires = t % sync.period == sync.phase
    if shift:
      fires = fires & (t >= 1)
    if on_host:
      index = k + 1 if fires else index
    else:
      index = jnp.where(fires, k + 1, index)
  return index


def synced_leaves(
  index: jax.Array, syncs: Sequence[Sync], fragments, shapes: Sequence
) -> list:
  """Per leaf (of ``shapes``), which of its elements sync ``index`` moves
  (0: none does): a flag, or a mask of layers (:mod:`.fragments`)."""
  synced = [jnp.zeros([], bool)] * len(shapes)
  for k, sync in enumerate(syncs):
    fired = index == k + 1
    for piece in fragments[sync.fragment]:
      if piece.axis is not None:
        fired_here = fired & layer_mask(piece, shapes[piece.leaf])
      else:
        fired_here = fired
      synced[piece.leaf] = synced[piece.leaf] | fired_here
  return synced
