"""The engine behind ``agn``, ``local_sgd``, ``diloco`` and
``hierarchical_local_sgd``.

Every replica trains on its own params with a local optimizer. The engine is
built from three parts: a *schedule* (:mod:`.schedules`: which fragment of
the params (:mod:`.fragments`) synchronises, over which groups of replicas,
after which local step), a
*contribution* (:mod:`.contributions`: what each replica brings to a sync)
and an *outer step* (:mod:`.outer`: how the combined contributions move the
shared center). ``update`` runs these steps, one call each:

1. :func:`_count`: ``count += 1``, checked replicated; :func:`_warm_up`:
   during a warm-up, the mean gradient, and the center follows the params.
2. :func:`_local_step_before`: where :func:`._xla.placement` puts it before
   the syncs, the local optimizer's step on this replica's params
   (:func:`_local_step`; a replica left out of the last sync first restarts
   its local state).
3. :func:`_start`: the carry the syncs may change, with
   ``contribution.accumulate`` (``accumulator += grads``, ``agn`` only).
4. :func:`.schedules.firing`: the index of the sync that fires after this
   step (0: none), read from the replicated counter.
5. :func:`_syncs`: one ``lax.cond`` per sync (:func:`._xla.cond_on_slice`)
   on ``index == k``: at most one fires per step. Its operands are the
   sync's fragment of the carry; its false branch hands them back, its true
   branch (:func:`_sync`) is the only place the engine communicates:

   a. ``contribution.of``: this replica's contribution for the sync's pieces
      (accumulated gradients / period, ``center - local params``, or the
      local params themselves; a sync run a step late, with overlap, reads
      the params as given);
   b. :func:`.combine.combine`: one collective round within the sync's
      groups, a non-finite contribution left out (flagged to restart, step 2);
   c. ``outer_step.step``: the outer optimizer moves the center (for plain
      averaging the combined params are the new center);
   d. :func:`.outer.pull` (only where this step's updates go through the
      conds): updates that move the synced leaves onto the center.
   e. DES-LOC (``Sync.states``): the local state's fields the sync names
      (:mod:`.moments`, after this step's local step, which then runs
      before the conds) ride in the same round as its contribution and are
      replaced by their mean; a sync with ``params=False`` moves them alone.

6. :func:`_local_step_after`: where it runs after the syncs, the local step
   (ordered after them by :func:`._xla.after`).
7. :func:`_updates`: updates onto the center for the elements a sync moved
   (:func:`.outer.pull_after`), or with overlap onto the mix of params and
   center for the fragment whose merge is due (:class:`.outer.Merge`), the
   local optimizer's for the others.
8. :func:`_new_state`: the :class:`.state.PeriodicState` after the step.

What a step costs, and the tricks that keep a step without a sync as cheap
as the plain local step, are in :mod:`._xla`.

With ``sync=k`` (the host's choice, :func:`shardopt.due`), ``update`` builds
one program: ``k = 0`` is :func:`local_only` (steps 1-3 and 6-8, no cond, no
collective, no read of the center), checked against the counter
(:func:`_host_local`); otherwise the steps above with sync ``k`` alone in
step 5 (a merge or a warm-up step: none), its cond on the counter, so that
the numbers are the in-graph schedule's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shardopt import _axes
from shardopt import _host_schedule
from shardopt import wire
from shardopt._host_schedule import WARM_UP
from shardopt.collectives import reduce_for
from shardopt.periodic import _xla
from shardopt.periodic import checks
from shardopt.periodic import combine
from shardopt.periodic import contributions
from shardopt.periodic import fragments as _fragments
from shardopt.periodic import moments as _moments
from shardopt.periodic import outer
from shardopt.periodic import schedules
from shardopt.periodic.state import Carry
from shardopt.periodic.state import PeriodicState
from shardopt.periodic.state import initial_flags
from shardopt.wire import feedback


@dataclasses.dataclass(frozen=True, eq=False)
class _Engine:
  """What :func:`periodic` was built with."""

  name: str
  optimizer: optax.GradientTransformation
  local: optax.GradientTransformationExtraArgs
  axis_name: Any
  syncs: Sequence[schedules.Sync]
  contribution: contributions.Contribution
  outer_step: outer.OuterStep
  reduction: str
  axis_index_groups: Any
  wire: wire.Wire
  num_fragments: int
  layer_axes: Any
  error_feedback: bool
  # For steps 1..warmup_steps: the mean gradient, the center follows.
  warmup_steps: int
  # Streaming DiLoCo's overlap: when each fragment rejoins the center
  # (schedules.merges) and how (outer.Merge); () and None without overlap.
  merges: Sequence[schedules.Sync]
  merge: Any  # outer.Merge or None
  # Skips counted over the whole axis keep `skipped` replicated; a schedule
  # of contiguous groups (hierarchical) counts within them (per replica).
  whole_axis_count: bool
  # In place of combine.combine: a round that is not an all-reduce
  # (NoLoCo's gossip with one peer, .gossip.Exchange); None: combine.
  exchange: Any = None

  # The host schedule (shardopt.due, shardopt._host_schedule.Scheduled): a
  # step's program is a sync k (0: none) and a merge m (0: none), as one int
  # k + (len(syncs) + 1) * m, or WARM_UP.

  def due(self, t: int) -> int:
    """The program of update ``t`` (1, 2, ...), chosen on the host."""
    if t <= self.warmup_steps:
      return WARM_UP
    sync = schedules.firing(t, self.syncs, self.warmup_steps)
    merge = schedules.firing(t, self.merges, self.warmup_steps)
    return sync + (len(self.syncs) + 1) * merge

  def expected(self, count: jax.Array) -> jax.Array:
    """:meth:`due` in the graph, from the counter after the step."""
    count = jnp.reshape(count, ())
    code = schedules.firing(count, self.syncs, self.warmup_steps)
    if self.merges:
      merge = schedules.firing(count, self.merges, self.warmup_steps)
      code = code + (len(self.syncs) + 1) * merge
    if self.warmup_steps:
      code = jnp.where(count <= self.warmup_steps, WARM_UP, code)
    return code

  def decode(self, code: int) -> tuple[int, int]:
    """``(sync, merge)`` of a program :meth:`due` returned (valid or a
    ValueError naming the fix)."""
    if code == WARM_UP and self.warmup_steps:
      return 0, 0  # the warm-up's own conds, no sync
    slots = len(self.syncs) + 1
    sync, merge = code % slots, code // slots
    if code < 0 or merge > len(self.merges):
      raise _host_schedule.bad_value(self.name, code, self)
    return sync, merge

  def programs(self) -> str:
    """The values of :meth:`due`, in words."""
    syncs = len(self.syncs)
    words = "0 (the local step alone), " + (
      "1 (the sync)" if syncs == 1 else f"1..{syncs} (sync k of the schedule)"
    )
    if self.merges:
      words += (
        f", m * {syncs + 1} (+ a sync k) for the merge of fragment m after"
        " an overlap"
      )
    if self.warmup_steps:
      words += f", {WARM_UP} (a warm-up step)"
    return words


class _Step(NamedTuple):
  """One call of ``update``: its inputs, and what is read from them when it
  is traced."""

  engine: _Engine
  grads: Any
  state: PeriodicState
  params: Any
  extra_args: dict
  size: int  # of the replica axis
  groups: list  # each sync's replica groups
  fragments: tuple  # the pieces of each fragment (.fragments.Piece)
  leaves: list  # the params' leaves
  treedef: Any
  view: Any  # what the outer optimizer sees of a list of leaves
  placement: _xla.Placement
  # DES-LOC: per state field a sync may average, the indices of its leaves
  # in jax.tree.leaves(local_state) ({} without state syncs).
  moments: dict
  # The local step of this call, jitted: see :meth:`local_step`.
  jitted_local_step: Any

  def local_step(self, grads: Any):
    """The local optimizer's step (:func:`_local_step`) on ``grads``.

    A step needs it several times: where it runs, in each sync's branch
    that recomputes it (:mod:`._xla`) and once more to read whether it
    communicates. As one ``jax.jit`` per ``update`` call, it is traced once
    and the other calls reuse that trace (NoLoCo with 4 matchings traced it
    6 times, one sync 3 times: ``tests/test_periodic.py``); XLA inlines the
    calls, so the compiled program is the same.
    """
    return self.jitted_local_step(grads, self.state, self.params)


def _check(engine: _Engine, grads, state, params) -> tuple:
  """:func:`.checks.check_update_args` for this engine: the axis size and
  each sync's replica groups."""
  return checks.check_update_args(
    engine.name,
    grads,
    state,
    params,
    engine.axis_name,
    engine.syncs,
    engine.axis_index_groups,
  )


def _trace(engine: _Engine, grads, state, params, extra_args) -> _Step:
  """Checks what ``update`` is given and reads its static parts."""
  size, groups = _check(engine, grads, state, params)
  fragments = _fragments.split(
    params, engine.num_fragments, engine.layer_axes, engine.name
  )
  leaves, treedef = jax.tree.flatten(params)
  step = _Step(
    engine=engine,
    grads=grads,
    state=state,
    params=params,
    extra_args=extra_args,
    size=size,
    groups=groups,
    fragments=fragments,
    leaves=leaves,
    treedef=treedef,
    view=outer.fragment_view(treedef, engine.num_fragments),
    placement=None,
    moments=_state_syncs(engine, state.local_state),
    jitted_local_step=jax.jit(
      functools.partial(
        _local_step, engine.optimizer, engine.local, extra_args=extra_args
      )
    ),
  )
  # A sync run a step late (overlap) reads the params it is given, not
  # this step's updates. A warm-up's cond reads them (it recomputes them,
  # as a sync does; with the local step placed before it, XLA copies the
  # local state).
  reads_updates = engine.warmup_steps > 0 or (
    engine.contribution.reads_updates and any(s.lag == 0 for s in engine.syncs)
  )
  if step.moments:
    # A sync that averages moments reads the local state after this step's
    # local step: it runs first, its updates and state through the conds.
    return step._replace(placement=_xla.Placement(True, True))
  return step._replace(
    placement=_xla.placement(
      reads_updates,
      lambda g: step.local_step(g)[0],
      grads,
    )
  )


def _state_syncs(engine: _Engine, local_state) -> dict:
  """DES-LOC: the local state's leaves each state field of the schedule
  names (:mod:`.moments`), checked; {} without state syncs."""
  names = list(dict.fromkeys(n for s in engine.syncs for n in s.states))
  if not names:
    return {}
  _moments.check(local_state, names, engine.name)
  return _moments.indices(local_state, names)


# --------------------------------------------------------------------------
# The steps of update, in order.


def _count(step: _Step) -> jax.Array:
  """Step 1: ``count += 1``; the syncs' predicates read it, so it must be
  replicated."""
  count = step.state.count + 1
  _axes.check_replicated_predicate(count, step.engine.name)
  return count


def _warm_up(step: _Step, count: jax.Array) -> tuple[_Step, list, jax.Array]:
  """Step 1b, with ``warmup_steps=W``: for steps 1..W the local optimizer
  gets the mean gradient over the axis (a synchronous data-parallel step,
  so the replicas stay identical) and the center follows the params.

  Two conds on ``count <= W``, so that later steps run neither the
  all-reduce nor the center's write: one for the gradient, one for the
  center, which recomputes this step's local params in its branch from the
  state before the step (as a sync does, see :mod:`._xla`). The local step
  proper reads a gradient ordered after the second (:func:`._xla.after`),
  so it overwrites its state in place after that read. Returns the step
  with the gradient it trains on, the center's leaves and the sync count
  (handed through the second cond, which orders what reads it).
  """
  engine = step.engine
  center = jax.tree.leaves(step.state.center)
  if not engine.warmup_steps:
    return step, center, step.state.sync_count
  warm = jnp.reshape(count, ()) <= engine.warmup_steps
  grads = _xla.cond(
    warm,
    lambda g: reduce_for(
      engine.name,
      g,
      engine.axis_name,
      reduction="mean",
      axis_index_groups=step.groups[0],
    ),
    lambda g: g,
    step.grads,
  )
  step = step._replace(grads=grads)

  def follow(operands):
    center, order = operands
    updates = step.local_step(step.grads)[0]
    local = [
      optax.apply_updates(p, u)
      for p, u in zip(step.leaves, updates, strict=True)
    ]
    return [
      x.astype(c.dtype) for x, c in zip(local, center, strict=True)
    ], order

  center, order = _xla.cond(
    warm, follow, lambda o: o, (center, step.state.sync_count)
  )
  return step._replace(grads=_xla.after(grads, order)), center, order


def _local_step(optimizer, local, grads, state, params, extra_args):
  """The local optimizer's step on this replica's params.

  A replica left out of the last sync (``state.restart``) first restarts the
  float leaves of its local state (moments, which may hold the non-finite
  values) from ``optimizer.init(params)``; integer leaves (step counts) are
  kept. A select on the step's inputs, which XLA fuses into the step: a
  restart written into the state at the sync, after the local step, would
  keep XLA from fusing the local step with the caller's ``apply_updates``.
  """
  fresh = _axes.cast_tree_like(optimizer.init(params), state.local_state)
  local_state = jax.tree.map(
    lambda old, new: (
      jnp.where(jnp.reshape(state.restart, ()), new, old)
      if jnp.issubdtype(old.dtype, jnp.floating)
      else old
    ),
    state.local_state,
    fresh,
  )
  updates, local_state = local.update(grads, local_state, params, **extra_args)
  # Updates are in the params' dtype on every step (a sync step's updates
  # are target - params), so both branches of a cond agree even when the
  # gradients are narrower (bfloat16 grads for float32 params).
  updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
  return jax.tree.leaves(updates), local_state


def _local_step_before(step: _Step):
  """Step 2: the local step, if it runs before the syncs (else None)."""
  if step.placement.before_syncs:
    return step.local_step(step.grads)
  return None


def _start(step: _Step, before, count, center: list, sync_count) -> Carry:
  """Step 3: what the syncs may change, the accumulator after this step's
  gradients (not a warm-up step's)."""
  state = step.state
  grads = step.grads
  if step.engine.warmup_steps:
    warm = jnp.reshape(count, ()) <= step.engine.warmup_steps
    grads = jax.tree.map(lambda g: jnp.where(warm, jnp.zeros_like(g), g), grads)
  local_leaves = jax.tree.leaves(before[1]) if step.moments else []
  return Carry(
    updates=before[0] if step.placement.through_conds else [],
    accumulator=step.engine.contribution.accumulate(state.accumulator, grads),
    center=center,
    error=jax.tree.leaves(state.error),
    global_state=state.global_state,
    sync_count=sync_count,
    skipped=state.skipped,
    left_out=jnp.zeros([], bool),
    moments={
      name: [local_leaves[i] for i in found]
      for name, found in step.moments.items()
    },
  )


def _syncs(step: _Step, index: jax.Array, carry: Carry, only=None) -> Carry:
  """Step 5: each sync in its own cond, on its fragment's slice (with
  ``only``, the host's choice: sync ``only`` alone, 0 for none)."""
  engine = step.engine
  for k, s in enumerate(engine.syncs):
    if only is not None and k + 1 != only:
      continue
    carry = _xla.cond_on_slice(
      index == k + 1,
      functools.partial(_sync, step, k),
      carry,
      _fragments.leaves_of(step.fragments[s.fragment]) if s.params else [],
      s.fragment if engine.num_fragments > 1 else None,
    )
  return carry


def _sync(step: _Step, k: int, part: Carry) -> Carry:
  """Steps 5a-5d: sync ``k`` on its fragment's slice of the carry."""
  engine = step.engine
  sync = engine.syncs[k]
  pieces = step.fragments[sync.fragment] if sync.params else ()
  take, put = _piecewise(pieces)
  params = [_fragments.take(step.leaves[p.leaf], p) for p in pieces]
  center = take(part.center)
  accumulator = take(part.accumulator) if part.accumulator else []
  mine = engine.contribution.of(
    accumulator, center, params, _sync_updates(step, sync, part, pieces)
  )
  # DES-LOC: the state fields this sync averages ride in the same round.
  moments = [x for name in sync.states for x in part.moments[name]]
  if engine.exchange is not None:  # NoLoCo: one peer, no all-reduce
    combined, finite, in_group, in_axis, error = engine.exchange(
      mine + moments, k, step.size
    )
  else:
    combined, finite, in_group, in_axis, error = combine.combine(
      mine + moments,
      engine.axis_name,
      step.groups[k],
      reduction=engine.reduction,
      wire=engine.wire,
      whole_axis_count=engine.whole_axis_count,
      transform=engine.name,
      error=take(part.error) if part.error else None,
    )
  combined, averaged = combined[: len(mine)], combined[len(mine) :]
  global_state = part.global_state
  if sync.params:
    center, global_state = engine.outer_step.step(
      combined, mine, center, part.global_state, in_group > 0, step.view
    )
  updates = part.updates
  if updates and engine.merge is None:
    updates = put(updates, outer.pull(center, params))
  return Carry(
    updates=updates,
    accumulator=put(
      part.accumulator, [_xla.zeros_after(a, in_group) for a in accumulator]
    ),
    center=put(part.center, center),
    error=put(part.error, error) if part.error else [],
    global_state=global_state,
    sync_count=part.sync_count + 1,
    skipped=_skipped(step, k, part.skipped, in_axis),
    left_out=jnp.logical_not(finite),
    moments=_averaged(sync, part.moments, averaged, in_group),
  )


def _averaged(sync, moments: dict, averaged: list, in_group) -> dict:
  """The state fields after sync ``sync``: its own replaced by their
  average (kept as they are if no replica of the group was finite)."""
  out, at = dict(moments), 0
  for name in sync.states:
    mine = moments[name]
    new = averaged[at : at + len(mine)]
    at += len(mine)
    out[name] = [
      jnp.where(in_group > 0, a, m).astype(m.dtype)
      for a, m in zip(new, mine, strict=True)
    ]
  return out


def _piecewise(pieces: Sequence[_fragments.Piece]):
  """``take(leaves)``: the pieces of a list of the fragment's leaves (as a
  cond hands them to a sync); ``put(leaves, values)``: the leaves with the
  pieces replaced."""
  slot = {leaf: j for j, leaf in enumerate(_fragments.leaves_of(pieces))}

  def take(leaves: list) -> list:
    return [_fragments.take(leaves[slot[p.leaf]], p) for p in pieces]

  def put(leaves: list, values: list) -> list:
    if not leaves:  # a field this engine does not carry (no accumulator)
      return []
    leaves = list(leaves)
    for p, value in zip(pieces, values, strict=True):
      leaves[slot[p.leaf]] = _fragments.put(leaves[slot[p.leaf]], p, value)
    return leaves

  return take, put


def _sync_updates(step: _Step, sync, part: Carry, pieces) -> list | None:
  """This step's local updates of a sync's pieces, where its contribution
  reads them: handed through the conds, or recomputed from the state before
  the step (see :mod:`._xla`). None for a sync run a step late (overlap),
  which reads the params as given."""
  if sync.lag:
    return None
  if not pieces:  # a sync of state fields alone (DES-LOC)
    return []
  if part.updates:
    return _piecewise(pieces)[0](part.updates)
  if not step.engine.contribution.reads_updates:
    return []
  local = step.local_step(step.grads)[0]
  return [_fragments.take(local[p.leaf], p) for p in pieces]


def _skipped(step: _Step, k: int, skipped, in_axis) -> jax.Array:
  """``skipped`` plus the contributions sync ``k`` left out."""
  size = step.size
  if not step.engine.whole_axis_count:
    size = _axes.group_size(step.groups[k], size)
  return skipped + jnp.round(size - in_axis).astype(jnp.int32)


def _local_step_after(step: _Step, before, carry: Carry):
  """Step 6: the local step, if it runs after the syncs.

  The syncs read the local state before this step; the local step, which
  overwrites it in place, reads grads that depend on the syncs, so XLA runs
  it after them (else it copies the state).
  """
  if step.moments:
    leaves, treedef = jax.tree.flatten(before[1])
    for name, found in step.moments.items():
      for i, x in zip(found, carry.moments[name], strict=True):
        leaves[i] = x
    return before[0], treedef.unflatten(leaves)
  if step.placement.before_syncs:
    return before
  return step.local_step(_xla.after(step.grads, carry.sync_count))


def _updates(step: _Step, count, index, carry: Carry, updates: list) -> list:
  """Step 7: the updates this step returns."""
  engine = step.engine
  if step.placement.through_conds:
    if engine.merge is None:
      return carry.updates  # pulled inside the sync's branch
    updates = carry.updates
  shapes = [jnp.shape(p) for p in step.leaves]
  synced = schedules.synced_leaves(index, engine.syncs, step.fragments, shapes)
  if engine.merge is None:
    return outer.pull_after(synced, carry.center, step.leaves, updates)
  merging = schedules.synced_leaves(
    schedules.firing(count, engine.merges, engine.warmup_steps),
    engine.merges,
    step.fragments,
    shapes,
  )
  return engine.merge.updates(
    synced, merging, carry.left_out, carry.center, step.leaves, updates
  )


def _new_state(step: _Step, count, carry: Carry, local_state) -> PeriodicState:
  """Step 8: the state after the step."""
  return PeriodicState(
    count=count,
    sync_count=carry.sync_count,
    accumulator=step.engine.contribution.state(step.treedef, carry.accumulator),
    center=step.treedef.unflatten(carry.center),
    local_state=local_state,
    global_state=carry.global_state,
    skipped=carry.skipped,
    restart=jnp.reshape(carry.left_out, (1,)),
    error=step.treedef.unflatten(carry.error) if carry.error else (),
  )


# --------------------------------------------------------------------------
# The host's program (``sync=``, :func:`shardopt.due`).


def local_only(engine: _Engine, grads, state, params, extra_args):
  """Steps 1-3 and 6-8 with no sync: ``count += 1``, the local optimizer's
  step (restarted after a left-out contribution), ``agn``'s accumulator.
  Returns ``(updates, state)``; runs no collective, so the replica axis
  need not be bound (an island's local step, :mod:`.split`)."""
  updates, local_state = _local_step(
    engine.optimizer, engine.local, grads, state, params, extra_args
  )
  treedef = jax.tree.structure(params)
  accumulator = engine.contribution.accumulate(state.accumulator, grads)
  return treedef.unflatten(updates), state._replace(
    count=state.count + 1,
    accumulator=engine.contribution.state(treedef, accumulator),
    local_state=local_state,
    restart=jnp.zeros_like(state.restart),
  )


def _host_check(engine: _Engine, code: int, state, communicates: bool):
  """Whether the state's counter asks for program ``code`` too (see
  :func:`.._host_schedule.check`)."""
  before = jnp.reshape(state.count, ())
  return _host_schedule.check(
    code,
    engine.expected(before + 1),
    before,
    name=engine.name,
    t_hint="t = state.count + 1",
    communicates=communicates,
  )


def _host_local(engine: _Engine, grads, state, params, extra_args):
  """``sync=0``: :func:`local_only`, checked against the counter; no
  conditional, no collective, no read of the center. Where the counter
  asks for another program, the counter is marked and the updates are
  NaN (:func:`.._host_schedule.mark`)."""
  _check(engine, grads, state, params)
  ok = _host_check(engine, 0, state, communicates=False)
  updates, new_state = local_only(engine, grads, state, params, extra_args)
  return _host_schedule.poison(ok, updates), new_state._replace(
    count=_host_schedule.mark(ok, new_state.count)
  )


# --------------------------------------------------------------------------
# The engine.


def _init(params, *, engine: _Engine) -> PeriodicState:
  """The engine's ``init``: counters at 0, the center at ``params``, the
  local and outer optimizers' states (one outer state per fragment)."""
  fragments = _fragments.split(
    params, engine.num_fragments, engine.layer_axes, engine.name
  )
  leaves, treedef = jax.tree.flatten(params)
  view = outer.fragment_view(treedef, engine.num_fragments)
  global_state = engine.outer_step.init(params, fragments, view)
  local_state = engine.optimizer.init(params)
  _state_syncs(engine, local_state)  # DES-LOC's fields exist
  skipped, restart = initial_flags(
    leaves, engine.axis_name, engine.whole_axis_count
  )
  return PeriodicState(
    count=jnp.zeros([], jnp.int32),
    sync_count=jnp.zeros([], jnp.int32),
    accumulator=engine.contribution.init(params),
    center=jax.tree.map(jnp.asarray, params),
    local_state=local_state,
    global_state=global_state,
    skipped=skipped,
    restart=restart,
    error=treedef.unflatten(feedback.zeros(leaves, engine.axis_name))
    if engine.error_feedback
    else (),
  )


def periodic(
  name: str,
  optimizer: optax.GradientTransformation,
  axis_name: Any,
  *,
  syncs: Sequence[schedules.Sync],
  contribution: contributions.Contribution,
  outer_step: outer.OuterStep,
  reduction: str = "mean",
  axis_index_groups=None,
  comm_dtype=None,
  num_fragments: int = 1,
  layer_axes: Any = None,
  merges: Sequence[schedules.Sync] = (),
  merge: outer.Merge | None = None,
  error_feedback: bool = False,
  warmup_steps: int = 0,
  exchange: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """The engine: ``optimizer`` every step, the ``syncs`` on their schedule.

  Args:
    name: the public transform's name, used in error messages.
    optimizer: the local optimizer, applied on every replica at every step.
    axis_name: the replica axis (or tuple of axes).
    syncs: the schedule (see :class:`.schedules.Sync`); validated by the
      caller.
    contribution: what each replica brings to a sync (:mod:`.contributions`).
    outer_step: how the combined contributions move the center
      (:mod:`.outer`).
    reduction: how contributions combine across replicas.
    axis_index_groups: optional groups for syncs without a ``group_size``;
      each group keeps its own center.
    comm_dtype: optional wire dtype of the contributions, floating or
      quantized; the finite flag and counts always travel in float32.
    num_fragments: how many fragments the params are split into
      (:mod:`.fragments`).
    layer_axes: per leaf, its stacked layer axis or None (a pytree prefix
      of the params): fragments of layers (:func:`.fragments.split`).
    merges: with ``merge``: when each fragment rejoins the center
      (:func:`.schedules.merges`).
    merge: how the params rejoin the center after a sync run with overlap
      (:class:`.outer.Merge`); None: pulled onto it at the sync.
    error_feedback: keep what a quantized wire drops from each replica's
      contribution (``state.error``) and add it to its next one.
    warmup_steps: steps of synchronous training (the mean gradient, the
      center following the params) before the schedule starts; validated
      by the caller.
    exchange: a round in place of :func:`.combine.combine` (called as
      ``exchange(mine, k, axis_size)`` for sync ``k`` of ``syncs``, 0-based,
      returning what ``combine``
      returns), e.g. NoLoCo's gossip (:class:`.gossip.Exchange`); skips are
      then counted per replica. None: the all-reduce of ``combine``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`PeriodicState`.
  """
  _axes.check_transform(optimizer, name)
  outer_step.check(name)
  _axes.check_reduction(reduction, name, axis_name)
  on_wire = wire.of(comm_dtype, name, axis_name)
  engine = _Engine(
    name=name,
    optimizer=optimizer,
    local=optax.with_extra_args_support(optimizer),
    axis_name=axis_name,
    syncs=tuple(syncs),
    contribution=contribution,
    outer_step=outer_step,
    reduction=reduction,
    axis_index_groups=axis_index_groups,
    wire=on_wire,
    num_fragments=num_fragments,
    layer_axes=layer_axes,
    error_feedback=feedback.check(error_feedback, on_wire, name, axis_name),
    merges=tuple(merges),
    merge=merge,
    warmup_steps=warmup_steps,
    whole_axis_count=schedules.counts_whole_axis(syncs) and exchange is None,
    exchange=exchange,
  )

  def update_fn(grads, state, params=None, **extra_args):
    code = _host_schedule.take_sync(extra_args, name, engine)
    only = None  # the in-graph schedule: every sync in its cond
    if code is not None:
      if code == 0:
        return _host_local(engine, grads, state, params, extra_args)
      only, _ = engine.decode(code)
      ok = _host_check(engine, code, state, communicates=True)
    step = _trace(engine, grads, state, params, extra_args)
    count = _count(step)
    step, center, sync_count = _warm_up(step, count)
    before = _local_step_before(step)
    carry = _start(step, before, count, center, sync_count)
    scalar_count = jnp.reshape(count, ())
    index = schedules.firing(scalar_count, engine.syncs, engine.warmup_steps)
    carry = _syncs(step, index, carry, only)
    updates, local_state = _local_step_after(step, before, carry)
    updates = _updates(step, scalar_count, index, carry, updates)
    new_state = _new_state(step, count, carry, local_state)
    if code is not None and not _host_schedule.can_raise():
      # Marked where the host disagreed, as _host_local does (a poison
      # only where no callback raised: its select would round the caller's
      # add apart from the in-graph schedule's).
      updates = _host_schedule.poison(ok, updates)
      new_state = new_state._replace(
        count=_host_schedule.mark(ok, new_state.count)
      )
    return step.treedef.unflatten(updates), new_state

  # What the transform was built with, for shardopt.due and
  # shardopt.elastic (.split, which runs the local step and the syncs apart):
  # read through engine_of.
  _host_schedule.attach(update_fn, engine)
  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, engine=engine), update_fn
  )


def engine_of(tx: Any) -> _Engine | None:
  """The engine ``tx`` itself was built with (None if it is not a periodic
  transform)."""
  engine = _host_schedule.attached(tx)
  return engine if isinstance(engine, _Engine) else None
