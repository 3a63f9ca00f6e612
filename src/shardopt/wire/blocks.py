"""Quantized collectives: 8 and 4 bits on the wire, bit-identical results.

``comm_dtype`` (of :func:`shardopt.reduce`, the ``cross_shard`` transforms,
the periodic family and ``powersgd``'s factors) accepts ``jnp.int8``,
``jnp.float8_e4m3fn``, ``jnp.float8_e5m2`` and ``jnp.int4``, or a
:func:`quantized` spec that also sets the block size. A quantized reduction
of a leaf over ``n`` replicas (the group's members) runs in two phases:

1. every replica flattens its leaf, cuts it into ``n`` equal chunks (zero
   padded) and each chunk into blocks of ``block_size`` elements (a chunk
   shorter than ``block_size`` is one block); each block is quantized with
   one float32 scale, ``absmax / qmax`` (``qmax`` = the dtype's largest
   value: 127 for int8, 7 for int4, 448 for e4m3fn, 57344 for e5m2;
   computed as ``absmax * float32(1 / qmax)`` and rounded up to 17
   significant bits, so that ``q * scale`` is exact in float32 and a fused
   multiply-add gives the same bits as a multiply and an add), values
   ``x * float32(1 / scale)`` rounded to nearest (ties to even);
2. one ``all_to_all`` hands chunk ``j`` of everyone to member ``j``;
3. member ``j`` dequantizes its ``n`` received chunks (``q * scale``) and
   adds them in float32, in member order (times ``float32(1 / n)`` for a
   mean);
4. it quantizes the reduced chunk the same way;
5. one ``all_gather`` gives every member every reduced chunk, which each
   dequantizes: the same bytes in, the same float32 ops, so every member of
   a group ends with **bit-identical** values.

All leaves of one reduction share the two collectives: each moves rows of
bytes (``uint8``): a leaf's quantized values (int8 and float8 bitcast to
bytes, int4 packed two per byte, low nibble first) followed by its float32
block scales' bytes. Per replica, the wire carries
``2 (n - 1) / n x (elements x bits / 8 + blocks x 4)`` bytes, a ring
all-reduce's in the narrow dtype plus the scales.

Error bound, per element, without error feedback (``r`` = the reduced value
before requantization, ``s_i`` the scale of replica ``i``'s block holding the
element and ``s_out`` that of the reduced block)::

  |result - exact mean| <= (1/n) sum_i u(x_i, s_i) + u(r, s_out)

where ``u(y, s)`` is half a quantization step at ``y``: ``s / 2`` for the
integer dtypes, ``max(|y| 2^-(m+1), s 2^(e_min - m - 1))`` for float8 with
``m`` mantissa bits and smallest normal exponent ``e_min`` (e4m3fn: m = 3,
e_min = -6; e5m2: m = 2, e_min = -14). For a sum, drop the ``1/n``. Float32
rounding of the sum comes on top. A non-finite element makes its whole block
non-finite (NaN) in the result, on every replica.

With error feedback (``cross_shard_mean(..., error_feedback=True)``) each
replica also gets back what the quantizations dropped from its contribution
(phase 1, and for the owner of a chunk the phase-2 requantization times the
divisor), to add to its next contribution; see
:func:`shardopt.cross_shard_mean`. The residual comes from the values the
encoding stands for, in the encoding's elementwise computation, with the
owned row and the non-finite guard in the same pass (``residuals_of``);
the contribution ``x + error`` is computed once, in a pass that the absmax,
the encoding and the residual read (``_encode(flat_absmax=True)``): XLA's
CPU cost analysis counts +21.5 bytes per element on int8's 26.6, its floor
without multi-output fusion being 20.5 (benchmarks/README.md, section 10c).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from shardopt import _axes
from shardopt.wire import dense
from shardopt.wire import protocol

__all__ = ["QuantizedSpec", "quantized"]

_QMAX = {
  np.dtype(jnp.int8): 127.0,
  np.dtype(jnp.int4): 7.0,
  np.dtype(jnp.float8_e4m3fn): float(ml_dtypes.finfo(jnp.float8_e4m3fn).max),
  np.dtype(jnp.float8_e5m2): float(ml_dtypes.finfo(jnp.float8_e5m2).max),
}
QUANTIZED_DTYPES = tuple(_QMAX)
_NAMES = "jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int4"


# What the error of a grouped quantized or sparse reduce under jax.vmap adds.
FLOAT_FIX = ", or use a float comm_dtype (its grouped mean runs under vmap)"


@dataclasses.dataclass(frozen=True)
class QuantizedSpec:
  """A quantized wire: ``dtype`` values in blocks of ``block_size``, each
  block with one float32 scale. Build it with :func:`quantized`."""

  dtype: np.dtype
  block_size: int = 256

  def __repr__(self) -> str:
    return f"quantized({self.dtype.name}, block_size={self.block_size})"

  @property
  def qmax(self) -> float:
    """The dtype's largest value: a block's absmax maps onto it."""
    return _QMAX[self.dtype]

  @property
  def is_float(self) -> bool:
    """float8 (its numpy kind is "V", so ask jnp)."""
    return bool(jnp.issubdtype(self.dtype, jnp.floating))

  @property
  def bits(self) -> int:
    """Bits per value on the wire."""
    return 4 if self.dtype == np.dtype(jnp.int4) else 8


def _check(dtype: Any, block_size: Any, where: str) -> QuantizedSpec:
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(
      f"{where}: dtype={dtype!r} is not a dtype; use one of {_NAMES}."
    ) from e
  if dt not in _QMAX:
    raise TypeError(
      f"{where}: dtype={dt} cannot be quantized on the wire; use one of"
      f" {_NAMES} (or a float dtype such as jnp.bfloat16 as a plain"
      " comm_dtype)."
    )
  if (
    isinstance(block_size, bool)
    or not isinstance(block_size, (int, np.integer))
    or block_size < 1
  ):
    raise ValueError(
      f"{where}: block_size={block_size!r} must be a positive integer (the"
      " number of values sharing one float32 scale), e.g. 256."
    )
  if dt == np.dtype(jnp.int4) and block_size % 2:
    raise ValueError(
      f"{where}: block_size={block_size} is odd, but int4 packs two values"
      f" per byte; use an even block_size, e.g. {block_size + 1}."
    )
  return QuantizedSpec(dt, int(block_size))


def quantized(dtype: Any, *, block_size: int = 256) -> QuantizedSpec:
  """A quantized wire spec for ``comm_dtype``: ``dtype`` plus block scales.

  Passing a plain dtype (``comm_dtype=jnp.int8``) is the same as
  ``quantized(jnp.int8)``. See the module docstring for the two-phase
  reduction, its bytes and its error bound.

  Args:
    dtype: ``jnp.int8``, ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2`` or
      ``jnp.int4``.
    block_size: values per float32 scale (even for int4). Smaller blocks
      track the magnitudes more closely and send more scales.

  Returns:
    A hashable ``QuantizedSpec`` (the dtype and the block size).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, shardopt
    >>> shardopt.quantized(jnp.int8, block_size=128)
    quantized(int8, block_size=128)
    >>> x = np.random.default_rng(0).normal(size=(8, 1000)).astype(np.float32)
    >>> f = jax.pmap(lambda g: shardopt.reduce(
    ...     g, "i", comm_dtype=shardopt.quantized(jnp.int8)), axis_name="i")
    >>> out = np.asarray(f(x))
    >>> bool((out == out[0]).all())  # bit-identical on every replica
    True
    >>> round(float(np.abs(out[0] - x.mean(0)).max()), 4)  # exact: 0
    0.0097
  """
  return _check(dtype, block_size, "shardopt.quantized")


def as_spec(comm_dtype: Any) -> QuantizedSpec | None:
  """The spec a ``comm_dtype`` stands for, or None for a plain (float) wire."""
  if isinstance(comm_dtype, QuantizedSpec):
    return comm_dtype
  try:
    dt = np.dtype(comm_dtype)
  except TypeError:
    return None
  return QuantizedSpec(dt) if dt in _QMAX else None


# --------------------------------------------------------------------------
# The block quantizer.


def layout(size: int, members: int, spec: QuantizedSpec) -> tuple[int, int]:
  """``(block, blocks)`` of one chunk: a leaf of ``size`` elements over
  ``members`` replicas is padded to ``members * blocks * block`` elements."""
  per = -(-size // members)
  if spec.bits == 4:
    per += per % 2
  block = min(spec.block_size, per)
  return block, -(-per // block)


# Scales keep 17 significant bits (rounded up, so no value exceeds qmax):
# every quantized value has at most 7 (int8: |q| <= 127), so ``q * scale``
# is exact in float32 and a backend that fuses it with the next add (an FMA,
# as XLA's CPU and GPU backends do) gets the same bits as one that does not.
_ROUND_UP = np.uint32((1 << 7) - 1)


def _short_scale(scale: jax.Array) -> jax.Array:
  """``scale`` rounded up to 17 significant bits (inf and NaN stay so)."""
  bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
  bits = (bits + _ROUND_UP) & ~_ROUND_UP
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def encode(values: jax.Array, spec: QuantizedSpec) -> jax.Array:
  """``(..., blocks, block)`` float32 -> ``(..., bytes)`` uint8: the
  quantized values' bytes, then the block scales' (float32) bytes."""
  return _encode(values, spec)[0]


def _encode(values: jax.Array, spec: QuantizedSpec, *, flat_absmax=False):
  """:func:`encode`, and the values it stands for (what :func:`decode`
  gives back), computed before packing.

  ``flat_absmax`` (error feedback's contribution ``x + error``, which three
  passes read: the absmax, the encoding and the residual) takes ``|values|``
  of the flat values, then the blocks' max: the same bits, but XLA's CPU
  backend then computes ``x + error`` once, in a pass of its own that the
  three read, instead of again in each from ``x`` and the error buffer,
  which also cost a copy of the donated buffer (16 bytes per element less in
  its cost analysis, the update 0.86-0.98x its time before on the 8-bit
  wires on 8 CPU devices; section 10c of benchmarks/README.md). Off without
  error feedback, where the absmax reads the leaf itself: there the flat
  view made the CPU's YNNPACK reduce slower.
  """
  if flat_absmax:
    magnitude = jnp.abs(values.reshape(-1)).reshape(values.shape)
  else:
    magnitude = jnp.abs(values)
  absmax = jnp.max(magnitude, axis=-1)
  # A product with the float32 reciprocal, which is what XLA makes of a
  # division by a constant anyway: the bits are spelled out, not up to it.
  scale = _short_scale(absmax * jnp.float32(1.0 / spec.qmax))
  # Times the reciprocal (what XLA makes of a division by a broadcast value
  # anyway), spelled out so every backend rounds alike; a zero block stays 0.
  inverse = jnp.where(scale > 0, 1.0 / scale, jnp.float32(0.0))
  y = jnp.clip(values * inverse[..., None], -spec.qmax, spec.qmax)
  lead = values.shape[:-2]
  if spec.is_float:  # float8: round to nearest even, its bytes
    narrow = y.astype(spec.dtype)
    kept = narrow.astype(jnp.float32)
    q = jax.lax.bitcast_convert_type(narrow, jnp.uint8)
  else:
    q = jnp.round(y).astype(jnp.int8)
    kept = q.astype(jnp.float32)
    if spec.bits == 4:  # two per byte, the first value in the low nibble
      pairs = q.reshape(q.shape[:-1] + (q.shape[-1] // 2, 2)).astype(jnp.uint8)
      q = (pairs[..., 0] & jnp.uint8(0x0F)) | (pairs[..., 1] << jnp.uint8(4))
    else:
      q = jax.lax.bitcast_convert_type(q, jnp.uint8)
  scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)
  payload = jnp.concatenate(
    [q.reshape(lead + (-1,)), scale_bytes.reshape(lead + (-1,))], axis=-1
  )
  kept = jnp.where(
    jnp.isfinite(scale)[..., None], kept * scale[..., None], jnp.nan
  )
  return payload, kept


def decode(
  payload: jax.Array, spec: QuantizedSpec, block: int, blocks: int
) -> jax.Array:
  """Inverse of :func:`encode`: ``(..., bytes)`` -> ``(..., blocks, block)``
  float32; a block whose scale is not finite decodes to NaN."""
  lead = payload.shape[:-1]
  value_bytes = blocks * block * spec.bits // 8
  q, scale = payload[..., :value_bytes], payload[..., value_bytes:]
  scale = jax.lax.bitcast_convert_type(
    scale.reshape(lead + (blocks, 4)), jnp.float32
  )
  if spec.is_float:
    y = jax.lax.bitcast_convert_type(q, spec.dtype).astype(jnp.float32)
  else:
    signed = jax.lax.bitcast_convert_type(q, jnp.int8)
    if spec.bits == 4:  # sign-extend each nibble
      shifted = jax.lax.bitcast_convert_type(q << jnp.uint8(4), jnp.int8)
      low = shifted >> jnp.int8(4)
      high = signed >> jnp.int8(4)
      signed = jnp.stack([low, high], axis=-1)
    y = signed.astype(jnp.float32)
  y = y.reshape(lead + (blocks, block))
  out = y * scale[..., None]
  return jnp.where(jnp.isfinite(scale)[..., None], out, jnp.nan)


# --------------------------------------------------------------------------
# The two-phase reduction, step by step.


class Plan(NamedTuple):
  """How leaves of ``sizes`` elements split over ``members``: per leaf its
  chunk's ``(block, blocks)`` and the bytes of one encoded chunk."""

  sizes: tuple
  members: int
  layouts: tuple
  widths: tuple


def plan(sizes, members: int, spec: QuantizedSpec) -> Plan:
  """The :class:`Plan` of leaves of ``sizes`` over ``members``."""
  layouts = tuple(layout(int(s), members, spec) for s in sizes)
  widths = tuple(
    blocks * block * spec.bits // 8 + 4 * blocks for block, blocks in layouts
  )
  return Plan(tuple(int(s) for s in sizes), members, layouts, widths)


def _chunks(x: jax.Array, members: int, block: int, blocks: int):
  """Flat float32, zero padded, as ``(members, blocks, block)``."""
  flat = x.astype(jnp.float32).reshape(-1)
  flat = jnp.pad(flat, (0, members * blocks * block - flat.size))
  return flat.reshape(members, blocks, block)


def _position(axis, groups: tuple | None) -> jax.Array:
  """This replica's position within its group (its chunk's index)."""
  index = jax.lax.axis_index(axis)
  if groups is None:
    return index
  table = np.zeros(sum(len(g) for g in groups), np.int32)
  for members in groups:
    for p, i in enumerate(members):
      table[i] = p
  return jnp.asarray(table)[index]


def _sum_received(
  received: jax.Array,
  spec: QuantizedSpec,
  block: int,
  blocks: int,
  keep=None,
) -> jax.Array:
  """The decoded rows of ``received`` (``(members, bytes)``) summed in
  float32 in member order (the same on every backend), rows where ``keep``
  is False left out, as a loop that decodes one row per iteration: the sum
  is one buffer that later passes read. Unrolled, XLA fuses the sum (every
  row's dequantization) into each pass that reads it, the scale's and the
  requantization's (and error feedback's residual), which costs float8's
  conversions most. int4 keeps the unrolled sum: on the 5M-parameter MLP
  its loop cost 7-9% more.
  """
  if spec.bits == 4:  # unpacking nibbles row by row costs more than it saves
    return protocol.sum_in_order(decode(received, spec, block, blocks), keep)

  def row(j):
    decoded = decode(received[j], spec, block, blocks)
    if keep is None:
      return decoded
    return jnp.where(keep[j], decoded, jnp.float32(0.0))

  return jax.lax.fori_loop(
    1, received.shape[0], lambda j, total: total + row(j), row(0)
  )


def scatter_values(leaves: list, p: Plan) -> list:
  """Phase 1's values: each leaf as ``(members, blocks, block)``."""
  return [
    _chunks(x, p.members, *lay)
    for x, lay in zip(leaves, p.layouts, strict=True)
  ]


def encode_rows(values: list, spec: QuantizedSpec) -> jax.Array:
  """Phase 1's bytes, ``(members, bytes)``: row ``j`` holds chunk ``j`` of
  every leaf (values, then scales), for member ``j``."""
  return jnp.concatenate([encode(v, spec) for v in values], axis=-1)


def sum_rows(received: jax.Array, spec: QuantizedSpec, p: Plan, keep=None):
  """The owned chunk of every leaf (``(blocks, block)`` float32): the
  received rows decoded and summed in member order."""
  return [
    _sum_received(part, spec, block, blocks, keep)
    for part, (block, blocks) in zip(
      protocol.split_bytes(received, p.widths), p.layouts, strict=True
    )
  ]


def decode_gathered(gathered: jax.Array, spec: QuantizedSpec, p: Plan):
  """Every leaf, flat float32, from every member's reduced chunk."""
  return [
    decode(part, spec, block, blocks).reshape(-1)[:size]
    for part, (block, blocks), size in zip(
      protocol.split_bytes(gathered, p.widths), p.layouts, p.sizes, strict=True
    )
  ]


def reduce_scatter(
  rows: jax.Array, axis, spec: QuantizedSpec, *, divisor: int
) -> jax.Array:
  """Phase 1 of :func:`all_reduce` alone: ``rows`` is ``(members, m)``,
  row ``j`` this replica's contribution to member ``j``'s chunk; returns
  this replica's chunk of the sum over ``axis`` (divided by ``divisor``),
  ``(m,)`` float32. Each row is quantized in blocks, the rows travel by one
  all-to-all of uint8 bytes (values and scales), and the received rows are
  dequantized and summed in float32 in member order. ``shardopt.tower``'s
  reduce-scatter on a quantized wire.
  """
  members, m = rows.shape
  block, blocks = layout(members * m, members, spec)
  values = rows.astype(jnp.float32)
  values = jnp.pad(values, ((0, 0), (0, blocks * block - m)))
  received = jax.lax.all_to_all(
    encode(values.reshape(members, blocks, block), spec), axis, 0, 0
  )
  total = _sum_received(received, spec, block, blocks)
  if divisor != 1:
    total = total * jnp.float32(1.0 / divisor)
  return total.reshape(-1)[:m]


def all_reduce(
  leaves: list,
  axis,
  groups: tuple | None,
  members: int,
  spec: QuantizedSpec,
  *,
  divisor: int,
  invariant_result: bool,
  residuals: bool = False,
):
  """Two-phase quantized all-reduce of ``leaves`` (all varying over ``axis``).

  1. :func:`scatter_values` and :func:`encode_rows`: chunk ``j`` of every
     leaf, quantized, for member ``j``;
  2. one ``all_to_all``;
  3. :func:`sum_rows`: the owned chunks summed in member order (times
     ``float32(1 / divisor)``);
  4. each owned chunk quantized again;
  5. one ``all_gather``, and :func:`decode_gathered`.

  Returns the reduced leaves (``sum / divisor``, in each leaf's dtype) and,
  with ``residuals``, each replica's float32 residual in the leaf's shape:
  what phase 1 dropped from its contribution, plus, on the chunk it owns,
  ``divisor`` times what phase 2 dropped, so that ``result = reduce(x) -
  reduce(residual)`` up to float32 rounding (``reduce`` = sum / divisor).
  A non-finite residual element is kept as 0 (a non-finite step does not
  poison the steps after it).
  ``invariant_result`` types the gathered values invariant (a checking
  shard_map without groups).
  """
  p = plan([x.size for x in leaves], members, spec)
  values = scatter_values(leaves, p)
  # Each chunk's bytes and the values they stand for, from one elementwise
  # computation (the residual below needs no decode of the bytes sent).
  sent = [_encode(v, spec, flat_absmax=residuals) for v in values]
  wire = jnp.concatenate([payload for payload, _ in sent], axis=-1)
  received = _axes.grouped(
    lambda: jax.lax.all_to_all(wire, axis, 0, 0, axis_index_groups=groups),
    f"the {spec.dtype.name} wire with axis_index_groups",
    FLOAT_FIX,
    groups=groups,
  )
  owned = sum_rows(received, spec, p)
  if divisor != 1:  # times the float32 reciprocal, as for the scales
    owned = [total * jnp.float32(1.0 / divisor) for total in owned]
  requantized = [_encode(total, spec) for total in owned]
  gather = jnp.concatenate([payload for payload, _ in requantized], axis=-1)
  if invariant_result:
    gathered = jax.lax.all_gather(gather, axis, to="invarying")
  else:
    gathered = jax.lax.all_gather(gather, axis, axis_index_groups=groups)
  out = [
    full.reshape(x.shape).astype(x.dtype)
    for x, full in zip(leaves, decode_gathered(gathered, spec, p), strict=True)
  ]
  if not residuals:
    return out
  position = _position(axis, groups)
  res = [
    dropped.reshape(-1)[: x.size].reshape(x.shape)
    for x, dropped in zip(
      leaves,
      residuals_of(
        values,
        [kept for _, kept in sent],
        owned,
        [kept for _, kept in requantized],
        position,
        divisor,
        # int4 sums its rows unrolled: a select would redo that per row.
        in_place=spec.bits == 4,
      ),
      strict=True,
    )
  ]
  return out, res


def residuals_of(
  values, sent, owned, requantized, position, divisor, *, in_place=False
):
  """Error feedback's residual of every leaf, ``(members, blocks, block)``.

  ``values`` and ``sent`` are phase 1's chunks and what their bytes decode
  to (:func:`_encode`'s second result), ``owned`` and ``requantized`` the
  owned sums and what phase 2's bytes decode to. Every row keeps ``values -
  sent`` (0 where not finite); the owned row (``position``) adds ``divisor``
  times what requantizing its sum dropped, again 0 where not finite (a
  non-finite element of a replica's own row makes its block of the owned
  sum NaN, so the result is the same as checking the two terms' sum once).

  Cost: ``values - sent`` comes from the quantization's own values (no
  decode of the bytes). By default the owned row is chosen by a select, so
  that the residual is one elementwise pass (the guard included) over the
  contributions; its other branch reads the owned sum, a loop's output
  buffer on the 8-bit wires, in every row. ``in_place`` (int4, whose sum is
  not a loop and would be recomputed in every row) writes the owned row
  over the residual instead (a dynamic-update-slice of one row).
  """
  out = []
  for v, kept, total, total_kept in zip(
    values, sent, owned, requantized, strict=True
  ):
    dropped = v - kept
    again = jnp.float32(divisor) * (total - total_kept)
    if in_place:
      dropped = protocol.finite_or_zero(dropped)
      own = jax.lax.dynamic_index_in_dim(dropped, position, keepdims=False)
      mine = protocol.finite_or_zero(own + again)
      out.append(
        jax.lax.dynamic_update_index_in_dim(dropped, mine, position, 0)
      )
      continue
    row = jax.lax.broadcasted_iota(jnp.int32, dropped.shape, 0)
    mine = protocol.finite_or_zero(dropped) + again
    out.append(
      protocol.finite_or_zero(jnp.where(row == position, mine, dropped))
    )
  return out


# --------------------------------------------------------------------------
# The wire.


class Blocks(protocol.Base):
  """Quantized blocks (:func:`quantized`): a two-phase wire that takes error
  feedback; counts travel beside it in float32."""

  takes_error_feedback = True

  def __init__(self, spec: QuantizedSpec):
    self.spec = spec

  rest = dense.OWN  # the leaves all_reduce does not carry

  def all_reduce(self, leaves, axis, groups, members, *, chunks=None, **kw):
    if chunks is not None:
      raise ValueError(
        f"{self!r}: chunks={chunks!r} sets the top-k wire's chunks; a"
        " quantized wire cuts every leaf into one chunk per member (its"
        " block size is the spec's). Use shardopt.topk(k) for chunks=, or"
        " leave it out."
      )
    return all_reduce(leaves, axis, groups, members, self.spec, **kw)

  def reduce_scatter(self, rows, axis, *, divisor):
    return reduce_scatter(rows, axis, self.spec, divisor=divisor)

  def reduce(self, x, summing_collective, members, reduction):
    raise NotImplementedError(
      f"comm_dtype={self.spec!r}: a quantized wire is implemented for"
      " all-reduces (shardopt.reduce, cross_shard*, the periodic family,"
      " powersgd) and tower's reduce-scatter, not for this collective. Use a"
      " float comm_dtype (e.g. jnp.bfloat16) here."
    )

  def plan(self, sizes, members):
    return plan(sizes, members, self.spec)

  def scatter(self, flats, p):
    values = scatter_values(flats, p)
    sent = [_encode(v, self.spec) for v in values]
    dropped = [
      protocol.finite_or_zero(v - kept).reshape(-1)[:size]
      for v, (_, kept), size in zip(values, sent, p.sizes, strict=True)
    ]
    return jnp.concatenate([payload for payload, _ in sent], axis=-1), dropped

  def sum_rows(self, received, keep, p):
    return [t.reshape(-1) for t in sum_rows(received, self.spec, p, keep)]

  def encode_owned(self, owned, p):
    payloads, dropped = [], []
    for total, (block, blocks) in zip(owned, p.layouts, strict=True):
      payload, kept = _encode(total.reshape(blocks, block), self.spec)
      payloads.append(payload)
      dropped.append(protocol.finite_or_zero(total - kept.reshape(-1)))
    return jnp.concatenate(payloads, axis=-1), dropped

  def decode_gathered(self, gathered, p):
    return decode_gathered(gathered, self.spec, p)
