"""Healing: a joining island takes the center, the outer state and the
counters from an up-to-date island's row.

A round is a healing one when some member did not take part in the last
committed round (:meth:`.quorum.Quorum.healing`; the job's start too).
Every member then sends one row (:func:`.rows.healing_row`: its header, its
center, its outer optimizer's state and its contribution in float32;
weight 0 if it joins now), gathered by everyone (:mod:`.exchange`), and:

1. everyone adopts the source's center, outer state and counters (the
   first up-to-date island's row; bit for bit what the up-to-date islands
   hold) (:func:`heal`);
2. a fresh island also takes the center as its params, zero error buffers
   and a restarted inner optimizer (its moments described its own past,
   which the center is not);
3. if a sync was due, it runs on the adopted state (:func:`heal_sync`), as
   a plain round's commit would (:func:`.commit.apply`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from shardopt.elastic import commit
from shardopt.elastic import rows
from shardopt.periodic import split


class Heal:
  """This island's healing programs (its row, its adoption), jitted once.

  Args:
    engine: the transform's engine (:func:`.split.engine_of`).
    jit: ``jit(key, fn, **kwargs)``, the island's cache of programs.
    process, island: this process's index and its island's.
    trains: False on the dedicated coordinator (it contributes nothing).
    replicated: a sharding replicated over the island's devices.
  """

  def __init__(
    self, engine, jit: Callable, *, process, island, trains, replicated
  ):
    self._engine, self._jit = engine, jit
    self._process, self._island, self._trains = process, island, trains
    self._replicated = replicated

  def row(self, sync: int, params, state, up: bool, weight, local=False):
    """This island's row of a healing round (on its devices; ``local``: of
    one device's shards, on it), and what the wire's encoding dropped from
    its contribution (error feedback). ``up``: it took part in the last
    committed round; ``weight``: :func:`.rows.island_weight`'s."""
    engine, me, island, trains = (
      self._engine,
      self._process,
      self._island,
      self._trains,
    )
    fn = self._jit(
      ("healing_row", sync, up, local),
      lambda s, p, w: rows.healing_row(
        engine, island, me, sync, up, s, p, trains, w
      ),
      **({} if local else {"out_shardings": self._replicated}),
    )
    return fn(state, params, weight)

  def adopt(self, sync: int, fresh: bool) -> Callable:
    """The commit program of a healing round (:func:`heal`)."""
    engine = self._engine
    return self._jit(
      ("heal", sync, fresh),
      lambda g, p, s, lo, sk, d: heal(engine, sync, fresh, g, p, s, lo, sk, d),
    )


def heal(
  engine, sync, fresh, gathered, params, state, left_out, skipped, dropped=()
):
  """A healing round: everyone adopts the source's center, outer state and
  counters (bit for bit what the up-to-date islands hold); a fresh island
  also its params (the center) and a restarted local optimizer."""
  received = rows.read_healing(gathered, state, params)
  head = received.header
  up = head[:, rows.FIELD["up_to_date"]] > 0
  source = jnp.where(jnp.any(up), jnp.argmax(up), 0)
  field = lambda name: head[source, rows.FIELD[name]]  # noqa: E731
  treedef = jax.tree.structure(params)
  center = treedef.unflatten(received.center)
  state = state._replace(
    center=center,
    global_state=jax.tree.unflatten(
      jax.tree.structure(state.global_state), received.global_state
    ),
    # An up-to-date island keeps its own step count (the same as the
    # source's, but on rounds on the clock, where islands step at their own
    # pace); a fresh one takes the source's.
    count=field("count").astype(state.count.dtype) if fresh else state.count,
    sync_count=field("sync_count").astype(state.sync_count.dtype),
    skipped=jnp.full_like(state.skipped, field("skipped")),
  )
  if fresh:
    params = jax.tree.map(lambda c, p: c.astype(p.dtype), center, params)
    state = state._replace(
      accumulator=jax.tree.map(jnp.zeros_like, state.accumulator),
      error=jax.tree.map(jnp.zeros_like, state.error),
      restart=jnp.zeros_like(state.restart),
    )
  if sync:
    params, state = heal_sync(
      engine, sync, received, params, state, left_out, skipped, dropped
    )
  if fresh:  # the inner optimizer restarts where the island trains from
    state = state._replace(local_state=engine.optimizer.init(params))
  return params, state


def heal_sync(
  engine, sync, received, params, state, left_out, skipped, dropped
):
  """The sync of a healing round, on the adopted state. Its rows carry what
  a plain round's wire would have delivered (:func:`.rows.on_the_wire`), so
  error feedback's pieces are what that encoding dropped (``dropped``; zero
  for a fresh island, which contributed nothing)."""
  parts = split.pieces(engine, params, sync)
  combined, count = rows.combined_healing(engine, received, params, parts)
  if not len(dropped):  # a fresh island: nothing was sent, nothing dropped
    dropped = [
      jnp.zeros(np.size(x), jnp.float32)
      for x in split.take(jax.tree.leaves(params), parts)
    ]
  return commit.apply(
    engine, sync, state, params, combined, count, left_out, skipped, dropped
  )
