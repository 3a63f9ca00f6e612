"""The commit: a round's results on this island, with no collective.

Every island holds the same sums in the same (island) order after the
exchange (:mod:`.exchange`), so every island commits alike:

1. the gathered headers say which rows count (up to date, finite, an
   island's first process) and with which weight (:func:`read`);
2. the sums over the total weight of the counted rows
   (:func:`.rows.combined_plain`, :mod:`shardopt.wire.mean`);
3. the outer optimizer moves the center and the sync's leaves land on it
   (:func:`apply`: :func:`.split.apply`);
4. with params sharded over the island's devices, each device its own
   shards, put back together as whole arrays (:mod:`.shards`).

A healing round commits through :mod:`.heal`, which adopts the source's
center first and then runs the same :func:`apply`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt.elastic import quorum
from shardopt.elastic import rows
from shardopt.elastic import shards
from shardopt.periodic import split


class Counted(NamedTuple):
  """What a round's gathered headers say (the same on every island)."""

  sync: int  # the sync the round ran (a healing round's: its source's)
  left_out: bool  # this island was up to date, its contribution not finite
  skipped: int  # the up-to-date islands whose contribution was not finite
  contributors: tuple  # the processes whose contribution the mean counted
  weights: tuple  # ((process, weight), ...) of the contributors
  digests: tuple  # ((process, digest), ...) of the contributors
  joined: tuple  # the processes that joined in this round


def read(
  healing: bool, sync: int, exchanged, process: int, *, dedicated, trains
) -> Counted:
  """Step 1: the round's headers, read on the host (of a dict of per-device
  results, the first device's: every device reads the same headers)."""
  any_x = (
    next(iter(exchanged.values())) if isinstance(exchanged, dict) else exchanged
  )
  if healing:
    head = rows.sorted_columns(np.asarray(any_x[:, : rows.HEADER_BYTES]))
  else:
    head = rows.columns(np.asarray(any_x.header))
  up = head["up_to_date"] > 0
  source = int(np.argmax(up)) if up.any() else 0
  if healing:
    sync = int(head["sync"][source]) if up.any() else 0
  contributing = up & (head["finite"] > 0)
  me = int(np.flatnonzero(head["process"] == process)[0])
  first = rows.first_of_island(head["island"])
  trained = (head["process"] != 0) if dedicated else True
  counted = head["process"][contributing]
  return Counted(
    sync=sync,
    left_out=bool(up[me] and not contributing[me]) and trains,
    skipped=int(np.sum(up & ~contributing & first & trained)),
    contributors=tuple(int(p) for p in counted),
    weights=tuple(
      (int(p), int(w))
      for p, w in zip(counted, head["weight"][contributing], strict=True)
    ),
    digests=tuple(
      (int(p), int(d))
      for p, d in zip(counted, head["digest"][contributing], strict=True)
    ),
    joined=tuple(int(i) for i in head["process"][~up]) if up.any() else (),
  )


def apply_plain(
  engine,
  sync,
  islands,
  exchanged,
  params,
  state,
  left_out,
  skipped,
  dropped,
  chunk,
):
  """Steps 2-3 of a plain round: the mean over the contributing islands
  (:func:`.rows.combined_plain`), then :func:`apply`; with error feedback
  the new error pieces are what the wire dropped in both phases
  (:func:`.rows.with_owned`)."""
  combined, count = rows.combined_plain(engine, exchanged, params, sync)
  error = None
  if engine.error_feedback:
    error = rows.with_owned(dropped, exchanged.dropped, chunk, islands)
  return apply(
    engine, sync, state, params, combined, count, left_out, skipped, error
  )


def apply(
  engine, sync, state, params, combined, count, left_out, skipped, error
):
  """Step 3: :func:`.split.apply` of a round's combined pieces; ``count``:
  the total weight (:func:`.rows.total_weight`); ``error``: error
  feedback's new pieces, flat (used only with error feedback)."""
  pieces = None
  if engine.error_feedback:
    likes = split.take(
      jax.tree.leaves(params), split.pieces(engine, params, sync)
    )
    pieces = [
      e.reshape(np.shape(like)) for e, like in zip(error, likes, strict=True)
    ]
  return split.apply(
    engine,
    sync,
    state,
    params,
    combined,
    any_contribution=count > 0,
    left_out=left_out,
    skipped=skipped,
    error=pieces,
  )


class Commit:
  """This island's commits: the jitted programs of steps 2-3, run on its
  devices (step 4).

  Args:
    engine: the transform's engine (:func:`.split.engine_of`).
    jit: ``jit(key, fn, **kwargs)``, the island's cache of programs.
    island: this island's index.
    processes_per_island, dedicated: as :class:`.quorum.Quorum`'s.
    replicated: a sharding replicated over the island's devices.
  """

  def __init__(
    self,
    engine,
    jit: Callable,
    *,
    island: int,
    processes_per_island: int,
    dedicated: bool,
    replicated,
  ):
    self._engine, self._jit = engine, jit
    self._island, self._k, self._dedicated = (
      island,
      processes_per_island,
      dedicated,
    )
    self._replicated = replicated

  def plain(self, sync: int, order: list) -> tuple[Callable, tuple]:
    """A plain round's commit program over ``order``, and its extra
    argument (the chunk this island owns)."""
    owners, islands = quorum.owners(order, self._k, self._dedicated)
    ranks = [
      int(rows.island_of(d.process_index, self._k, self._dedicated))
      for d in order
    ]
    chunk = int(owners[ranks.index(self._island)])
    engine = self._engine
    fn = self._jit(
      ("apply", sync, islands),
      lambda x, p, s, lo, sk, d, c: apply_plain(
        engine, sync, islands, x, p, s, lo, sk, d, c
      ),
    )
    return fn, (jnp.int32(chunk),)

  def run(
    self,
    fn,
    exchanged,
    params,
    state,
    counted: Counted,
    dropped,
    extra: tuple = (),
  ):
    """``fn(exchanged, params, state, left_out, skipped, dropped, *extra)``
    on this island: with sharded params (``exchanged`` per device) shard by
    shard, then whole arrays again."""
    flags = (jnp.asarray(counted.left_out), jnp.int32(counted.skipped))
    if isinstance(exchanged, dict):  # each device its own shards
      local_p = shards.local_trees(params, list(exchanged), "a params")
      local_s = shards.local_trees(state, list(exchanged), "a state")
      out = {
        d: fn(x, local_p[d], local_s[d], *flags, dropped[d], *extra)
        for d, x in exchanged.items()
      }
      params = shards.global_tree({d: o[0] for d, o in out.items()}, params)
      state = shards.global_tree({d: o[1] for d, o in out.items()}, state)
      return params, state
    exchanged = jax.tree.map(self._on_island, exchanged)
    return fn(exchanged, params, state, *flags, dropped, *extra)

  def _on_island(self, x: jax.Array) -> jax.Array:
    """A value on one device of this island, replicated on all of them."""
    return jax.make_array_from_single_device_arrays(
      x.shape,
      self._replicated,
      [jax.device_put(x, d) for d in self._replicated.addressable_devices],
    )
