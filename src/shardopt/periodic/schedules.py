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

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _axes


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
  """

  period: int
  phase: int = 0
  fragment: int = 0
  group_size: int | None = None


def every(period: int) -> tuple[Sync, ...]:
  """Everything, over the whole axis (or each group), after T, 2T, ..."""
  return (Sync(period),)


def hierarchy(period_group_sizes: dict) -> tuple[Sync, ...]:
  """One level per ``{period: group_size}``; the largest period wins."""
  return tuple(Sync(p, 0, 0, s) for p, s in period_group_sizes.items())


def streaming(period: int, num_fragments: int) -> tuple[Sync, ...]:
  """Fragment ``f`` after step t iff ``t % period == (f * period) // F``."""
  return tuple(
    Sync(period, (f * period) // num_fragments, f) for f in range(num_fragments)
  )


def split_fragments(
  leaf_bytes: Sequence[int], num_fragments: int
) -> tuple[tuple[int, ...], ...]:
  """Contiguous fragments of leaf indices, balanced by bytes.

  The ``k``-th cut goes where the cumulative bytes come closest to ``k *
  total / num_fragments`` (the first such place on a tie), keeping every
  fragment non-empty. Needs ``1 <= num_fragments <= len(leaf_bytes)``.
  """
  n = len(leaf_bytes)
  cumulative = np.cumsum(leaf_bytes)
  total = float(cumulative[-1]) if n else 0.0
  cuts = [0]
  for k in range(1, num_fragments):
    target = k * total / num_fragments
    candidates = range(cuts[-1] + 1, n - (num_fragments - k) + 1)
    cuts.append(min(candidates, key=lambda j: abs(cumulative[j - 1] - target)))
  cuts.append(n)
  return tuple(tuple(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:]))


def _leaf_bytes(params: Any) -> list[int]:
  return [
    int(np.prod(np.shape(p))) * np.dtype(p.dtype).itemsize
    for p in jax.tree.leaves(params)
  ]


def check_fragments(
  params: Any, num_fragments: int, transform: str
) -> tuple[tuple[int, ...], ...]:
  """The fragments of ``params``, or a ValueError naming the fix."""
  n = len(jax.tree.leaves(params))
  if num_fragments > max(n, 1):
    raise ValueError(
      f"{transform}: num_fragments={num_fragments} but the params have only"
      f" {n} leaves; fragments are made of whole leaves (contiguous in"
      f" jax.tree.leaves order), so use num_fragments <= {n}."
    )
  return split_fragments(_leaf_bytes(params), num_fragments)


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


def firing(step: jax.Array, syncs: Sequence[Sync]) -> jax.Array:
  """Which sync fires after ``step`` (0: none; later syncs win)."""
  index = jnp.zeros([], jnp.int32)
  for k, sync in enumerate(syncs):
    index = jnp.where(step % sync.period == sync.phase, k + 1, index)
  return index


def synced_leaves(
  index: jax.Array, syncs: Sequence[Sync], fragments, num_leaves: int
) -> list:
  """One flag per leaf: whether sync ``index`` moves it (0: none does)."""
  synced = [jnp.zeros([], bool)] * num_leaves
  for k, sync in enumerate(syncs):
    for i in fragments[sync.fragment]:
      synced[i] = synced[i] | (index == k + 1)
  return synced
