"""The engine cut in two, for replicas that sync on their own time
(:mod:`shardopt.elastic`).

``update`` (:mod:`.engine`) runs the local step and, on its schedule, a sync
inside one compiled program over the replica axis, so every step of every
replica waits for the slowest. Islands joined by an unreliable link run the
two apart, and this module gives them the engine's own parts to do it:

1. :func:`local_update`: steps 1-3 and 6-8 of :mod:`.engine` with no sync:
   ``count += 1``, the local optimizer's step (restarted after a left-out
   contribution), agn's accumulator. No collective over the replica axis,
   which need not be bound.
2. :func:`due`: which sync of the schedule fires after a step (on the host).
3. :func:`contribution`: step 5a, this replica's contribution to that sync
   (``center - local params``, or agn's accumulated gradients / T).
4. :func:`apply`: steps 5c-5d once the contributions are combined
   (elsewhere: over the islands that take part): the outer optimizer moves
   the center, the sync's leaves of the params land on it.

What the split cannot run (a schedule of groups, overlap, a warm-up of
synchronous steps, ``axis_index_groups``) is refused by :func:`engine_of`
with the reason.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardopt.periodic import checks
from shardopt.periodic import eager as _eager
from shardopt.periodic import engine as _engine
from shardopt.periodic import fragments as _fragments
from shardopt.periodic import outer
from shardopt.periodic.state import PeriodicState

Engine = _engine._Engine


def engine_of(tx: Any, where: str) -> Engine:
  """The engine ``tx`` was built with, if the split can run it; else a
  TypeError/ValueError that names what to change."""
  engine = _engine.engine_of(tx)
  if engine is None:
    raise TypeError(
      f"{where}: expected a transform built by shardopt.diloco,"
      f" shardopt.local_sgd or shardopt.agn itself, got {tx!r}. Pass the"
      " periodic transform directly (not wrapped in optax.chain or"
      " optax.MultiSteps); put other transforms inside it, as its optimizer."
    )
  refusals = {
    "a schedule of groups (hierarchical_local_sgd)": any(
      s.group_size is not None for s in engine.syncs
    ),
    "overlap_steps > 0 or overlap_alpha > 0 (a merge after the sync)": (
      engine.merge is not None or any(s.lag for s in engine.syncs)
    ),
    "warmup_steps > 0 (a warm-up all-reduces every step)": engine.warmup_steps
    > 0,
    "axis_index_groups": engine.axis_index_groups is not None,
    "state_sync_periods (desloc: a sync of the optimizer's moments)": any(
      s.states or not s.params for s in engine.syncs
    ),
    "a gossip exchange (noloco)": engine.exchange is not None,
    "eager=True (per-replica outer steps)": isinstance(
      engine.outer_step, _eager.Eager
    ),
  }
  for what, present in refusals.items():
    if present:
      raise ValueError(
        f"{where}: {engine.name} over axis {engine.axis_name!r} was built"
        f" with {what}, which islands that sync on their own cannot run."
        f" Build {engine.name} without it."
      )
  return engine


def local_update(
  engine: Engine,
  grads: Any,
  state: PeriodicState,
  params: Any,
  extra_args: dict,
):
  """Step 1-3, 6-8 without a sync: ``(updates, state)`` after one local
  step, with no collective over ``engine.axis_name``."""
  if params is None:
    raise ValueError(
      f"{engine.name}: params are required; call"
      " tx.update(grads, state, params)."
    )
  checks.check_local_gradients(
    grads, params, engine.axis_name, engine.name, bound=False
  )
  return _engine.local_only(engine, grads, state, params, extra_args)


def due(engine: Engine, count: int) -> int:
  """Which sync fires after local step ``count`` (1-based, as in
  :func:`.schedules.firing`; 0: none, also before the first step)."""
  if count < 1:
    return 0
  return engine.due(count)


def pieces(engine: Engine, params: Any, sync: int) -> tuple:
  """The pieces (:class:`.fragments.Piece`) of the params sync ``sync``
  (1-based) moves."""
  fragments = _fragments.split(
    params, engine.num_fragments, engine.layer_axes, engine.name
  )
  return fragments[engine.syncs[sync - 1].fragment]


def take(leaves: list, parts: tuple) -> list:
  """The ``parts`` of a list of leaves (all the params' leaves)."""
  return [_fragments.take(leaves[p.leaf], p) for p in parts]


def put(leaves: list, parts: tuple, values: list) -> list:
  """``leaves`` with ``parts`` replaced by ``values``."""
  leaves = list(leaves)
  for p, value in zip(parts, values, strict=True):
    leaves[p.leaf] = _fragments.put(leaves[p.leaf], p, value)
  return leaves


def contribution(
  engine: Engine, sync: int, state: PeriodicState, params
) -> list:
  """Step 5a: this replica's contribution to sync ``sync`` (1-based), one
  array per piece, read from the params as given (after the local step)."""
  parts = pieces(engine, params, sync)
  accumulator = jax.tree.leaves(state.accumulator)
  return engine.contribution.of(
    take(accumulator, parts) if accumulator else [],
    take(jax.tree.leaves(state.center), parts),
    take(jax.tree.leaves(params), parts),
    None,
  )


def apply(
  engine: Engine,
  sync: int,
  state: PeriodicState,
  params: Any,
  combined: list,
  *,
  any_contribution: jax.Array,
  left_out: jax.Array,
  skipped: jax.Array,
  error: list | None = None,
):
  """Steps 5c-5d: the state and params after sync ``sync`` (1-based).

  Args:
    combined: the combined contribution, one array per piece.
    any_contribution: bool scalar; False leaves the center and the outer
      state as they are.
    left_out: bool scalar, this replica's contribution was left out (its
      local state restarts at its next step).
    skipped: int32 scalar, contributions this sync left out.
    error: error feedback's new buffers for the pieces, or None.

  Returns:
    ``(params, state)``: the sync's leaves of the params are the new center.
  """
  parts = pieces(engine, params, sync)
  fragment = engine.syncs[sync - 1].fragment
  treedef = jax.tree.structure(params)
  view = outer.fragment_view(treedef, engine.num_fragments)
  fragmented = engine.num_fragments > 1
  center = jax.tree.leaves(state.center)
  global_state = state.global_state
  new_center, new_global = engine.outer_step.step(
    combined,
    combined,
    take(center, parts),
    global_state[fragment] if fragmented else global_state,
    any_contribution,
    view,
  )
  if fragmented:
    new_global = tuple(
      new_global if f == fragment else g for f, g in enumerate(global_state)
    )
  leaves = jax.tree.leaves(params)
  pulled = [
    c.astype(p.dtype)
    for c, p in zip(new_center, take(leaves, parts), strict=True)
  ]
  accumulator = jax.tree.leaves(state.accumulator)
  if accumulator:
    zeros = [jnp.zeros_like(a) for a in take(accumulator, parts)]
    accumulator = put(accumulator, parts, zeros)
  errors = jax.tree.leaves(state.error)
  if error is not None:
    errors = put(errors, parts, error)
  new_state = state._replace(
    sync_count=state.sync_count + 1,
    accumulator=engine.contribution.state(treedef, accumulator),
    center=treedef.unflatten(put(center, parts, new_center)),
    global_state=new_global,
    skipped=state.skipped + skipped.astype(state.skipped.dtype),
    restart=jnp.reshape(left_out, state.restart.shape),
    error=treedef.unflatten(errors) if errors else state.error,
  )
  return treedef.unflatten(put(leaves, parts, pulled)), new_state
