"""Checks of the periodic family's arguments: the public transforms' (at
construction) and ``update``'s (at trace time, before any state is touched).

Each error names the transform, the bad value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from shardopt import _args
from shardopt import _axes
from shardopt import _shapes
from shardopt.periodic import schedules

# --------------------------------------------------------------------------
# The public transforms' arguments.


def check_period(value: Any, arg: str, transform: str) -> int:
  if not _args.is_integer(value) or int(value) < 1:
    raise ValueError(
      f"{transform}: {arg}={value!r} must be an integer >= 1 (the number of"
      f" local steps between two synchronisations); e.g. {arg}=10."
    )
  return int(value)


def check_axis_name(axis_name: Any, transform: str) -> None:
  if axis_name is None:
    raise ValueError(
      f"{transform}: axis_name=None, but {transform} needs a named axis: the"
      " replicas train apart between synchronisations, so they must be"
      " mapped over a named axis. Call it inside jax.pmap(...,"
      " axis_name='batch') or jax.shard_map over a mesh axis, and pass that"
      " name."
    )


def check_num_fragments(value: Any, sync_period: int, transform: str) -> int:
  if not _args.is_integer(value) or not 1 <= int(value) <= sync_period:
    raise ValueError(
      f"{transform}: num_fragments={value!r} must be an integer with 1 <="
      f" num_fragments <= sync_period={sync_period} (each fragment"
      " synchronises at its own step of the period, and at most one per"
      " step); 1 is plain DiLoCo."
    )
  return int(value)


def check_period_group_sizes(value: Any, transform: str) -> dict:
  """Checks ``{period: group_size}``: non-empty, integers >= 1, both
  strictly increasing in the dict's own order (no sorting)."""
  example = " e.g. period_group_sizes={2: 2, 8: 8}"
  if not isinstance(value, Mapping) or not value:
    raise ValueError(
      f"{transform}: period_group_sizes={value!r} must be a non-empty dict"
      " {period: group_size}: after local step t the largest period that"
      f" divides t averages within contiguous groups of its size;{example}."
    )
  for period, size in value.items():
    for what, v in (("period", period), ("group size", size)):
      if not _args.is_integer(v) or int(v) < 1:
        raise ValueError(
          f"{transform}: period_group_sizes={value!r} has {what} {v!r};"
          f" periods and group sizes must be integers >= 1;{example}."
        )
  items = [(int(p), int(s)) for p, s in value.items()]
  # Each item with the next: the second sequence is one shorter.
  for (p0, s0), (p1, s1) in zip(items, items[1:], strict=False):
    if not (p1 > p0 and s1 > s0):
      raise ValueError(
        f"{transform}: period_group_sizes={value!r}: periods and group sizes"
        " must both be strictly increasing in the order given (a longer"
        f" period averages over a larger group), but {p0}: {s0} is followed"
        f" by {p1}: {s1}. The dict is read in its own order, not sorted;"
        f"{example}."
      )
  return dict(items)


def check_outer_args(
  transform: str, outer_learning_rate: Any, outer_momentum: Any, nesterov: Any
) -> None:
  if not callable(outer_learning_rate) and (
    isinstance(outer_learning_rate, (bool, np.bool_))
    or not isinstance(outer_learning_rate, (int, float, np.number))
    or not outer_learning_rate > 0
  ):
    raise ValueError(
      f"{transform}: outer_learning_rate={outer_learning_rate!r} must be a"
      " positive number (or an optax schedule); DiLoCo uses 0.7."
    )
  if not callable(outer_momentum) and (
    isinstance(outer_momentum, (bool, np.bool_))
    or not isinstance(outer_momentum, (int, float, np.number))
    or not 0 <= outer_momentum < 1
  ):
    raise ValueError(
      f"{transform}: outer_momentum={outer_momentum!r} must be a number in"
      " [0, 1) (or an optax schedule of the outer step, e.g."
      " shardopt.pier_momentum(...)); DiLoCo uses 0.9 (0 turns momentum off)."
    )
  _args.flag(nesterov, "nesterov", transform, "DiLoCo uses True")


# diloco's outer step as its three arguments spell it by default (its
# signature's defaults): Nesterov SGD whose momentum-adjusted rate
# lr / (1 - momentum) is 1, plain averaging's (issue 33's sweep,
# benchmarks/outer_defaults.py and benchmarks/outer_sweep.py).
DEFAULT_OUTER = {
  "outer_learning_rate": 0.8,
  "outer_momentum": 0.2,
  "nesterov": True,
}


class Default:
  """A keyword's default value, told apart from the same value given
  explicitly: ``diloco(..., outer_optimizer=o, outer_learning_rate=0.8)``
  raises although 0.8 is the default. Its repr is the value's, so the
  signature reads ``outer_learning_rate: float = 0.8``."""

  def __init__(self, value: Any):
    self.value = value

  def __repr__(self) -> str:
    return repr(self.value)


# diloco's signature defaults: DEFAULT_OUTER's values, marked as not given.
OUTER_DEFAULTS = {k: Default(v) for k, v in DEFAULT_OUTER.items()}


def given_outer_args(**outer_args: Any) -> dict:
  """The outer_* keywords the caller gave (whatever the value), by name."""
  return {k: v for k, v in outer_args.items() if not isinstance(v, Default)}


def outer_arg(value: Any) -> Any:
  """The value of an outer_* keyword, its default's if it was not given."""
  return value.value if isinstance(value, Default) else value


def check_outer_optimizer(
  transform: str, outer_optimizer: Any, given: dict
) -> None:
  """An optax transform, given instead of (not with) the default's
  spelling: any outer_* keyword in ``given`` (:func:`given_outer_args`)
  raises, whatever its value, the default's included."""
  _axes.check_transform(outer_optimizer, transform, "outer_optimizer")
  if given:
    raise ValueError(
      f"{transform}: outer_optimizer replaces the default outer step that"
      " outer_learning_rate, outer_momentum and nesterov"
      f" spell, but {', '.join(f'{k}={v!r}' for k, v in given.items())}"
      f" {'was' if len(given) == 1 else 'were'} given too (any value"
      " counts, the default's included). Put those settings in the outer"
      " optimizer (e.g. optax.sgd(lr, momentum=m, nesterov=True)) and leave"
      " the three arguments out."
    )


def check_warmup_steps(value: Any, transform: str) -> int:
  if not _args.is_integer(value) or int(value) < 0:
    raise ValueError(
      f"{transform}: warmup_steps={value!r} must be an integer >= 0 (steps"
      " of synchronous training on the mean gradient before the local"
      " steps start; 0, the default, starts them at once)."
    )
  return int(value)


def check_overlap(
  overlap_steps: Any, overlap_alpha: Any, sync_period: int, transform: str
) -> tuple[int, float]:
  """Checks Streaming DiLoCo's ``overlap_steps`` and ``overlap_alpha``."""
  if not _args.is_integer(overlap_steps) or not (
    0 <= int(overlap_steps) < sync_period
  ):
    raise ValueError(
      f"{transform}: overlap_steps={overlap_steps!r} must be an integer with"
      f" 0 <= overlap_steps < sync_period={sync_period} (a fragment merges"
      " its center that many steps after its sync, before its next sync);"
      " the paper overlaps 1 to 5 steps, 0 merges at the sync."
    )
  if (
    isinstance(overlap_alpha, (bool, np.bool_))
    or not isinstance(overlap_alpha, (int, float, np.number))
    or not 0 <= overlap_alpha < 1
  ):
    raise ValueError(
      f"{transform}: overlap_alpha={overlap_alpha!r} must be a number in"
      " [0, 1): after the merge a fragment is overlap_alpha * local params +"
      " (1 - overlap_alpha) * center; 0 (the default) takes the center, the"
      " paper uses 0.5."
    )
  return int(overlap_steps), float(overlap_alpha)


def check_eager(
  transform: str, num_fragments: int, overlap_steps: int, overlap_alpha: float
) -> None:
  """Eager updates overlap the whole outer step (one all-reduce of every
  leaf per sync, applied a sync later): not with Streaming DiLoCo's
  fragments or its merge overlap."""
  given = {
    "num_fragments": (num_fragments, num_fragments > 1, "1"),
    "overlap_steps": (overlap_steps, overlap_steps > 0, "0"),
    "overlap_alpha": (overlap_alpha, overlap_alpha > 0, "0"),
  }
  for arg, (value, bad, fix) in given.items():
    if bad:
      raise ValueError(
        f"{transform}: eager=True with {arg}={value!r}: eager updates"
        " overlap the whole outer step (every leaf's average applied one"
        " sync later, the replica's own outer gradient standing in), not"
        f" Streaming DiLoCo's fragments or merge. Pass {arg}={fix} with"
        " eager=True, or eager=False for Streaming DiLoCo's overlap."
      )


def check_sync_offset(value: Any, sync_period: int, transform: str) -> int:
  """Checks ``diloco``'s ``sync_offset``: an integer in [0, sync_period]
  (``sync_period`` is the same schedule as 0)."""
  if not _args.is_integer(value) or not 0 <= int(value) <= sync_period:
    raise ValueError(
      f"{transform}: sync_offset={value!r} must be an integer with"
      f" 0 <= sync_offset <= sync_period={sync_period} (every sync moves that"
      " many steps later in its period); 0 (the default) puts fragment 0's"
      " sync at the end of each period. To follow torchft's schedule, pass"
      " sync_period // num_fragments - fragment_sync_delay."
    )
  return int(value) % sync_period


# --------------------------------------------------------------------------
# What update is given.


def check_update_args(
  name, grads, state, params, axis_name, syncs, axis_index_groups
):
  """Checks everything ``update`` is given; returns the axis size and each
  sync's replica groups."""
  if params is None:
    raise ValueError(
      f"{name}: params are required; call tx.update(grads, state, params)."
      " At a sync the returned updates move params onto the target, which"
      " needs the current params."
    )
  size = _axes.axis_size(axis_name, name)
  groups = [
    schedules.replica_groups(
      s.group_size, axis_index_groups, size, name, axis_name
    )
    for s in syncs
  ]
  _axes.scalar_counter(state.count, name, "state.count", axis_name)
  check_local_gradients(grads, params, axis_name, name)
  check_params_per_replica(params, axis_name, name)
  center_def = jax.tree.structure(state.center)
  if center_def != jax.tree.structure(params):
    raise ValueError(
      f"{name}: the state does not match the params tree over axis"
      f" {axis_name!r}: state.center has structure {center_def}, params"
      f" have {jax.tree.structure(params)}. Build the state with"
      " tx.init(params) from these params."
    )
  if axis_index_groups is not None and _axes.vma_checked():
    for c in jax.tree.leaves(state.center):
      _, invariant = _axes.split_axes(c, axis_name)
      if invariant:
        raise ValueError(
          f"{name}: with axis_index_groups each group keeps its own center,"
          f" so the center must be typed varying over {axis_name!r}, but it"
          " is invariant (it was initialised from replicated params). Build"
          " the state with tx.init(params) from params that carry a leading"
          f" replica axis sharded over {axis_name!r}, or from"
          f" jax.lax.pcast(params, {axis_name!r}, to='varying')."
        )
  return size, groups


def check_local_gradients(
  grads: Any,
  params: Any,
  axis_name: Any,
  transform: str,
  *,
  bound: bool = True,
) -> None:
  """Checks grads: the params' tree, shapes and float-ness
  (:func:`shardopt._shapes.check_like_params`), floating point, not
  invariant.

  Gradients typed invariant were summed by autodiff: not local gradients.
  ``bound=False``: the axis is not bound where the step runs (an island's
  local step, :mod:`.split`), so there is no invariance to check.
  """
  _shapes.check_like_params(transform, grads, params, axis_name)
  checked = bound and _axes.vma_checked()

  def leaf(path, g):
    _axes.check_float_leaf(path, g, transform, axis_name)
    if not checked:
      return
    _, invariant = _axes.split_axes(g, axis_name)
    if invariant:
      raise ValueError(
        f"{transform}: the gradient at {jax.tree_util.keystr(path) or '<root>'}"
        f" is invariant over axis {_axes.as_axis(invariant)!r}: the params were"
        " replicated (P()), so autodiff has already summed the gradient over"
        " every replica. That is the synchronous gradient, not this"
        f" replica's local gradient, and {transform} needs the local one"
        " (the replicas train apart between synchronisations). Fix: give each"
        " replica its own params, typed varying: a leading replica axis"
        f" sharded over {axis_name!r} (in_specs=P({axis_name!r})), or"
        f" params = jax.lax.pcast(params, {axis_name!r}, to='varying') before"
        " jax.grad."
      )

  jax.tree_util.tree_map_with_path(leaf, grads)


def check_params_per_replica(params: Any, axis_name: Any, transform: str):
  """Raises if a params leaf is typed invariant over every axis of
  ``axis_name`` inside a checking ``jax.shard_map``.

  The replicas of the periodic family train apart between syncs, so their
  params differ: replicated ``P()`` params (the layout of
  ``shardopt.cross_shard``) would get per-replica updates, and JAX's own
  out_specs check would fail later with a hint (``check_vma=False``) that
  hides the problem. Nothing to check under ``jax.pmap`` or
  ``shard_map(check_vma=False)`` (every value is per replica there), nor
  for params varying over the axis (the per-replica blocks of a
  partial-manual, model-parallel shard_map included).
  """
  if not _axes.vma_checked():
    return
  names = _axes.axis_names(axis_name)

  def leaf(path, p):
    if _axes.varying_axes(p) & set(names):
      return
    where = jax.tree_util.keystr(path) or "<root>"
    raise ValueError(
      f"{transform}: the params at {where} are invariant over axis"
      f" {axis_name!r} inside a checking jax.shard_map (replicated,"
      " in_specs=P(), the layout for shardopt.cross_shard), but"
      f" {transform}'s params drift apart between syncs: each replica"
      " trains its own copy, so they must be laid out per replica, typed"
      f" varying over {axis_name!r}. Fix: pass the replicas' copies stacked"
      f" along the first axis with in_specs=P({axis_name!r}) and"
      f" out_specs=P({axis_name!r}), or cast them with params ="
      f" jax.lax.pcast(params, {axis_name!r}, to='varying') before jax.grad"
      " and tx.update and return them per replica;"
      f" shardopt.state_specs(tx, params, {axis_name!r}, mesh=mesh) gives"
      " the state's specs for that layout."
    )

  jax.tree_util.tree_map_with_path(leaf, params)
