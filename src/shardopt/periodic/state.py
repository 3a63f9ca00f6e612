"""The state of the periodic family: :class:`PeriodicState` (what the transforms
keep between steps; ``AGNState``, its first name, is the same class) and
:class:`Carry` (what a sync may change within one).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from shardopt import _axes


class PeriodicState(NamedTuple):
  """State of :func:`agn`, :func:`local_sgd`, :func:`diloco` and
  :func:`hierarchical_local_sgd`.

  Every field is an array (or a pytree of arrays), so a checkpoint taken in
  the middle of a communication period restores and continues bit-identically
  (``jax.tree.map(np.asarray, state)`` round-trips).

  Attributes:
    count: int32 scalar, local steps taken (the same on every replica).
    sync_count: int32 scalar, synchronisations done (TensorFlow's global step
      of the center variables); one collective round each. With
      ``num_fragments`` every fragment's sync counts once.
    accumulator: the sum of this replica's gradients since the last sync,
      float32 for low-precision gradients (``agn`` only; the others keep an
      empty tuple here: their contribution is read from the params at the
      sync step).
    center: the shared params every replica is pulled onto at a sync,
      bit-identical on every replica (within a group with
      ``axis_index_groups``). For ``hierarchical_local_sgd``, which averages
      the params directly, the last average of this replica's group (the
      initial params before the first sync), bit-identical within the group.
      Per replica, and different on each, for ``noloco`` (each replica's
      slow weights) and ``diloco(..., eager=True)`` (each moves by its own
      outer gradient).
    local_state: this replica's state of the local ``optimizer``.
    global_state: the global optimizer's state (for the center), the same on
      every replica (within a group). With ``num_fragments=F > 1`` a tuple of
      ``F`` states, fragment ``f``'s over the list of its leaves. An empty
      tuple for ``hierarchical_local_sgd``. Per replica for ``noloco`` (its
      outer momentum) and ``diloco(..., eager=True)`` (the outer state and
      the buffer of the others' delayed outer gradients).
    skipped: int32 scalar, how many replica contributions were left out of a
      combination because they were not finite, summed over all syncs and
      over the whole axis (for ``hierarchical_local_sgd``: over this
      replica's groups, so it can differ between groups; there it has shape
      (1,), one row per replica like ``restart``; likewise for ``noloco``,
      over this replica's pairs).
    restart: bool of shape (1,), this replica's own (one row per replica, like
      the params: ``P(axis)`` in a shard_map's specs): its contribution was
      left out of the last sync (not finite), so its local state, which may
      hold the non-finite values, restarts from ``optimizer.init(params)``
      (float leaves; step counts are kept) at the start of its next step.
    error: with ``error_feedback=True`` (a quantized ``comm_dtype``): float32,
      this replica's own, in the params' shape: what the quantized wire
      dropped from its last contribution to each leaf's sync (its phase-1
      quantization, plus, on the chunk it owns, the phase-2 requantization),
      added to its next contribution. Varying like the params (``P(axis)``
      under ``jax.shard_map``). An empty tuple without error feedback.
  """

  count: chex.Array
  sync_count: chex.Array
  accumulator: Any
  center: Any
  local_state: Any
  global_state: Any
  skipped: chex.Array
  restart: chex.Array
  error: Any = ()


# The name from TensorFlow's AGNOptimizer, which the family grew from; the same
# class, so isinstance checks and restored checkpoints are unchanged.
AGNState = PeriodicState


class Carry(NamedTuple):
  """What a sync may change, threaded through the syncs' conds of one step.

  The per-leaf fields are lists in ``jax.tree.leaves`` order; a sync's cond
  sees only its fragment's slice of them (:func:`._xla.cond_on_slice`).
  """

  updates: list  # this step's updates, only where they go through the conds
  accumulator: list  # agn's accumulator (empty for the others)
  center: list
  error: list  # error feedback's buffers (empty without it)
  global_state: Any
  sync_count: jax.Array
  skipped: jax.Array
  left_out: jax.Array  # bool: this replica's contribution was left out
  # DES-LOC: per local-state field a sync may average, its leaves after this
  # step's local step ({} without state syncs); handed whole to every cond.
  moments: dict = {}

  PER_LEAF = ("updates", "accumulator", "center", "error")


def initial_flags(leaves: list, axis_name: Any, whole_axis_count: bool):
  """The initial ``skipped`` and ``restart``, typed as the syncs will make
  them under a checking shard_map: varying over the axes the params vary
  over (other than the engine's own axis, unless it counts skips within
  groups; ``restart`` is always this replica's), so that a ``lax.scan`` can
  carry the state."""
  # Counted within groups, skips are this replica's own: shape (1,), like
  # ``restart``, so that the state lays out as concatenated P(axis) blocks.
  skipped = jnp.zeros([] if whole_axis_count else [1], jnp.int32)
  restart = jnp.zeros([1], bool)
  if _axes.vma_checked():
    axes = frozenset().union(*(_axes.varying_axes(p) for p in leaves))
    own = frozenset(_axes.axis_names(axis_name))
    axes = axes - own if whole_axis_count else axes | own
    skipped = _axes.cast_varying(skipped, axes)
    restart = _axes.cast_varying(restart, own | axes)
  return skipped, restart
