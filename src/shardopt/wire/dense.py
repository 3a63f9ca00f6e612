"""A dense float wire: every element travels, in ``comm_dtype`` (a cast).

``comm_dtype=jnp.bfloat16`` (or ``float16``, ``float32``, None: the leaf's
own dtype) casts each leaf just before the collective and back just after.
Inside a step the collective is XLA's all-reduce (or reduce-scatter);
float16 divides by the group size first, so that the sum cannot overflow.

Over explicit rows (``shardopt.elastic``'s rounds) it is two-phase: each
member cuts every leaf into one chunk per member, casts it and sends chunk
``j`` to member ``j``; member ``j`` sums its chunks in float32 in member
order, casts the sum again and everyone gathers every sum: the bytes of a
ring all-reduce.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt.wire import protocol


class Plan(NamedTuple):
  """Leaves of ``sizes`` elements over ``members``: ``per`` elements of each
  per chunk."""

  sizes: tuple
  members: int
  per: tuple


class Dense(protocol.Base):
  """A float wire (``dtype`` None: each leaf's own dtype). Counts ride with
  the contributions when it is float32 or wider. Inside a step its
  collective is XLA's (``reduce``: a cast around it), one leaf at a time."""

  runs_own_collective = False

  def __init__(self, dtype: np.dtype | None):
    self.spec = dtype

  @property
  def carries_counts(self) -> bool:
    return self.spec is None or self.spec.itemsize >= 4

  @property
  def rest(self) -> Dense:
    return self

  def _dtype(self, dtype) -> np.dtype:
    return np.dtype(dtype if self.spec is None else self.spec)

  def reduce(self, x, summing_collective, members: int, reduction: str):
    """Runs ``summing_collective`` on ``x`` cast to the wire's dtype.

    With a ``float16`` wire ``x`` is first divided by ``members`` so the sum
    cannot overflow; ``"sum"`` multiplies back afterwards, ``"mean"`` is
    then done. ``summing_collective`` sums over ``members`` replicas and
    may change the shape (``psum_scatter`` keeps one chunk).
    """
    wire = self._dtype(x.dtype)
    prescale = float(members) if wire == jnp.float16 else 1.0
    y = x
    if prescale != 1.0:
      y = y / jnp.asarray(prescale, y.dtype)
    total = summing_collective(y.astype(wire)).astype(x.dtype)
    if reduction == "mean":
      if prescale != 1.0:
        return total
      return total / jnp.asarray(members, x.dtype)
    return total * jnp.asarray(prescale, x.dtype) if prescale != 1.0 else total

  # Over explicit rows (float32 contributions).

  def _encode(self, values: jax.Array):
    """float32 values -> (their bytes on the wire, what the bytes stand
    for, as float32)."""
    narrow = values.astype(self._dtype(jnp.float32))
    raw = jax.lax.bitcast_convert_type(narrow, jnp.uint8)
    if narrow.dtype.itemsize == 1:
      raw = raw[..., None]
    return raw.reshape(values.shape[:-1] + (-1,)), narrow.astype(jnp.float32)

  def _decode(self, raw: jax.Array, elements: int) -> jax.Array:
    dtype = self._dtype(jnp.float32)
    lead = raw.shape[:-1]
    if dtype.itemsize > 1:
      raw = raw.reshape(lead + (elements, dtype.itemsize))
    return jax.lax.bitcast_convert_type(raw, dtype).astype(jnp.float32)

  def plan(self, sizes, members):
    per = tuple(-(-int(s) // members) for s in sizes)
    return Plan(tuple(int(s) for s in sizes), members, per)

  def _widths(self, p: Plan) -> list:
    return [n * self._dtype(jnp.float32).itemsize for n in p.per]

  def scatter(self, flats, p):
    rows, dropped = [], []
    for flat, per, size in zip(flats, p.per, p.sizes, strict=True):
      raw, kept = self._encode(protocol.chunked(flat, p.members, per))
      rows.append(raw)
      dropped.append(protocol.finite_or_zero(flat - kept.reshape(-1)[:size]))
    return jnp.concatenate(rows, axis=-1), dropped

  def sum_rows(self, received, keep, p):
    return [
      protocol.sum_in_order(self._decode(part, per), keep)
      for part, per in zip(
        protocol.split_bytes(received, self._widths(p)), p.per, strict=True
      )
    ]

  def encode_owned(self, owned, p):
    payloads, dropped = [], []
    for total in owned:
      raw, kept = self._encode(total)
      payloads.append(raw)
      dropped.append(protocol.finite_or_zero(total - kept))
    return jnp.concatenate(payloads, axis=-1), dropped

  def decode_gathered(self, gathered, p):
    return [
      self._decode(part, per).reshape(-1)[:size]
      for part, per, size in zip(
        protocol.split_bytes(gathered, self._widths(p)),
        p.per,
        p.sizes,
        strict=True,
      )
    ]


# Each leaf in its own dtype: comm_dtype=None, and what a quantized or
# sparse wire's all_reduce does not carry (``Wire.rest``).
OWN = Dense(None)
