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

:class:`Wire` is that contract as a ``typing.Protocol`` (as optax types
``TransformUpdateFn``): a transform canonicalises its ``comm_dtype`` once,
when it is built (:func:`shardopt.wire.of`), and hands the ``Wire`` down;
below that nothing asks which class a wire is. Each wire states what it can
do (its capabilities), so that a transform, or ``shardopt.elastic.Island``,
refuses what a wire cannot do when it is built, not at its first sync.

Three paths use the wires:

- **inside a mapped step** (``jax.shard_map``, ``jax.pmap``), over a named
  axis, within ``axis_index_groups``: a wire that ``runs_own_collective``
  reduces the leaves it carries (``Wire.carries_leaf``) in one
  ``Wire.all_reduce`` (and ``shardopt.tower``'s owned chunks by
  ``Wire.reduce_scatter``); every other leaf goes alone through XLA's
  all-reduce, by ``Wire.rest``'s ``Wire.reduce`` (a dense wire's cast);
- **around an opaque collective** (a summing function the wire cannot see
  into, e.g. ``tower``'s reduce-scatter of a model-parallel leaf):
  ``Wire.reduce``, which only a dense wire can do;
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

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np


@runtime_checkable
class Wire(Protocol):
  """One ``comm_dtype``'s wire; built by :func:`shardopt.wire.of`.

  Capabilities:

  - ``spec``: what the user passed, canonical (None or a ``np.dtype``, a
    ``QuantizedSpec``, a ``TopKSpec``); error messages print it;
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
  - ``runs_own_collective``: it reduces through its own collectives
    (``all_reduce``, ``reduce_scatter``) rather than through XLA's
    all-reduce around a cast (``reduce``);
  - ``two_phase``: the exchange over explicit rows is a reduce-scatter then
    an all-gather (bytes per member bounded as the group grows).

  Example:
    >>> import jax.numpy as jnp, shardopt
    >>> w = shardopt.wire.of(jnp.int8)
    >>> isinstance(w, shardopt.wire.Wire), w.runs_own_collective
    (True, True)
    >>> w.carries_leaf(1024, every_axis=True), w.rest
    (True, Dense(None))
    >>> shardopt.wire.of(jnp.bfloat16).carries_leaf(1024, every_axis=True)
    False
  """

  spec: Any
  sparse: bool
  needs_error_feedback: bool
  takes_error_feedback: bool
  carries_counts: bool
  runs_own_collective: bool
  two_phase: bool

  # Inside a mapped step.

  def carries_leaf(self, size: int, every_axis: bool) -> bool:
    """Whether ``all_reduce`` carries a leaf of ``size`` elements varying
    over every axis of the reduction (``every_axis``) or over some of them;
    the others go alone through XLA's all-reduce, by ``rest.reduce``."""
    ...

  @property
  def rest(self) -> Wire:
    """The wire of the leaves ``all_reduce`` does not carry: a dense wire
    itself, any other the leaf's own dtype."""
    ...

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
    chunks: tuple | None = None,
  ):
    """``leaves`` (varying over ``axis``) summed over the members of each
    group and divided by ``divisor``; with ``residuals``, also what the wire
    dropped from this member's contribution (error feedback). ``chunks``
    (the top-k wire's, for ``shardopt.decoupled_momentum``'s tiles): per
    leaf, the length of the chunks it is cut into."""
    ...

  def reduce_scatter(self, rows: jax.Array, axis, *, divisor: int):
    """``rows`` (``(members, m)``, row ``j`` this member's contribution to
    member ``j``'s chunk) summed over ``axis``, divided by ``divisor``: this
    member's chunk, ``(m,)`` float32 (``shardopt.tower``'s owned chunks)."""
    ...

  def reduce(
    self,
    x: jax.Array,
    summing_collective: Callable[[jax.Array], jax.Array],
    members: int,
    reduction: str,
  ) -> jax.Array:
    """``x`` through ``summing_collective`` (a sum over ``members``
    replicas, which may change the shape: ``psum_scatter`` keeps one
    chunk), the ``reduction`` (``"sum"`` or ``"mean"``) of it in ``x``'s
    dtype; a wire that runs its own collectives raises
    ``NotImplementedError``: an opaque collective cannot carry it."""
    ...

  # Over explicit rows: two-phase wires.

  def plan(self, sizes: tuple, members: int) -> Any:
    """How leaves of ``sizes`` elements split into ``members`` chunks."""
    ...

  def scatter(self, flats: list, plan) -> tuple[jax.Array, list]:
    """Phase 1 of a member: ``(rows, dropped)``, ``rows`` ``(members,
    bytes)`` uint8 (row ``j`` holds chunk ``j`` of every leaf, for member
    ``j``), ``dropped`` per leaf what the encoding lost (flat, float32)."""
    ...

  def sum_rows(self, received: jax.Array, keep, plan) -> list:
    """The owned chunk of every leaf: the received rows (``(members,
    bytes)``, in the order to add them) decoded and summed in float32, rows
    where ``keep`` is False left out."""
    ...

  def encode_owned(self, owned: list, plan) -> tuple[jax.Array, list]:
    """Phase 2: ``(payload, dropped)`` of the owned chunks."""
    ...

  def decode_gathered(self, gathered: jax.Array, plan) -> list:
    """Every leaf, flat float32, from every member's phase-2 payload
    (``(members, bytes)``, chunk ``j`` in row ``j``)."""
    ...

  # Over explicit rows: gathered wires.

  def encode_whole(self, flats: list) -> tuple[jax.Array, list]:
    """``(payload, dropped)``: every leaf of one member, for an all-gather."""
    ...

  def sum_gathered(self, gathered: jax.Array, keep, sizes: tuple) -> list:
    """Every leaf, flat float32: the members' payloads (``(members,
    bytes)``, in the order to add them) decoded and summed, rows where
    ``keep`` is False left out."""
    ...


class Base(Wire):
  """The wires' shared defaults: every capability off, every path a wire
  does not take refused with a ``NotImplementedError`` naming the wire.
  (``shardopt.wire``'s own classes extend it; callers use :class:`Wire`.)"""

  sparse = False
  needs_error_feedback = False
  takes_error_feedback = False
  carries_counts = False
  runs_own_collective = True
  two_phase = True

  spec: Any = None

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.spec!r})"

  def __eq__(self, other) -> bool:
    return type(self) is type(other) and self.spec == other.spec

  def __hash__(self) -> int:
    return hash((type(self), self.spec))

  def carries_leaf(self, size, every_axis):
    del every_axis
    return self.runs_own_collective and size > 0

  @property
  def rest(self):
    raise NotImplementedError(f"{self!r} names no wire for other leaves")

  def all_reduce(self, leaves, axis, groups, members, **kwargs):
    raise NotImplementedError(f"{self!r} has no all_reduce of its own")

  def reduce_scatter(self, rows, axis, *, divisor):
    raise NotImplementedError(f"{self!r} has no reduce_scatter of its own")

  def reduce(self, x, summing_collective, members, reduction):
    raise NotImplementedError(f"{self!r} cannot ride an opaque collective")

  def plan(self, sizes, members):
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def scatter(self, flats, plan):
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def sum_rows(self, received, keep, plan):
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def encode_owned(self, owned, plan):
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def decode_gathered(self, gathered, plan):
    raise NotImplementedError(f"{self!r} is not a two-phase wire")

  def encode_whole(self, flats):
    raise NotImplementedError(f"{self!r} is a two-phase wire")

  def sum_gathered(self, gathered, keep, sizes):
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
