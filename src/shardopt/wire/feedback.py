"""Error feedback: what a wire drops from a contribution, kept and sent later.

A wire that drops part of each contribution (quantized blocks' rounding,
the top-k wire's unsent entries) loses it for good unless each replica keeps
it: with error feedback it keeps a float32 buffer per leaf (its *error*),

1. adds it to its next contribution (``add``: ``x + error``, or ``x +
   error_decay * error`` on the top-k wire: SparseLoCo's ``e = beta e +
   delta``);
2. and keeps what the wire dropped from that (the wire's *residual*, ``0``
   where not finite: a non-finite step does not poison the steps after it).

So the sum of what a replica sent over the steps, plus its last error,
equals the sum of its inputs (to float32 rounding) when the decay is 1.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardopt import _axes
from shardopt.wire import protocol


class ErrorFeedbackState(NamedTuple):
  """State of a cross-shard transform built with ``error_feedback=True``.

  Attributes:
    error: float32, per replica, in the shape of each gradient leaf: what
      the quantized wire dropped from this replica's last contribution (its
      phase-1 quantization, plus, on the chunk it owns, the phase-2
      requantization times the group size for a mean), added to its next
      contribution; where that is not finite (a non-finite gradient), 0.
      Under ``jax.shard_map`` its spec is ``P(axis)``.
    inner_state: the wrapped optimizer's state (``optax.EmptyState()`` for
      ``cross_shard_mean``/``cross_shard_sum``).
  """

  error: Any
  inner_state: Any


def check(
  error_feedback: Any, wire: protocol.Wire, name: str, axis_name: Any
) -> bool:
  """Whether ``error_feedback`` is on; a TypeError/ValueError naming the fix
  if it is not a bool, is on with a wire that drops nothing it could keep,
  or is off with a wire that needs it (``shardopt.topk``)."""
  if not isinstance(error_feedback, bool):
    raise TypeError(
      f"{name}: error_feedback={error_feedback!r} (axis {axis_name!r}) must"
      " be True or False."
    )
  if wire.needs_error_feedback and not error_feedback:
    raise ValueError(
      f"{name}: comm_dtype={wire.spec!r} (axis {axis_name!r}) with"
      " error_feedback=False: the top-k wire drops most of every"
      " contribution; it needs error_feedback=True, which keeps what it"
      " drops and sends it later. Pass error_feedback=True (transforms"
      " that take it: cross_shard_mean, cross_shard_sum, cross_shard,"
      " local_sgd, diloco, agn), or a dense comm_dtype (e.g. jnp.int8)."
    )
  if error_feedback and not wire.takes_error_feedback:
    raise ValueError(
      f"{name}: error_feedback=True (axis {axis_name!r}) keeps what a"
      f" quantized wire drops, but comm_dtype={wire.spec} does not"
      " quantize. Pass a quantized comm_dtype (jnp.int8, jnp.float8_e4m3fn,"
      " jnp.float8_e5m2, jnp.int4 or shardopt.quantized(...)), the sparse"
      " shardopt.topk(k), or error_feedback=False."
    )
  return error_feedback


def zeros(leaves: list, axis_name: Any = None) -> list:
  """Zero error buffers, float32, one per leaf. With ``axis_name`` inside a
  checking ``shard_map``, typed varying over it and over the leaf's own
  varying axes (each replica keeps its own)."""
  out = [jnp.zeros(jnp.shape(p), jnp.float32) for p in leaves]
  if axis_name is None or not _axes.vma_checked():
    return out
  own = frozenset(_axes.axis_names(axis_name))
  return [
    _axes.cast_varying(z, own | frozenset(_axes.varying_axes(p)))
    for z, p in zip(out, leaves, strict=True)
  ]


def zeros_like_tree(params: Any) -> Any:
  """``zeros`` for a tree (``ErrorFeedbackState.error`` at ``init``)."""
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten(zeros(leaves))


def add(x: jax.Array, error: jax.Array, wire: protocol.Wire) -> jax.Array:
  """Step 1: the contribution ``x`` plus the error buffer, in float32
  (decayed by the top-k wire's ``error_decay``)."""
  decay = getattr(wire.spec, "error_decay", 1.0)
  error = error.astype(jnp.float32)
  if decay != 1.0:
    error = jnp.float32(decay) * error
  return x.astype(jnp.float32) + error
