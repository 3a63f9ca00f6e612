"""What one island sends in a round, as one row of bytes, and what every
island makes of the gathered rows.

(Each process sends its island's row; the processes of an island of several
send the same bytes, and the combine counts each island once.)

A round is one ``all_gather`` of one row per island (:mod:`.island`): one
collective, so a survivor that fell out of step can never read another
collective's chunk, and every island combines the same bytes in the same
(island id) order, so the center and the outer state come out bit-identical
on every island without a second collective.

Two layouts, agreed without communication (:mod:`.island` says how):

- a **plain round** (every island took part in the last one): the header,
  then the contribution of the sync's pieces on the transform's wire
  (float32, a narrower float, or quantized blocks with their scales);
- a **healing round** (an island joins): the header, the center, the outer
  optimizer's state, then the contribution of every leaf in float32 (zeros
  outside the sync's pieces): a fresh island knows neither the step nor which
  fragment is due, and takes the center, the outer state and the counters
  from the first up-to-date island's row.

The header is int32: :data:`HEADER_FIELDS`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _axes
from shardopt import quantize
from shardopt.finite import all_finite
from shardopt.periodic import split
from shardopt.sparse import TopKSpec

HEADER_FIELDS = (
  "island",  # the island's id (its process index)
  "up_to_date",  # 1: it took part in the last committed round (or is
  # at the job's start with everyone else); 0: it joins now
  "finite",  # 1: its contribution is finite
  "count",  # local steps taken
  "sync_count",  # rounds committed
  "skipped",  # contributions left out so far
  "sync",  # the sync (1-based) it contributes to, 0: none
  "process",  # the sending process (an island may have several)
)
FIELD = {name: i for i, name in enumerate(HEADER_FIELDS)}
HEADER_BYTES = 4 * len(HEADER_FIELDS)


def to_bytes(x: Any) -> jax.Array:
  """Any array as its flat bytes (C order)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def from_bytes(b: jax.Array, like: Any) -> jax.Array:
  """The inverse of :func:`to_bytes` for an array shaped like ``like``."""
  shape, dtype = tuple(np.shape(like)), np.dtype(like.dtype)
  if dtype == np.bool_:
    return b.reshape(shape).astype(bool)
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(b, dtype).reshape(shape)
  return jax.lax.bitcast_convert_type(
    b.reshape(shape + (dtype.itemsize,)), dtype
  )


def nbytes(tree: Any) -> int:
  """Bytes of :func:`to_bytes` over a tree's leaves."""
  return sum(
    math.prod(np.shape(x)) * max(np.dtype(x.dtype).itemsize, 1)
    for x in jax.tree.leaves(tree)
  )


def _split_bytes(b: jax.Array, likes: list) -> list:
  out, start = [], 0
  for like in likes:
    size = nbytes([like])
    out.append(from_bytes(b[start : start + size], like))
    start += size
  return out


def _flat(values: list) -> jax.Array:
  return jnp.concatenate(
    [jnp.ravel(v).astype(jnp.float32) for v in values] or [jnp.zeros([0])]
  )


def _unflat(flat: jax.Array, likes: list) -> list:
  out, start = [], 0
  for like in likes:
    size = math.prod(np.shape(like))
    out.append(flat[start : start + size].reshape(np.shape(like)))
    start += size
  return out


class Wire(NamedTuple):
  """How a plain round's contribution travels: ``comm_dtype``'s wire."""

  comm_dtype: Any  # None, a float dtype or a quantize.QuantizedSpec

  def _layout(self, size: int):
    return quantize.layout(size, 1, self.comm_dtype)

  def _check(self) -> None:
    if isinstance(self.comm_dtype, TopKSpec):
      raise NotImplementedError(
        f"shardopt.elastic: comm_dtype={self.comm_dtype!r}: the top-k wire"
        " is not implemented for elastic islands' rounds. Build the"
        " transform with a float or quantized comm_dtype (e.g. jnp.int8,"
        " error_feedback=True) for shardopt.elastic, or use the top-k wire"
        " on a fixed set of replicas (diloco, local_sgd or agn under"
        " jax.shard_map)."
      )

  def encode(self, flat: jax.Array):
    """``(bytes, kept)``: the payload of a flat float32 vector, and the
    values the receivers will decode from it."""
    self._check()
    spec = self.comm_dtype
    if isinstance(spec, quantize.QuantizedSpec):
      block, blocks = self._layout(flat.size)
      padded = jnp.pad(flat, (0, block * blocks - flat.size))
      payload, kept = quantize._encode(padded.reshape(blocks, block), spec)
      return payload.reshape(-1), kept.reshape(-1)[: flat.size]
    dtype = jnp.float32 if spec is None else spec
    narrow = flat.astype(dtype)
    return to_bytes(narrow), narrow.astype(jnp.float32)

  def decode(self, payload: jax.Array, size: int) -> jax.Array:
    """The flat float32 vector of ``size`` a payload stands for."""
    self._check()
    spec = self.comm_dtype
    if isinstance(spec, quantize.QuantizedSpec):
      block, blocks = self._layout(size)
      return quantize.decode(payload, spec, block, blocks).reshape(-1)[:size]
    dtype = np.dtype(jnp.float32 if spec is None else spec)
    like = jax.ShapeDtypeStruct((size,), dtype)
    return from_bytes(payload, like).astype(jnp.float32)


class Received(NamedTuple):
  """What every island reads from the gathered rows (in island id order)."""

  header: jax.Array  # (islands, fields) int32
  contributions: jax.Array  # (islands, size) float32, as decoded
  center: list | None  # the source's center leaves (healing rounds)
  global_state: list | None  # the source's outer state leaves


def header(
  island: int, up_to_date, finite, state, sync: int, process: int
) -> jax.Array:
  """This process's header row."""
  fields = [
    island,
    up_to_date,
    finite,
    state.count,
    state.sync_count,
    jnp.sum(state.skipped),
    sync,
    process,
  ]
  return jnp.stack([jnp.asarray(f, jnp.int32).reshape(()) for f in fields])


def contribution(
  engine: split.Engine, sync: int, state, params, up_to_date, *, full: bool
):
  """This island's contribution to ``sync``, flat float32 (over the sync's
  pieces, or with ``full`` over every leaf, zeros outside the pieces); its
  finiteness; the error buffers' pieces it adds (error feedback)."""
  if sync == 0:
    mine = []
    parts = ()
  else:
    mine = split.contribution(engine, sync, state, params)
    parts = split.pieces(engine, params, sync)
  error = None
  if engine.error_feedback and mine:
    error = split.take(jax.tree.leaves(state.error), parts)
    mine = [m + e.astype(m.dtype) for m, e in zip(mine, error)]
  finite = jnp.logical_and(
    jnp.asarray(up_to_date, bool),
    all_finite(mine),
  )
  mine = [jnp.where(finite, m, jnp.zeros_like(m)) for m in mine]
  if full:
    zeros = [
      jnp.zeros(jnp.shape(p), jnp.float32) for p in jax.tree.leaves(params)
    ]
    mine = split.put(zeros, parts, [m.astype(jnp.float32) for m in mine])
  return _flat(mine), finite, error, parts


def plain_row(engine, island: int, process: int, sync: int, state, params):
  """A plain round's row; with error feedback, the new error pieces."""
  flat, finite, error, parts = contribution(
    engine, sync, state, params, True, full=False
  )
  payload, kept = Wire(engine.comm_dtype).encode(flat)
  head = header(island, 1, finite, state, sync, process)
  row = jnp.concatenate([to_bytes(head), payload])
  if error is not None:
    likes = split.take(jax.tree.leaves(params), parts)
    error = [
      jnp.where(finite, e, jnp.zeros_like(e))
      for e in _unflat(flat - kept, likes)
    ]
  return row, error


def healing_row(
  engine, island: int, process: int, sync: int, up_to_date, state, params
):
  """A healing round's row (see the module docstring)."""
  flat, finite, _, _ = contribution(
    engine, sync, state, params, up_to_date, full=True
  )
  head = header(island, up_to_date, finite, state, sync, process)
  parts = [to_bytes(head)]
  parts += [to_bytes(c) for c in jax.tree.leaves(state.center)]
  parts += [to_bytes(g) for g in jax.tree.leaves(state.global_state)]
  parts.append(to_bytes(flat))
  return jnp.concatenate(parts)


def sort_key(island, process):
  """Rows sort by island, then process (a process index is below 2**16)."""
  return island * 65536 + process


def _sorted(rows: jax.Array):
  """The rows in (island, process) order, and their headers."""
  head = jax.lax.bitcast_convert_type(
    rows[:, :HEADER_BYTES].reshape(rows.shape[0], -1, 4), jnp.int32
  )
  order = jnp.argsort(
    sort_key(head[:, FIELD["island"]], head[:, FIELD["process"]])
  )
  return rows[order], head[order]


def first_of_island(island) -> Any:
  """Per sorted row, whether it is its island's first (the processes of an
  island send the same row: it counts once)."""
  xp = jnp if isinstance(island, jax.Array) else np
  return xp.concatenate([xp.ones([1], bool), island[1:] != island[:-1]])


def read_plain(engine, sync: int, rows: jax.Array, params) -> Received:
  """The gathered rows of a plain round."""
  rows, head = _sorted(rows)
  parts = split.pieces(engine, params, sync)
  size = sum(
    math.prod(np.shape(p)) for p in split.take(jax.tree.leaves(params), parts)
  )
  wire = Wire(engine.comm_dtype)
  payload = rows[:, HEADER_BYTES:]
  contributions = jax.vmap(lambda p: wire.decode(p, size))(payload)
  return Received(head, contributions, None, None)


def read_healing(rows: jax.Array, state, params) -> Received:
  """The gathered rows of a healing round: the source is the first
  up-to-date island (the first island at the job's start)."""
  rows, head = _sorted(rows)
  up = head[:, FIELD["up_to_date"]] > 0
  source = jnp.where(jnp.any(up), jnp.argmax(up), 0)
  centers = jax.tree.leaves(state.center)
  outer_leaves = jax.tree.leaves(state.global_state)
  body = rows[:, HEADER_BYTES:]
  n_center, n_outer = nbytes(centers), nbytes(outer_leaves)
  mine = body[source]
  center = _split_bytes(mine[:n_center], centers)
  outer_state = _split_bytes(mine[n_center : n_center + n_outer], outer_leaves)
  size = sum(math.prod(np.shape(p)) for p in jax.tree.leaves(params))
  flat = jax.vmap(
    lambda b: from_bytes(b, jax.ShapeDtypeStruct((size,), jnp.float32))
  )(body[:, n_center + n_outer :])
  return Received(head, flat, center, outer_state)


def combine(engine, received: Received) -> tuple[jax.Array, jax.Array]:
  """The combined contribution (flat) over the islands that contribute
  (up to date and finite), each once, summed in island id order; and their
  count."""
  head = received.header
  weight = (head[:, FIELD["up_to_date"]] > 0) & (head[:, FIELD["finite"]] > 0)
  weight = weight & first_of_island(head[:, FIELD["island"]])
  masked = jnp.where(weight[:, None], received.contributions, 0.0)
  total = jnp.sum(masked, axis=0)
  count = jnp.sum(weight.astype(jnp.float32))
  if engine.reduction == "mean":
    total = total / jnp.maximum(count, 1.0)
  return total, count


def pieces_of(flat: jax.Array, params, parts, *, full: bool) -> list:
  """The pieces of a flat combined contribution."""
  leaves = jax.tree.leaves(params)
  if full:
    return split.take(_unflat(flat, leaves), parts)
  likes = split.take(leaves, parts)
  return [
    x.astype(_axes.accumulation_dtype(like.dtype))
    for x, like in zip(_unflat(flat, likes), likes)
  ]
