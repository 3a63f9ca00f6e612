"""A sparse wire: the top-k entries of every chunk, with error feedback.

``comm_dtype=shardopt.topk(k)`` (of the ``cross_shard`` transforms and the
periodic family: ``local_sgd``, ``diloco``, ``agn``) sends, of every chunk of
``chunk_size`` elements of a replica's contribution, only the ``k`` entries
of largest magnitude: their in-chunk indices and their values at
``value_bits`` bits, with one float32 scale per chunk (SparseLoCo), or as
they are, in bfloat16 or float32 (``value_bits`` 16 or 32, no scale; DeMo).
What a replica does not send stays in its error buffer, which it adds
(decayed by ``error_decay``) to its next contribution: error feedback is
required. A reduction of a leaf over the ``n`` members of a group:

1. the contribution is ``c = x + error_decay * error`` (``x + error`` when
   ``error_decay`` is 1; SparseLoCo's ``e = beta e + delta``), flattened in
   float32 and cut into chunks of ``chunk_size`` elements, the last one zero
   padded. A leaf shorter than ``chunk_size`` is one chunk of its own length
   that keeps ``ceil(k * size / chunk_size)`` entries (the same density, at
   least one); otherwise every chunk keeps ``k``;
2. per chunk, the entries of largest ``|c|`` (NaN counting as ``inf``), in
   descending order, ties to the lower index (``jax.lax.top_k``);
3. their values are quantized with ``L = 2 ** (value_bits - 1)`` magnitude
   levels and a sign (no zero level: a selected entry is a large one). The
   chunk's scale ``s`` is the largest selected ``|v|`` (``value_bits`` >= 2)
   or their mean (1 bit: ``+-s``; the mean of the non-zero ones, a pairwise
   sum of the magnitudes, halves added in place, times ``1 / count``, a
   float32 division), rounded up
   to 17 significant bits (as the quantized wire's scales, so that ``m *
   s`` is exact in float32); a value ``v`` gets the level ``m =
   clip(round(|v| * (L / s)), 1, L)`` (``L / s`` one float32 division,
   rounding half to even) and stands for ``sign(v) * (m * s) * (1 / L)``
   (``-0.0`` counts as positive). A chunk holding a non-finite selected
   value gets a NaN scale and level 1 for every entry: each selected entry
   that is not zero decodes to NaN, while selected zeros (a chunk with fewer
   than ``k`` non-zero entries) still stand for nothing, so ``[nan, 0, 0,
   0]`` with ``k = 2`` decodes to ``[nan, 0, 0, 0]`` and ``[nan, 1, 0, 0]``
   to ``[nan, nan, 0, 0]``. With ``value_bits`` 16 or 32 nothing is
   quantized: a value travels as itself, in bfloat16 (rounded to nearest,
   ties to even) or float32 (exact), a NaN or an inf included, and there is
   no scale;
4. the payload of a chunk is its indices packed at ``index_bits = max(1,
   ceil(log2(chunk)))`` bits each, then the codes (``sign << (value_bits -
   1) | (m - 1)``, the sign bit 1 for a negative value) packed at
   ``value_bits`` bits each, both least significant bit first, each padded
   to whole bytes, then the scale's 4 bytes (little-endian float32). Zeros
   sort last: when the last ``e >= 1`` selected entries are zero (a chunk
   with fewer than ``k`` non-zero entries), they stand for nothing, the
   scale's lowest bit is set (its 17 significant bits leave the low 7
   free) and the last entry's index field holds ``e - 1``::

     ceil(k * index_bits / 8) + ceil(k * value_bits / 8) + 4   bytes

   (``k``: the entries a chunk keeps; ``payload_bytes(size, spec)``). With
   ``value_bits`` 16 or 32 the values follow the indices as little-endian
   bfloat16 or float32, and nothing else: a selected zero adds nothing, so
   it needs no flag (``ceil(k * index_bits / 8) + k * value_bits / 8``
   bytes). A
   leaf's payload is its chunks' in order, and the payloads of all leaves
   of one reduction are concatenated;
5. one ``all_gather`` of those ``uint8`` payloads; every member decodes
   every member's payload and adds the values at their positions into a
   float32 zero buffer, member by member in order (``j = 0 .. n - 1``),
   then multiplies by ``float32(1 / n)`` for a mean: the same bytes in, the
   same float32 ops, so every member of a group ends with **bit-identical**
   values;
6. each replica's new error is ``c`` minus what it sent (what its own
   payload decodes to), ``0`` where that is not finite: one elementwise
   select over ``c``, on a mask of the sent positions, with the encoding's
   own arithmetic for what a sent entry stands for (no decode, no scatter
   of values).

So the sum over the steps of what a replica sent, plus its last error,
equals the sum of its inputs (to float32 rounding) when ``error_decay`` is
1; with a decay ``beta``, ``error_T = sum_t beta^(T - t) (x_t - sent_t)``.

Bytes: the gathered buffer is ``n`` payloads; in a ring each member sends
``n - 1`` payloads' worth, where a float32 ring all-reduce sends ``2 (n -
1) / n`` of the leaf's bytes. At 4096-element chunks, ``k = 64`` (1.6 %)
and 2-bit values a chunk's payload is 96 + 16 + 4 = 116 bytes against 16384
in float32: ``2 x 16384 / (116 n)``, 282 / n times fewer bytes (35x at
``n = 8``). Unlike an all-reduce's, the cost grows with the group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _args
from shardopt import _axes
from shardopt.wire import blocks
from shardopt.wire import dense
from shardopt.wire import protocol

__all__ = ["TopKSpec", "topk"]

VALUE_BITS = (1, 2, 4, 8, 16, 32)
# Widths whose values travel as they are (no scale, no levels).
RAW_DTYPES = {16: jnp.bfloat16, 32: jnp.float32}
_TOPK = "shardopt.topk"


@dataclasses.dataclass(frozen=True)
class TopKSpec:
  """A sparse wire: per chunk of ``chunk_size`` elements the ``k`` entries
  of largest magnitude, values at ``value_bits``, with error feedback
  decayed by ``error_decay``. Build it with :func:`topk`."""

  k: int
  chunk_size: int = 4096
  value_bits: int = 2
  error_decay: float = 0.95

  def __repr__(self) -> str:
    return (
      f"topk({self.k}, chunk_size={self.chunk_size},"
      f" value_bits={self.value_bits}, error_decay={self.error_decay})"
    )

  @property
  def levels(self) -> int:
    """Magnitude levels ``L = 2 ** (value_bits - 1)`` (no zero level)."""
    return 1 << (self.value_bits - 1)

  @property
  def raw(self) -> bool:
    """Whether the values travel as they are (``value_bits`` 16 or 32)."""
    return self.value_bits in RAW_DTYPES


def topk(
  k: int,
  *,
  chunk_size: int = 4096,
  value_bits: int = 2,
  error_decay: float = 0.95,
) -> TopKSpec:
  """A sparse wire spec for ``comm_dtype``: the top ``k`` of every chunk.

  Per chunk of ``chunk_size`` elements of each replica's contribution (its
  gradient plus ``error_decay`` times its error buffer), the ``k`` entries
  of largest magnitude travel: their in-chunk indices at
  ``ceil(log2(chunk_size))`` bits, their values at ``value_bits`` bits with
  one float32 scale per chunk (or, at 16 or 32 bits, as bfloat16 or float32
  values, with no scale). Every replica gathers every replica's
  payload (one ``all_gather`` of bytes) and adds them up in replica order,
  so the members of a group end with bit-identical results. What a replica
  does not send stays in its error buffer (SparseLoCo's ``e = beta e +
  delta; e -= sent``), so the wire needs ``error_feedback=True``: pass it
  to :func:`shardopt.cross_shard_mean`, :func:`shardopt.cross_shard_sum`,
  :func:`shardopt.cross_shard`, :func:`shardopt.local_sgd`,
  :func:`shardopt.diloco` or :func:`shardopt.agn` (also in
  ``shardopt.elastic``'s rounds). (:func:`shardopt.reduce` keeps no state,
  and ``tower``, ``powersgd`` and ``hierarchical_local_sgd`` do not take
  this wire.)

  The mean divides by the group size, as every shardopt mean does (not by
  the number of replicas that sent a coordinate). The quantizer, the
  payload's layout and its bytes (``ceil(k * index_bits / 8) + ceil(k *
  value_bits / 8) + 4`` per chunk) are spelled out in the module's
  docstring (the API page's top).

  Args:
    k: entries kept per chunk, ``1 <= k <= chunk_size`` (SparseLoCo: 1-3 %
      of the chunk, e.g. 64 of 4096).
    chunk_size: elements per chunk, >= 2. A leaf shorter than that is one
      chunk that keeps ``ceil(k * size / chunk_size)`` entries.
    value_bits: bits per value, one of 1, 2, 4, 8, 16, 32 (1: the sign
      times the chunk's mean magnitude; 2 to 8: ``2 ** (value_bits - 1)``
      magnitude levels up to the chunk's largest; 16: the value in
      bfloat16; 32: the value itself, in float32).
    error_decay: ``0 < error_decay <= 1``, the factor of the error buffer
      before it is added to the next contribution (SparseLoCo's beta, 0.95,
      for outer gradients); 1 keeps all of it (classic error feedback,
      which loses nothing: worth trying on per-step gradients, e.g.
      ``cross_shard_mean``).

  Returns:
    A hashable ``TopKSpec``.

  Example:
    >>> import jax, numpy as np, shardopt
    >>> spec = shardopt.topk(2, chunk_size=8)  # 2 of every 8, 2-bit values
    >>> spec
    topk(2, chunk_size=8, value_bits=2, error_decay=0.95)
    >>> tx = shardopt.cross_shard_mean("i", comm_dtype=spec, error_feedback=True)
    >>> i = np.arange(1.0, 9.0, dtype=np.float32)
    >>> g = i[:, None] * i  # replica r sends (r + 1) * [1, 2, ..., 8]
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name="i")
    >>> mean, state = step(g)
    >>> mean[0]  # 7 and 8 went, 7 as 8 (two levels: half the scale, all of it)
    Array([ 0.,  0.,  0.,  0.,  0.,  0., 36., 36.], dtype=float32)
    >>> bool((mean == mean[0]).all())  # bit-identical on every replica
    True
    >>> state.error[0]  # replica 0 keeps what did not go, for its next step
    Array([ 1.,  2.,  3.,  4.,  5.,  6., -1.,  0.], dtype=float32)
  """
  if not _args.is_integer(chunk_size) or chunk_size < 2:
    raise ValueError(
      f"{_TOPK}: chunk_size={chunk_size!r} must be an integer >= 2, the"
      " number of elements among which the top k are chosen; e.g."
      " chunk_size=4096 (SparseLoCo's)."
    )
  if not _args.is_integer(k) or not (1 <= k <= chunk_size):
    raise ValueError(
      f"{_TOPK}: k={k!r} must be an integer with 1 <= k <= chunk_size"
      f" ({chunk_size}), the entries sent per chunk; e.g."
      f" k={max(1, chunk_size // 64)} (1.6 % of the chunk), or a larger"
      " chunk_size."
    )
  if not _args.is_integer(value_bits) or value_bits not in VALUE_BITS:
    raise ValueError(
      f"{_TOPK}: value_bits={value_bits!r} is not supported; use one of"
      f" {VALUE_BITS} (bits per sent value; e.g. value_bits=2, SparseLoCo's)."
    )
  if (
    isinstance(error_decay, (bool, np.bool_))
    or not isinstance(error_decay, (numbers.Real, np.floating, np.integer))
    or not (0.0 < float(error_decay) <= 1.0)
  ):
    raise ValueError(
      f"{_TOPK}: error_decay={error_decay!r} must be a number with 0 <"
      " error_decay <= 1, the factor of the error buffer before it joins"
      " the next contribution; e.g. error_decay=0.95 (SparseLoCo's beta), or"
      " 1.0 to keep all of it."
    )
  return TopKSpec(int(k), int(chunk_size), int(value_bits), float(error_decay))


# --------------------------------------------------------------------------
# The layout of a leaf.


def _bytes(bits: int) -> int:
  """Whole bytes holding ``bits`` bits."""
  return -(-bits // 8)


class Layout(NamedTuple):
  """How a leaf of ``size`` elements travels: ``chunks`` chunks of ``chunk``
  elements (the leaf zero padded to ``chunks * chunk``), ``keep`` entries of
  each, indices at ``index_bits``."""

  size: int
  chunk: int
  chunks: int
  keep: int
  index_bits: int

  def bytes_per_chunk(self, spec: TopKSpec) -> int:
    """Indices, values, then the float32 scale (none for raw values)."""
    return (
      _bytes(self.keep * self.index_bits)
      + _bytes(self.keep * spec.value_bits)
      + (0 if spec.raw else 4)
    )


def layout(size: int, spec: TopKSpec, chunk: int | None = None) -> Layout:
  """The :class:`Layout` of a leaf of ``size`` (>= 1) elements; with
  ``chunk``, chunks of that length instead of the spec's (``size`` a
  multiple of it), each keeping ``min(k, chunk)`` entries."""
  if chunk is not None:
    if chunk < 1 or size % chunk:
      raise ValueError(
        f"{_TOPK}: a leaf of {size} elements is not a whole number of"
        f" chunks of {chunk}."
      )
    keep = min(spec.k, chunk)
  elif size >= spec.chunk_size:
    chunk, keep = spec.chunk_size, spec.k
  else:  # one chunk of its own length, at the spec's density
    chunk, keep = size, -(-spec.k * size // spec.chunk_size)
  return Layout(
    size, chunk, -(-size // chunk), keep, max(1, (chunk - 1).bit_length())
  )


def payload_bytes(size: int, spec: TopKSpec) -> int:
  """Bytes of one replica's payload for a leaf of ``size`` elements."""
  lay = layout(size, spec)
  return lay.chunks * lay.bytes_per_chunk(spec)


# --------------------------------------------------------------------------
# Bit packing.


def _pack(values: jax.Array, bits: int) -> jax.Array:
  """``(..., n)`` unsigned ints below ``2**bits`` -> ``(..., ceil(n * bits /
  8))`` uint8: the bits of value 0 first, each value's least significant
  bit first, the bytes filled from their least significant bit."""
  lead, n = values.shape[:-1], values.shape[-1]
  shifts = jnp.arange(bits, dtype=jnp.uint32)
  stream = (values.astype(jnp.uint32)[..., None] >> shifts) & jnp.uint32(1)
  stream = stream.astype(jnp.uint8).reshape(lead + (n * bits,))
  pad = -(n * bits) % 8
  stream = jnp.pad(stream, [(0, 0)] * len(lead) + [(0, pad)])
  stream = stream.reshape(lead + (-1, 8)) << jnp.arange(8, dtype=jnp.uint8)
  return jnp.sum(stream, axis=-1, dtype=jnp.uint8)  # distinct bits: an or


def _unpack(payload: jax.Array, n: int, bits: int) -> jax.Array:
  """Inverse of :func:`_pack`: ``(..., bytes)`` uint8 -> ``(..., n)`` uint32."""
  lead = payload.shape[:-1]
  stream = (payload[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  stream = stream.reshape(lead + (-1,))[..., : n * bits]
  stream = stream.astype(jnp.uint32).reshape(lead + (n, bits))
  shifts = jnp.arange(bits, dtype=jnp.uint32)
  return jnp.sum(stream << shifts, axis=-1, dtype=jnp.uint32)


# --------------------------------------------------------------------------
# The codec.


def _pairwise_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis in a fixed order: padded with zeros to a power of
  two, then halves added elementwise until one is left (every backend, and
  numpy, add in this order)."""
  width = 1 << max(0, (x.shape[-1] - 1).bit_length())
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def _rows(x: jax.Array, lay: Layout) -> jax.Array:
  """Flat float32, zero padded, as ``(chunks, chunk)``."""
  flat = jnp.ravel(x).astype(jnp.float32)
  flat = jnp.pad(flat, (0, lay.chunks * lay.chunk - lay.size))
  return flat.reshape(lay.chunks, lay.chunk)


def _value(
  negative: jax.Array, level: jax.Array, scale: jax.Array, spec: TopKSpec
):
  """What a code stands for: ``sign * (m * s) * (1 / L)`` (exact)."""
  magnitude = (level.astype(jnp.float32) * scale[..., None]) * jnp.float32(
    1.0 / spec.levels
  )
  return jnp.where(negative, -magnitude, magnitude)


def _key(rows: jax.Array) -> jax.Array:
  """What the top k are chosen by: ``|x|``, NaN counting as ``inf``."""
  return jnp.where(jnp.isnan(rows), jnp.inf, jnp.abs(rows))


def _select(rows: jax.Array, lay: Layout):
  """Per chunk the ``keep`` entries of largest ``|x|`` (NaN as ``inf``),
  ties to the lower index: ``(indices, values)``, ``(chunks, keep)``."""
  _, index = jax.lax.top_k(_key(rows), lay.keep)
  return index, jnp.take_along_axis(rows, index, axis=-1)


class Quantizer(NamedTuple):
  """A chunk's quantizer, ``(chunks,)`` each: its ``scale`` (NaN for a
  non-finite chunk), whether it is ``usable`` (finite and positive) and
  ``levels / scale`` (0 where not usable)."""

  scale: jax.Array
  usable: jax.Array
  inverse: jax.Array


def _levels(magnitude: jax.Array, quantizer: Quantizer, spec: TopKSpec):
  """``clip(round(|v| * (L / s)), 1, L)``; level 1 where the scale is zero
  or NaN (standing for 0 or NaN)."""
  scaled = jnp.where(
    quantizer.usable[..., None], magnitude * quantizer.inverse[..., None], 0.0
  )
  return jnp.clip(jnp.round(scaled), 1, spec.levels).astype(jnp.uint32)


def _stands_for(values: jax.Array, quantizer, spec: TopKSpec) -> jax.Array:
  """What a selected value ``v`` (rows of ``(chunks, ...)``) stands for once
  sent, elementwise: ``v`` in the raw dtype, or its level times the scale,
  ``0`` for a zero (one of the trailing zeros, standing for nothing)."""
  if spec.raw:
    return values.astype(RAW_DTYPES[spec.value_bits]).astype(jnp.float32)
  magnitude = jnp.abs(values)
  level = _levels(magnitude, quantizer, spec)
  value = _value(values < 0, level, quantizer.scale, spec)
  return jnp.where(magnitude == 0, 0.0, value)


def _encode_raw(rows: jax.Array, lay: Layout, spec: TopKSpec):
  """:func:`_encode_rows` at 16 or 32 bits: the indices, then the values
  as bfloat16 or float32 (little-endian), no scale."""
  index, values = _select(rows, lay)
  sent = values.astype(RAW_DTYPES[spec.value_bits])
  raw = jax.lax.bitcast_convert_type(sent, jnp.uint8)
  payload = jnp.concatenate(
    [_pack(index, lay.index_bits), raw.reshape(lay.chunks, -1)], axis=-1
  )
  return payload, index, None


def _encode_rows(rows: jax.Array, lay: Layout, spec: TopKSpec):
  """``(chunks, chunk)`` -> (payload ``(chunks, bytes)`` uint8, selected
  indices ``(chunks, keep)`` int32, the chunks' :class:`Quantizer`, None for
  raw values)."""
  if spec.raw:
    return _encode_raw(rows, lay, spec)
  index, values = _select(rows, lay)
  magnitude = jnp.abs(values)
  zero = magnitude == 0
  empty = jnp.sum(zero, axis=-1, dtype=jnp.int32)
  if spec.value_bits == 1:  # the mean over the non-zero entries
    count = jnp.maximum(lay.keep - empty, 1).astype(jnp.float32)
    scale = _pairwise_sum(magnitude) * (jnp.float32(1.0) / count)
  else:
    scale = jnp.max(magnitude, axis=-1)
  scale = blocks._short_scale(scale)
  scale = jnp.where(
    jnp.all(jnp.isfinite(values), axis=-1), scale, jnp.float32(jnp.nan)
  )
  # One float32 division per chunk, then a product per value; a zero (or
  # NaN) scale gives level 1, standing for 0 (or NaN).
  usable = jnp.isfinite(scale) & (scale > 0)
  inverse = jnp.where(usable, jnp.float32(spec.levels) / scale, 0.0)
  quantizer = Quantizer(scale, usable, inverse)
  level = _levels(magnitude, quantizer, spec)
  negative = values < 0
  code = (negative.astype(jnp.uint32) << (spec.value_bits - 1)) | (level - 1)
  # Zeros sort last: e trailing zero entries (a chunk with fewer than k
  # non-zero ones) stand for nothing. The scale's low bit (free: 17
  # significant bits) says so, the last index field holds e - 1.
  # (A select, not ``index.at[:, -1].set``: XLA's CPU backend keeps
  # ``lax.top_k`` as its partial-sort TopK call only when no in-place update
  # follows; with one it lowers to a full sort of every chunk, 10x slower.)
  last = jnp.arange(lay.keep) == lay.keep - 1
  fields = jnp.where(last & (empty[:, None] > 0), empty[:, None] - 1, index)
  scale_bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
  scale_bits = scale_bits | (empty > 0).astype(jnp.uint32)
  payload = jnp.concatenate(
    [
      _pack(fields, lay.index_bits),
      _pack(code, spec.value_bits),
      jax.lax.bitcast_convert_type(scale_bits, jnp.uint8),
    ],
    axis=-1,
  )
  return payload, index, quantizer


def _decode_rows(payload: jax.Array, lay: Layout, spec: TopKSpec):
  """``(..., chunks, bytes)`` uint8 -> (indices ``(..., chunks, keep)``
  int32, values ``(..., chunks, keep)`` float32, whether each entry stands
  for a value (False: one of the trailing zero entries))."""
  index_bytes = _bytes(lay.keep * lay.index_bits)
  code_bytes = _bytes(lay.keep * spec.value_bits)
  index = _unpack(payload[..., :index_bytes], lay.keep, lay.index_bits)
  if spec.raw:  # the values as they are; every entry stands for itself
    raw = payload[..., index_bytes:]
    raw = raw.reshape(raw.shape[:-1] + (lay.keep, spec.value_bits // 8))
    dtype = RAW_DTYPES[spec.value_bits]
    values = jax.lax.bitcast_convert_type(raw, dtype).astype(jnp.float32)
    return index.astype(jnp.int32), values, jnp.ones(values.shape, bool)
  code = _unpack(
    payload[..., index_bytes : index_bytes + code_bytes],
    lay.keep,
    spec.value_bits,
  )
  scale_bytes = payload[..., index_bytes + code_bytes :]
  scale_bits = jax.lax.bitcast_convert_type(scale_bytes, jnp.uint32)
  scale = jax.lax.bitcast_convert_type(scale_bits & ~jnp.uint32(1), jnp.float32)
  empty = jnp.where((scale_bits & 1) == 1, index[..., -1] + 1, 0)
  real = jnp.arange(lay.keep, dtype=jnp.uint32) < lay.keep - empty[..., None]
  negative = (code >> (spec.value_bits - 1)) == 1
  level = (code & jnp.uint32(spec.levels - 1)) + 1
  values = jnp.where(real, _value(negative, level, scale, spec), 0.0)
  return index.astype(jnp.int32), values, real


def _positions(index: jax.Array, lay: Layout) -> jax.Array:
  """In-chunk indices ``(..., chunks, keep)`` -> flat positions in the
  padded leaf, ``(..., chunks * keep)``."""
  start = jnp.arange(lay.chunks, dtype=jnp.int32)[:, None] * lay.chunk
  flat = index + start
  return flat.reshape(flat.shape[:-2] + (-1,))


def _or_beyond(positions: jax.Array, real: jax.Array, end: int) -> jax.Array:
  """``positions`` where ``real``, else distinct positions from ``end`` on
  (out of bounds: a scatter with ``mode="drop"`` skips them)."""
  beyond = end + jnp.arange(positions.shape[-1], dtype=jnp.int32)
  return jnp.where(real, positions, beyond)


def encode(x: jax.Array, spec: TopKSpec) -> jax.Array:
  """A leaf (any shape, flattened) -> its payload, ``(bytes,)`` uint8 (see
  the module docstring for the layout; :func:`payload_bytes` bytes)."""
  lay = layout(math.prod(np.shape(x)), spec)
  payload, _, _ = _encode_rows(_rows(jnp.asarray(x), lay), lay, spec)
  return payload.reshape(-1)


def decode(payload: jax.Array, spec: TopKSpec, size: int) -> jax.Array:
  """Inverse of :func:`encode` for a leaf of ``size`` elements: the flat
  float32 ``(size,)`` it stands for (zeros where nothing was sent)."""
  lay = layout(size, spec)
  index, values, real = _decode_rows(payload.reshape(lay.chunks, -1), lay, spec)
  end = lay.chunks * lay.chunk
  positions = _or_beyond(_positions(index, lay), real.reshape(-1), end)
  dense = (
    jnp.zeros(end, jnp.float32)
    .at[positions]
    .set(values.reshape(-1), mode="drop", unique_indices=True)
  )
  return dense[:size]


# --------------------------------------------------------------------------
# The all-gather reduction, step by step.


def _encode_leaves(leaves: list, spec: TopKSpec, chunks: tuple | None = None):
  """Every leaf's rows, layout and encoding (payload, indices, kept values),
  and one member's payload: the leaves' payloads concatenated. ``chunks``:
  per leaf, its chunk length instead of the spec's (see :func:`layout`)."""
  chunks = (None,) * len(leaves) if chunks is None else chunks
  layouts = [
    layout(x.size, spec, c) for x, c in zip(leaves, chunks, strict=True)
  ]
  rows = [_rows(x, lay) for x, lay in zip(leaves, layouts, strict=True)]
  encoded = [
    _encode_rows(r, lay, spec) for r, lay in zip(rows, layouts, strict=True)
  ]
  payload = jnp.concatenate([p.reshape(-1) for p, _, _ in encoded])
  return layouts, rows, encoded, payload


def _decode_member(payload, layouts, starts, widths, spec: TopKSpec, keep):
  """One member's payload (``(bytes,)``, every leaf's in turn) -> the flat
  positions of its entries in the buffer of all leaves (out of bounds where
  an entry stands for nothing, or the member is left out: ``keep`` False)
  and their values."""
  end = sum(lay.chunks * lay.chunk for lay in layouts)
  positions, values, reals = [], [], []
  for lay, start, begin, stop in zip(
    layouts, starts, widths[:-1], widths[1:], strict=True
  ):
    part = jax.lax.slice_in_dim(payload, int(begin), int(stop))
    index, value, real = _decode_rows(part.reshape(lay.chunks, -1), lay, spec)
    positions.append(_positions(index, lay) + start)
    values.append(value.reshape(-1))
    reals.append(real.reshape(-1))
  reals = jnp.concatenate(reals)
  if keep is not None:  # a left-out member's entries stand for nothing
    reals = reals & keep
  positions = _or_beyond(jnp.concatenate(positions), reals, end)
  return positions, jnp.concatenate(values)


# Up to this many members, their payloads are added in an unrolled Python
# loop; beyond, in a ``lax.fori_loop``, so that the program (and its compile
# time) does not grow with the group. Both add in member order: the same
# bits. Unrolled, XLA's cost analysis counts every member's scatter (it
# counts a loop's body once), so benchmarks.perf.wire_cost's 8 members read
# the same as before.
UNROLLED_MEMBERS = 8


def _sum_payloads(
  gathered: jax.Array, layouts: list, spec: TopKSpec, keep, count=False
):
  """Every member's payload (``(members, bytes)``) decoded and added into
  one float32 buffer holding every leaf at its start (padded), member by
  member in order, rows where ``keep`` is False left out; and the starts.
  Each member's bytes are decoded on their own (a scatter reads only its
  member's decoded entries); beyond :data:`UNROLLED_MEMBERS` members, one
  at a time in a loop. With ``count``, also how many members sent each
  entry (float32, from the decoded indices alone), as a third value."""
  padded = [lay.chunks * lay.chunk for lay in layouts]
  starts = np.cumsum([0] + padded[:-1]).tolist()
  widths = np.cumsum(
    [0] + [lay.chunks * lay.bytes_per_chunk(spec) for lay in layouts]
  )
  keeps = None if keep is None else jnp.reshape(keep, (-1,))
  # Traced once, whatever the members (XLA inlines each call).
  decode = jax.jit(
    functools.partial(
      _decode_member, layouts=layouts, starts=starts, widths=widths, spec=spec
    )
  )

  def add(j, sums):
    positions, values = decode(
      gathered[j], keep=None if keeps is None else keeps[j]
    )
    total, senders = sums
    total = total.at[positions].add(values, mode="drop", unique_indices=True)
    if count:
      senders = senders.at[positions].add(1.0, mode="drop", unique_indices=True)
    return total, senders

  zeros = jnp.zeros(sum(padded), jnp.float32)
  # The first member's sums carry the other members' types (a loop's carry
  # must keep its type under a checking shard_map).
  sums = add(0, (zeros, zeros if count else None))
  members = gathered.shape[0]
  if members <= UNROLLED_MEMBERS:
    for j in range(1, members):  # member order, the same on every member
      sums = add(j, sums)
  else:
    sums = jax.lax.fori_loop(1, members, add, sums)
  total, senders = sums
  return (total, starts, senders) if count else (total, starts)


def _dropped(x_size: int, rows: jax.Array, index, quantizer, spec):
  """Error feedback's residual of a leaf, flat: its contribution minus what
  it sent (``0`` where not finite). A select, one elementwise pass over the
  rows (which XLA fuses with the contribution's ``x + error``): where an
  entry went (a boolean mask, scattered from the selected indices), minus
  what it stands for (:func:`_stands_for`, the encoding's own arithmetic)."""
  chunk_ids = jnp.arange(rows.shape[0])[:, None]
  went = (
    jnp.zeros(rows.shape, bool)
    .at[chunk_ids, index]
    .set(True, unique_indices=True)
  )
  dropped = jnp.where(went, rows - _stands_for(rows, quantizer, spec), rows)
  # A non-finite contribution is not kept: the next step starts afresh.
  return protocol.finite_or_zero(dropped.reshape(-1)[:x_size])


def all_reduce(
  leaves: list,
  axis,
  groups: tuple | None,
  members: int,
  spec: TopKSpec,
  *,
  divisor: int,
  invariant_result: bool,
  residuals: bool = False,
  chunks: tuple | None = None,
  mean_over_senders: bool = False,
):
  """Top-k all-reduce of ``leaves`` (all varying over ``axis``): the contract
  of :func:`shardopt.wire.blocks.all_reduce`.

  ``chunks`` (``shardopt.decoupled_momentum``'s tiles): per leaf, the length
  of its chunks instead of ``spec.chunk_size``, each leaf a whole number of
  them, each keeping ``min(k, chunk)`` entries; still one ``all_gather``.

  ``mean_over_senders`` (``decoupled_momentum(..., mean="senders")``, the
  DeMo authors' rule): each entry's sum is divided by the number of members
  that sent it (0 where none did) instead of by ``divisor``; the count comes
  from the gathered indices, so the same bytes cross the wire.

  Returns the reduced leaves (``sum / divisor``, in each leaf's dtype) and,
  with ``residuals``, each replica's float32 residual in the leaf's shape:
  its contribution minus what it sent (``0`` where not finite). One
  ``all_gather`` of the concatenated payloads of all leaves (within
  ``groups``; typed invariant with ``invariant_result``, a checking
  shard_map without groups); every member adds every member's values in
  member order.
  """
  del members  # the gathered rows say it
  layouts, rows, encoded, payload = _encode_leaves(leaves, spec, chunks)
  if invariant_result:
    gathered = jax.lax.all_gather(payload, axis, to="invarying")
  else:
    gathered = _axes.grouped(
      lambda: jax.lax.all_gather(payload, axis, axis_index_groups=groups),
      "the top-k wire with axis_index_groups",
      blocks.FLOAT_FIX,
      groups=groups,
    )
  if mean_over_senders:  # a float32 division by each entry's senders
    total, starts, senders = _sum_payloads(
      gathered, layouts, spec, None, count=True
    )
    total = jnp.where(senders > 0, total / jnp.maximum(senders, 1.0), 0.0)
  else:
    total, starts = _sum_payloads(gathered, layouts, spec, None)
  if divisor != 1 and not mean_over_senders:  # times the float32 reciprocal,
    total = total * jnp.float32(1.0 / divisor)  # as the blocks wire does
  out, res = [], []
  for x, lay, start, r, (_, index, quantizer) in zip(
    leaves, layouts, starts, rows, encoded, strict=True
  ):
    mine = jax.lax.slice_in_dim(total, start, start + lay.size)
    out.append(mine.reshape(x.shape).astype(x.dtype))
    if residuals:
      res.append(_dropped(x.size, r, index, quantizer, spec).reshape(x.shape))
  return (out, res) if residuals else out


# --------------------------------------------------------------------------
# The wire.


class Sparse(protocol.Base):
  """The top k of every chunk (:func:`topk`): needs error feedback, is
  gathered whole (the sum of sparse contributions is not sparse). Inside a
  step it carries the leaves that keep an error buffer (those varying over
  every axis of the reduction); the others travel dense, in their own
  dtype."""

  sparse = True
  needs_error_feedback = True
  takes_error_feedback = True
  two_phase = False

  def __init__(self, spec: TopKSpec):
    self.spec = spec

  def carries_leaf(self, size, every_axis):
    return size > 0 and every_axis

  rest = dense.OWN  # the leaves all_reduce does not carry

  def reduce(self, x, summing_collective, members, reduction):
    raise NotImplementedError(
      f"comm_dtype={self.spec!r}: the top-k wire is implemented for the"
      " all-reduces of the transforms with error feedback (cross_shard*,"
      " local_sgd, diloco, agn with error_feedback=True), not for this"
      " collective. Use a float comm_dtype (e.g. jnp.bfloat16) here."
    )

  def all_reduce(self, leaves, axis, groups, members, **kwargs):
    return all_reduce(leaves, axis, groups, members, self.spec, **kwargs)

  def encode_whole(self, flats):
    layouts, rows, encoded, payload = _encode_leaves(flats, self.spec)
    dropped = [
      _dropped(x.size, r, index, quantizer, self.spec)
      for x, r, (_, index, quantizer) in zip(flats, rows, encoded, strict=True)
    ]
    return payload, dropped

  def sum_gathered(self, gathered, keep, sizes):
    layouts = [layout(int(s), self.spec) for s in sizes]
    total, starts = _sum_payloads(gathered, layouts, self.spec, keep)
    return [
      jax.lax.slice_in_dim(total, start, start + lay.size)
      for lay, start in zip(layouts, starts, strict=True)
    ]
