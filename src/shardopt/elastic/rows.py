"""What one island sends in a round, and what every island makes of it.

A round is one collective program over the live islands' processes
(:mod:`.island`), built on the transform's wire (:mod:`shardopt.wire`), and
every island combines the same bytes in the same (island, process) order,
so the center and the outer state come out bit-identical on every island.

Two layouts, agreed without communication (:mod:`.island` says how):

- a **plain round** (every island took part in the last one): the sync's
  pieces on the transform's wire. A two-phase wire (float, quantized
  blocks) cuts every piece into one chunk per island; each process sends
  every other process the header and the chunk that process's island owns
  (one ``all_to_all``), every process sums the chunk its island owns over
  the contributing islands, in island order, and encodes the sum again; one
  ``all_gather`` gives everyone every island's sum (:func:`exchange`). An
  island sends about twice its payload, however many islands there are.
  The top-k wire (the sum of sparse rows is not sparse) is gathered whole:
  one ``all_gather`` of every process's header and payload, summed by
  everyone in island order.
- a **healing round** (an island joins): one ``all_gather`` of rows of the
  header, the center, the outer optimizer's state, then the contribution of
  every leaf in float32 (zeros outside the sync's pieces): a fresh island
  knows neither the step nor which fragment is due, and takes the center,
  the outer state and the counters from the first up-to-date island's row.

(The processes of an island of several send the same bytes, and the combine
counts each island once.) The header is :data:`HEADER_FIELDS`, int32 words;
the weight's word holds a float32's bits (:func:`weights`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _axes
from shardopt import wire as _wire
from shardopt.finite import all_finite
from shardopt.periodic import split
from shardopt.wire import feedback
from shardopt.wire import mean

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
  "weight",  # its contribution's weight: 1, or on rounds on the clock the
  # work it did since its last committed round (0: none); a float32's bits,
  # so that no count of steps times tokens per step overflows it
  "digest",  # a checksum of its contribution's bytes (:func:`digest`), so
  # that a log can tell which contribution a committed round combined
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


class Received(NamedTuple):
  """What every island reads from a healing round's gathered rows (in
  island, process order)."""

  header: jax.Array  # (processes, fields) int32
  contributions: jax.Array  # (processes, size) float32
  center: list | None  # the source's center leaves
  global_state: list | None  # the source's outer state leaves


class Exchanged(NamedTuple):
  """What a plain round's :func:`exchange` gives every process."""

  header: jax.Array  # (processes, fields) int32, in (island, process) order
  totals: list  # per piece, flat float32: the contributors' sum
  dropped: list  # per piece, flat float32: what re-encoding the chunk this
  # process's island owns dropped (two-phase wires; empty otherwise)


def header(
  island: int,
  up_to_date,
  finite,
  state,
  sync: int,
  process: int,
  weight=1,
  contribution_digest=0,
) -> jax.Array:
  """This process's header row (int32 words; the weight a float32's bits,
  :func:`weights`; ``contribution_digest``: :func:`digest` of what it
  contributes)."""
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
  weight_bits = jax.lax.bitcast_convert_type(
    jnp.asarray(weight, jnp.float32).reshape(()), jnp.int32
  )
  return jnp.stack(
    [jnp.asarray(f, jnp.int32).reshape(()) for f in fields]
    + [weight_bits, jnp.asarray(contribution_digest, jnp.int32).reshape(())]
  )


def digest(flats: list) -> jax.Array:
  """A checksum of a contribution (its pieces, flat float32) as an int32:
  every word's bits times an odd number that depends on its position, summed
  modulo 2**32, piece after piece (FNV's prime between them). Cheap (one
  pass) and deterministic, not cryptographic: a log compares it between the
  island that sent a contribution and the islands that combined it."""
  total = jnp.uint32(0)
  for flat in flats:
    bits = jax.lax.bitcast_convert_type(
      jnp.ravel(flat).astype(jnp.float32), jnp.uint32
    )
    odd = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + 1
    total = total * jnp.uint32(16777619) + jnp.sum(bits * odd, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(total, jnp.int32)


# An island's weight, one path from the island to the mean: the island's
# host computes it (island_weight: None, or its work as a float32), its row
# builders weigh its contribution with it (contribution: mean.weight, then
# mean.weigh) and carry it in the header's weight word (header_weight); every
# island reads the word back (weights, columns) and divides the sums by the
# counted rows' total (total_weight, then mean.divide).


def island_weight(clocked: bool, counts: bool, steps: int, work_per_step):
  """An island's weight in a round, on its host: None on rounds every
  ``sync_period`` steps (a contribution that counts weighs 1: the mean's
  flag, :func:`shardopt.wire.mean.weight`); on rounds on the clock, the
  work it did since its last committed round (``steps`` times
  ``work_per_step``) as the float32 it travels as, 0 where it ``counts``
  not (the dedicated coordinator, a joining island)."""
  if not clocked:
    return None
  if not counts:
    return jnp.float32(0)
  # float32, as it travels (weights): steps times work_per_step (below
  # 2**71) never overflows it.
  return jnp.float32(float(max(steps, 0) * work_per_step))


def header_weight(weight):
  """The header's weight word for :func:`island_weight`'s ``weight``: 1
  where no weight is given."""
  return 1 if weight is None else weight


def weights(head) -> Any:
  """The weight column of headers (rows of int32 words, a jax or a numpy
  array) as float32: exact up to 2**24, rounded to float32 above (the
  precision of the mean's arithmetic)."""
  column = head[:, FIELD["weight"]]
  if isinstance(column, jax.Array):
    return jax.lax.bitcast_convert_type(column, jnp.float32)
  return np.ascontiguousarray(column, np.int32).view(np.float32)


def columns(head: np.ndarray) -> dict:
  """Headers (rows of int32 words, numpy) as field -> column, the weight's
  as float32 (:func:`weights`)."""
  out = {name: head[:, i] for name, i in FIELD.items()}
  out["weight"] = weights(head)
  return out


def sorted_columns(head_bytes: np.ndarray) -> dict:
  """Gathered headers' bytes (numpy), sorted by (island, process), as
  :func:`columns`."""
  head = head_bytes.copy().view(np.int32).reshape(head_bytes.shape[0], -1)
  key = sort_key(head[:, FIELD["island"]], head[:, FIELD["process"]])
  return columns(head[np.argsort(key, kind="stable")])


def contribution(engine, sync: int, state, params, up_to_date, weight=None):
  """This island's contribution to ``sync``: per piece of the sync, flat
  float32 (with error feedback, plus its error buffer: :mod:`shardopt.wire
  .feedback`), times ``weight`` if one is given (rounds on the clock: the
  work done); its finiteness (zeros if not finite or not up to date)."""
  if sync == 0:
    return [], jnp.asarray(up_to_date, bool)
  mine = [
    m.reshape(-1) for m in split.contribution(engine, sync, state, params)
  ]
  if engine.error_feedback:
    parts = split.pieces(engine, params, sync)
    error = split.take(jax.tree.leaves(state.error), parts)
    mine = [
      feedback.add(m, e.reshape(-1), engine.wire)
      for m, e in zip(mine, error, strict=True)
    ]
  mine = [m.astype(jnp.float32) for m in mine]
  finite = jnp.logical_and(jnp.asarray(up_to_date, bool), all_finite(mine))
  return mean.weigh(mine, mean.weight(finite, weight)), finite


def total_weight(head: jax.Array) -> jax.Array:
  """The sum of the counted rows' weights (:func:`counted`): the mean's
  divisor (the number of contributing islands when every weight is 1)."""
  return jnp.sum(counted(head).astype(jnp.float32) * weights(head))


def sizes_of(engine, sync: int, params) -> tuple:
  """Elements of each piece of ``sync``."""
  parts = split.pieces(engine, params, sync)
  return tuple(
    math.prod(np.shape(p)) for p in split.take(jax.tree.leaves(params), parts)
  )


def island_of(process, processes_per_island: int, coordinator: bool = False):
  """The island of a process (or an array of them): ``processes_per_island``
  consecutive processes form one; with a dedicated coordinator, process 0
  is island 0 alone and the islands start at process 1."""
  process = np.asarray(process)
  if not coordinator:
    return process // processes_per_island
  return np.where(process == 0, 0, (process - 1) // processes_per_island + 1)


def islands_of(
  processes, processes_per_island: int, coordinator: bool = False
) -> np.ndarray:
  """Per process (in mesh order), the rank of its island among the live
  islands: the chunk of a two-phase wire its island owns."""
  islands = island_of(processes, processes_per_island, coordinator)
  return np.searchsorted(np.unique(islands), islands).astype(np.int32)


def plain_rows(
  engine,
  island: int,
  process: int,
  sync: int,
  state,
  params,
  owners,
  islands: int,
  trains: bool = True,
  weight=None,
):
  """A plain round's rows: ``(rows, dropped)``.

  On a two-phase wire ``rows`` is ``(processes, bytes)``: row ``q`` is the
  header and the chunk of every piece that island ``owners[q]`` owns (the
  destination process's island rank, :func:`islands_of`); on the top-k wire
  one row, the header and the payload. ``dropped``: per piece, flat, what
  the encoding dropped from the contribution (error feedback keeps it).
  A dedicated coordinator (``trains`` False) contributes nothing;
  ``weight``: the contribution's (rounds on the clock), else 1.
  """
  flats, finite = contribution(engine, sync, state, params, trains, weight)
  wire = engine.wire
  word = header_weight(weight)
  head = to_bytes(
    header(island, 1, finite, state, sync, process, word, digest(flats))
  )
  if wire.two_phase:
    plan = wire.plan(sizes_of(engine, sync, params), islands)
    chunks, dropped = wire.scatter(flats, plan)
    chunks = chunks[jnp.asarray(owners)]
    heads = jnp.broadcast_to(head, (chunks.shape[0], head.size))
    rows = jnp.concatenate([heads, chunks], axis=-1)
  else:
    payload, dropped = wire.encode_whole(flats)
    rows = jnp.concatenate([head, payload])
  return rows, mean.weigh(dropped, finite)


def _headers(rows: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(
    rows[:, :HEADER_BYTES].reshape(rows.shape[0], -1, 4), jnp.int32
  )


def _canonical(rows: jax.Array):
  """The rows in (island, process) order, their headers, and the order."""
  head = _headers(rows)
  order = jnp.argsort(
    sort_key(head[:, FIELD["island"]], head[:, FIELD["process"]])
  )
  return rows[order], head[order], order


def counted(head: jax.Array) -> jax.Array:
  """Per row (in (island, process) order), whether its contribution counts:
  up to date, finite, and its island's first process (the processes of an
  island send the same row: it counts once)."""
  return (
    (head[:, FIELD["up_to_date"]] > 0)
    & (head[:, FIELD["finite"]] > 0)
    & first_of_island(head[:, FIELD["island"]])
  )


def exchange(engine, sizes: tuple, rows: jax.Array, axis, islands: int):
  """A plain round's collective program, inside a ``shard_map`` over the
  live processes (``axis``; one device each): ``rows`` is this process's
  :func:`plain_rows`. Returns :class:`Exchanged`, the same bits on every
  process but ``dropped``.

  Two-phase wire: 1. one ``all_to_all`` of the rows; 2. the received rows in
  (island, process) order, each island's first counted once (the chunk this
  process's island owns, summed); 3. the sum encoded again; 4. one
  ``all_gather``; 5. every island's chunk decoded. Top-k wire: one
  ``all_gather`` of the rows, summed in (island, process) order.
  """
  wire = engine.wire
  if not wire.two_phase:
    gathered = jax.lax.all_gather(rows.reshape(1, -1), axis, tiled=True)
    gathered, head, _ = _canonical(gathered)
    totals = wire.sum_gathered(gathered[:, HEADER_BYTES:], counted(head), sizes)
    return Exchanged(head, totals, [])
  plan = wire.plan(sizes, islands)
  received = jax.lax.all_to_all(rows, axis, 0, 0)
  received, head, order = _canonical(received)
  owned = wire.sum_rows(received[:, HEADER_BYTES:], counted(head), plan)
  payload, dropped = wire.encode_owned(owned, plan)
  gathered = jax.lax.all_gather(payload, axis)
  # Row q of ``gathered`` is the chunk of the island of the process at mesh
  # position q: take each island's first process's, in island order.
  first = jnp.nonzero(first_of_island(head[:, FIELD["island"]]), size=islands)[
    0
  ]
  totals = wire.decode_gathered(gathered[order[first]], plan)
  return Exchanged(head, totals, dropped)


def with_owned(dropped: list, owned: list, chunk, islands: int) -> list:
  """Error feedback's new error pieces (flat): what phase 1 dropped, plus,
  on the chunk this island owns (``chunk``), what phase 2 dropped."""
  if not owned:
    return dropped
  out = []
  for d, o in zip(dropped, owned, strict=True):
    per = o.size
    padded = jnp.pad(d, (0, islands * per - d.size))
    start = jnp.asarray(chunk, jnp.int32) * per
    mine = jax.lax.dynamic_slice_in_dim(padded, start, per) + o
    padded = jax.lax.dynamic_update_slice_in_dim(padded, mine, start, 0)
    out.append(padded[: d.size])
  return out


def on_the_wire(engine, flats: list) -> tuple[list, list]:
  """``(kept, dropped)``: what a plain round's encoding on the transform's
  wire delivers of each piece (flat float32) and what it drops (error
  feedback keeps it). A healing round carries ``kept`` in float32, so that
  error feedback's buffer is spent as a plain round spends it: sent whole,
  the top-k wire's buffer (most of every outer gradient since the last
  rounds) would land on the center at once."""
  wire = engine.wire
  if wire.two_phase:
    sizes = tuple(f.size for f in flats)
    _, dropped = wire.scatter(flats, wire.plan(sizes, 1))
  else:
    _, dropped = wire.encode_whole(flats)
  kept = [f - d for f, d in zip(flats, dropped, strict=True)]
  return kept, dropped


def healing_row(
  engine,
  island: int,
  process: int,
  sync: int,
  up_to_date,
  state,
  params,
  trains: bool = True,
  weight=None,
):
  """A healing round's row (see the module docstring) and, with error
  feedback, what the wire's encoding dropped from this island's
  contribution (:func:`on_the_wire`; empty without a sync). A dedicated
  coordinator (``trains`` False) contributes nothing; ``weight`` as
  :func:`plain_rows`'."""
  mine, finite = contribution(
    engine, sync, state, params, up_to_date and trains, weight
  )
  dropped, sent = [], digest(mine)
  if sync and engine.error_feedback:
    mine, dropped = on_the_wire(engine, mine)
    dropped = mean.weigh(dropped, finite)
  # Every leaf, zeros outside the sync's pieces (all zeros without a sync).
  full = [jnp.zeros(jnp.shape(p), jnp.float32) for p in jax.tree.leaves(params)]
  if sync:
    parts = split.pieces(engine, params, sync)
    likes = split.take(full, parts)
    full = split.put(
      full,
      parts,
      [m.reshape(np.shape(like)) for m, like in zip(mine, likes, strict=True)],
    )
  word = header_weight(weight)
  head = header(island, up_to_date, finite, state, sync, process, word, sent)
  parts = [to_bytes(head)]
  parts += [to_bytes(c) for c in jax.tree.leaves(state.center)]
  parts += [to_bytes(g) for g in jax.tree.leaves(state.global_state)]
  parts.append(to_bytes(_flat(full)))
  return jnp.concatenate(parts), dropped


def sort_key(island, process):
  """Rows sort by island, then process (a process index is below 2**16)."""
  return island * 65536 + process


def first_of_island(island) -> Any:
  """Per sorted row, whether it is its island's first (the processes of an
  island send the same row: it counts once)."""
  xp = jnp if isinstance(island, jax.Array) else np
  return xp.concatenate([xp.ones([1], bool), island[1:] != island[:-1]])


def read_healing(rows: jax.Array, state, params) -> Received:
  """The gathered rows of a healing round: the source is the first
  up-to-date island (the first island at the job's start)."""
  rows, head, _ = _canonical(rows)
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


def combined_healing(engine, received: Received, params, parts) -> tuple:
  """A healing round's mean over the contributing islands (each once, in
  island order), as the sync's pieces; and their count."""
  keep = counted(received.header)
  total = _wire.protocol.sum_in_order(received.contributions, keep)
  count = total_weight(received.header)
  (total,) = mean.divide([total], count, engine.reduction)
  return split.take(_unflat(total, jax.tree.leaves(params)), parts), count


def combined_plain(engine, exchanged: Exchanged, params, sync: int) -> tuple:
  """A plain round's mean over the contributing islands, as the sync's
  pieces in their accumulation dtype; and their count."""
  count = total_weight(exchanged.header)
  totals = mean.divide(exchanged.totals, count, engine.reduction)
  likes = split.take(
    jax.tree.leaves(params), split.pieces(engine, params, sync)
  )
  return [
    t.reshape(np.shape(like)).astype(_axes.accumulation_dtype(like.dtype))
    for t, like in zip(totals, likes, strict=True)
  ], count
