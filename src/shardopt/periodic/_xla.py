"""The XLA cost tricks of the periodic engine, in one place.

What they buy (``benchmarks/cost.py``, ``tests/test_schedules.py``): a step
without a sync communicates nothing and, with the params and state donated
(``jax.jit(step, donate_argnums=...)``), XLA copies nothing: every cond's
untaken branch aliases its operands (no branch hands back state it does not
own: :func:`cond_on_slice`, and every new value is computed after the last
read of the buffer it replaces: :func:`after`, :func:`zeros_after`). Without
donation XLA copies what the step leaves unchanged (center, global state)
into fresh output buffers.

XLA does not fuse across a conditional: updates handed through a cond would
be written out and read back by the caller's ``apply_updates``, two passes
over a params-sized buffer that plain optax does not make. So this step's
updates stay out of the conds (:func:`placement` decides): ``agn``'s sync
does not read them, and the others' syncs (whose contribution ``center -
(params + updates)`` does) recompute them in their own branch from the state
before the step; the local step proper then runs after the conds
(:func:`after` orders it) and a select outside the conds
(:func:`.outer.pull_after`) picks per leaf. What a step without a sync adds
to the plain local step is one read of the center in that select (and
``agn``'s accumulator add). The exception: a local optimizer that
communicates (``cross_shard`` inside ``diloco`` across islands) would run its
all-reduce a second time in the sync branch (:func:`communicates` reads
that from its jaxpr), so its updates go through the conds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardopt import _axes
from shardopt.periodic.state import Carry

# --------------------------------------------------------------------------
# Where this step's local updates come from.


class Placement(NamedTuple):
  """Where the local step runs relative to the syncs' conds.

  Attributes:
    before_syncs: the local step runs before the conds (its updates are not
      recomputed in a sync branch); otherwise after them, ordered by
      :func:`after`.
    through_conds: its updates go through the conds, and a sync pulls them
      onto the center inside its branch (:func:`.outer.pull`); otherwise
      :func:`.outer.pull_after` does, outside every cond.
  """

  before_syncs: bool
  through_conds: bool


def placement(reads_updates: bool, local_updates, grads: Any) -> Placement:
  """Where this step's updates come from (see the module docstring).

  A sync that does not read them (``agn``'s): the local step runs before the
  conds and its updates stay outside. A sync that reads them recomputes them
  in its branch, and the local step runs after the conds, unless the local
  optimizer communicates (``local_updates(grads)`` runs a collective): then
  it runs once, before, and its updates go through the conds.
  """
  through = reads_updates and communicates(local_updates, grads)
  return Placement(
    before_syncs=through or not reads_updates, through_conds=through
  )


# Primitives that move data between devices.
_COLLECTIVES = (
  "all_gather",
  "all_to_all",
  "pmax",
  "pmin",
  "ppermute",
  "psum",
  "ragged_all_to_all",
  "reduce_scatter",
)


def communicates(fn, *args) -> bool:
  """Whether ``fn(*args)`` runs a collective (read from its jaxpr)."""

  def walk(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith(_COLLECTIVES):
        return True
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns") and walk(inner):
            return True
    return False

  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


# --------------------------------------------------------------------------
# Ordering: a new value after the last read of the buffer it replaces.


def zeros_after(like: jax.Array, after: jax.Array) -> jax.Array:
  """Zeros shaped like ``like``, computed from the scalar ``after``.

  A restarted accumulator written as ``zeros_like`` has no data dependence on
  the accumulator's last read (the contribution), so XLA cannot write it in
  the accumulator's buffer and copies the accumulator on every step instead.
  Computed from a result of the collective, they come after that read.
  """
  zero = (after * 0).astype(like.dtype)
  return jnp.broadcast_to(zero, like.shape)


def after(tree: Any, scalar: jax.Array) -> Any:
  """``tree``'s values, as data that depends on ``scalar``, so that XLA
  computes what reads them after ``scalar``.

  ``x - 0.0`` is ``x`` for every float (-0.0, inf and NaN included), and
  XLA does not fold a float multiply by zero away.
  """
  zero = scalar.astype(jnp.float32) * 0.0
  return jax.tree.map(lambda x: x - zero.astype(x.dtype), tree)


# --------------------------------------------------------------------------
# Conds whose untaken branch aliases its operands.


def cond(pred: jax.Array, true_fn, false_fn, operands: Any) -> Any:
  """``lax.cond``, its branches typed alike under a checking shard_map (a
  psum turns varying into invariant, a grouped one keeps it varying: both
  are cast to the union of the two) and under Explicit model axes (zeros
  take the sharding of the other branch's leaf)."""
  if not _axes.vma_checked() and not _axes.explicit_axes_present():
    return _axes.grouped(
      lambda: jax.lax.cond(pred, true_fn, false_fn, operands),
      "a sync within groups (hierarchical_local_sgd's levels, or"
      " axis_index_groups)",
    )
  types = [jax.eval_shape(f, operands) for f in (true_fn, false_fn)]
  typed = [
    lambda o, f=f: _axes.cast_tree_like(f(o), *types)
    for f in (true_fn, false_fn)
  ]
  return jax.lax.cond(pred, *typed, operands)


def cond_on_slice(
  pred: jax.Array,
  sync,
  carry: Carry,
  leaves: Sequence[int],
  fragment: int | None,
) -> Carry:
  """``sync`` on ``leaves`` (and global state ``fragment``) if ``pred``.

  A ``lax.cond`` whose operands are only what the sync may change: the
  fragment's slice of the carry, so that no branch hands back leaves it does
  not own (XLA copies such pass-through outputs of a multi-branch
  conditional), and the other branch returns its operands unchanged.
  """
  part = carry._replace(
    **{
      field: [getattr(carry, field)[i] for i in leaves]
      if getattr(carry, field)
      else []
      for field in Carry.PER_LEAF
    },
    global_state=carry.global_state
    if fragment is None
    else carry.global_state[fragment],
  )
  part = cond(pred, sync, lambda c: c, part)

  def scatter(full: list, new: list) -> list:
    if not full:  # a field this engine does not carry (no accumulator)
      return full
    full = list(full)
    for i, x in zip(leaves, new, strict=True):
      full[i] = x
    return full

  global_state = part.global_state
  if fragment is not None:
    global_state = tuple(
      part.global_state if f == fragment else g
      for f, g in enumerate(carry.global_state)
    )
  return part._replace(
    **{
      field: scatter(getattr(carry, field), getattr(part, field))
      for field in Carry.PER_LEAF
    },
    global_state=global_state,
  )
