"""The wire protocol: what every wire does, and what each one can.

A *wire* is how one reduction's contributions cross between replicas (or
islands): a plain float dtype (``dense``), quantized blocks
(``blocks``) or the top k of every chunk (``sparse``). Whatever the
wire, a reduction over the ``n`` members of a group is the same contract:

1. **encode**: each member turns its float32 contribution into bytes;
2. **exchange**: the bytes cross (an all-reduce, an all-to-all then an
   all-gather, or one all-gather);
3. **decode and sum in member order**: every member ends with the same
   bits, because it decodes the same bytes with the same float32 ops.

Each wire states what it can do (``Wire``'s capabilities), so that a
transform, or ``shardopt.elastic.Island``, refuses what a wire cannot do
when it is built, not at its first sync.

Two paths use the wires:

- **inside a mapped step** (``jax.shard_map``, ``jax.pmap``):
  ``Wire.all_reduce``, over a named axis, within ``axis_index_groups``;
- **over explicit rows** (``shardopt.elastic``'s rounds, where the islands'
  collective program is built by hand): a *two-phase* wire splits every leaf
  into one chunk per member (``Wire.scatter``), each member sums the
  chunk it owns (``Wire.sum_rows``), encodes the sum again
  (``Wire.encode_owned``) and everyone decodes every owned chunk
  (``Wire.decode_gathered``): a member sends about twice its payload,
  however many members there are. A wire that is not two-phase (top-k: the
  sum of ``n`` sparse contributions is not sparse) is gathered whole
  (``Wire.encode_whole``, ``Wire.sum_gathered``): its bytes grow
  with the members, as its all-gather does inside a step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Wire:
  """One ``comm_dtype``'s wire; built by :func:`shardopt.wire.of`.

  Capabilities (class attributes):

  - ``sparse``: only some entries travel (the rest stays in the error
    buffer);
  - ``needs_error_feedback``: it loses too much without error feedback to
    be used without it (top-k);
  - ``takes_error_feedback``: it drops something error feedback can keep
    (quantized blocks, top-k; a float cast drops its rounding, which error
    feedback does not chase);
  - ``carries_counts``: a count (a sum of 0/1 flags over a group) is exact
    on it, so it can ride with the contributions in one collective (float32
    and wider);
  - ``two_phase``: the exchange over explicit rows is a reduce-scatter then
    an all-gather (bytes per member bounded as the group grows).
  """

  sparse: bool = False
  needs_error_feedback: bool = False
  takes_error_feedback: bool = False
  carries_counts: bool = False
  two_phase: bool = True

  spec: Any = None

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.spec!r})"

  def __eq__(self, other) -> bool:
    return type(self) is type(other) and self.spec == other.spec

  def __hash__(self) -> int:
    return hash((type(self), self.spec))

  # Inside a mapped step.

  def all_reduce(
    self,
    leaves: list,
    axis,
    groups: tuple | None,
    members: int,
    *,
    divisor: int,
    invariant_result: bool,
    residuals: bool = False,
  ):
    """``leaves`` (varying over ``axis``) summed over the members of each
    group and divided by ``divisor``; with ``residuals``, also what the wire
    dropped from this member's contribution (error feedback)."""
    raise NotImplementedError(f"{self!r} has no all_reduce of its own")

  # Over explicit rows: two-phase wires.

  def plan(self, sizes: tuple, members: int) -> Any:
    """How leaves of ``sizes`` elements split into ``members`` chunks."""
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def scatter(self, flats: list, plan) -> tuple[jax.Array, list]:
    """Phase 1 of a member: ``(rows, dropped)``, ``rows`` ``(members,
    bytes)`` uint8 (row ``j`` holds chunk ``j`` of every leaf, for member
    ``j``), ``dropped`` per leaf what the encoding lost (flat, float32)."""
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def sum_rows(self, received: jax.Array, keep, plan) -> list:
    """The owned chunk of every leaf: the received rows (``(members,
    bytes)``, in the order to add them) decoded and summed in float32, rows
    where ``keep`` is False left out."""
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def encode_owned(self, owned: list, plan) -> tuple[jax.Array, list]:
    """Phase 2: ``(payload, dropped)`` of the owned chunks."""
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def decode_gathered(self, gathered: jax.Array, plan) -> list:
    """Every leaf, flat float32, from every member's phase-2 payload
    (``(members, bytes)``, chunk ``j`` in row ``j``)."""
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  # Over explicit rows: gathered wires.

  def encode_whole(self, flats: list) -> tuple[jax.Array, list]:
    """``(payload, dropped)``: every leaf of one member, for an all-gather."""
    raise NotImplementedError(f"{self!r} is a two-phase wire")

  def sum_gathered(self, gathered: jax.Array, keep, sizes: tuple) -> list:
    """Every leaf, flat float32: the members' payloads (``(members,
    bytes)``, in the order to add them) decoded and summed, rows where
    ``keep`` is False left out."""
    raise NotImplementedError(f"{self!r} is a two-phase wire")


# --------------------------------------------------------------------------
# Shared by the wires' modules.


def kept_rows(rows: jax.Array, keep) -> jax.Array:
  """``rows`` (decoded, ``(members, ...)``) with the rows where ``keep`` is
  False zeroed (a select: a left-out row's NaN does not leak)."""
  if keep is None:
    return rows
  mask = jnp.reshape(keep, (-1,) + (1,) * (rows.ndim - 1))
  return jnp.where(mask, rows, jnp.zeros((), rows.dtype))


def sum_in_order(terms: jax.Array, keep=None) -> jax.Array:
  """``terms[0] + terms[1] + ...`` in float32, left to right (the member
  order: every member adds the same terms in the same order); rows where
  ``keep`` is False count as zeros (:func:`kept_rows`)."""
  terms = kept_rows(terms, keep)
  total = terms[0]
  for j in range(1, terms.shape[0]):
    total = total + terms[j]
  return total


def split_bytes(rows: jax.Array, widths) -> list:
  """``rows`` cut along the last axis into pieces of ``widths`` bytes."""
  out, start = [], 0
  for w in widths:
    out.append(rows[..., start : start + w])
    start += w
  if start != rows.shape[-1]:
    raise ValueError(
      f"shardopt.wire: rows of {rows.shape[-1]} bytes do not hold pieces of"
      f" {list(widths)} bytes."
    )
  return out


def flat_float32(x: Any) -> jax.Array:
  """A leaf as a flat float32 vector."""
  return jnp.ravel(jnp.asarray(x)).astype(jnp.float32)


def chunked(flat: jax.Array, members: int, per: int) -> jax.Array:
  """A flat vector zero padded to ``members * per``, as ``(members, per)``."""
  return jnp.pad(flat, (0, members * per - flat.size)).reshape(members, per)


def finite_or_zero(x: jax.Array) -> jax.Array:
  """What error feedback keeps: a non-finite element is not kept (the next
  step starts afresh)."""
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize
