"""Which devices, in which order, run a round's collective.

On the CPU (gloo), a collective's communicator is keyed by its ordered device
list, both in each process's cache and in the coordination service's
rendezvous keys. A process that died leaves both behind: a restarted one
cannot rendezvous under the old key (``ALREADY_EXISTS``), and the survivors
would reuse a cached communicator whose peer is gone (``Connection closed by
peer``). So every *membership* (the live processes, each with its
incarnation id, and how many attempts of it failed) runs its rounds on a
device list the job has never used before, and every process must know that
list before the first collective.

Process 0 hosts the coordination service, takes part in every round and
never restarts (its death ends the job), so it has seen every list the job
used. It picks the first unused one (one device per island, in some order of
the islands) and publishes it in the coordination service's key-value store
under the membership's name; the other processes read it there. A fresh
process blocks on that read, outside any collective, until process 0 reaches
the same round: which is how a restarted island waits for the survivors'
next sync without timing out a collective.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

from shardopt import _jax

Membership = tuple  # ((process index, incarnation id), ...), sorted


def membership(devices: Sequence[Any], incarnations: dict) -> Membership:
  """The live processes and their incarnations, sorted."""
  return tuple(sorted({(d.process_index, incarnations[d]) for d in devices}))


def by_process(devices: Sequence[Any]) -> dict[int, list]:
  """The devices of each process, sorted by id."""
  out: dict[int, list] = {}
  for d in sorted(devices, key=lambda d: d.id):
    out.setdefault(d.process_index, []).append(d)
  return out


def candidates(islands: dict[int, list]):
  """Every device list with one device per island: the islands in every
  order, each with each of its devices; the sorted first-device list first."""
  ids = sorted(islands)
  for choice in itertools.product(*(range(len(islands[i])) for i in ids)):
    pick = {i: islands[i][c] for i, c in zip(ids, choice, strict=True)}
    for order in itertools.permutations(ids):
      yield [pick[i] for i in order]


class Cliques:
  """The device list of each membership's attempts, the same on every
  process (see the module docstring)."""

  def __init__(self, store: _jax.KeyValueStore, *, timeout_s: float):
    self._store = store
    self._timeout_s = timeout_s
    self._used: set[tuple[int, ...]] = set()
    self._known: dict[str, list] = {}

  @staticmethod
  def key(members: Membership, attempt: int) -> str:
    digest = hashlib.sha256(repr((members, attempt)).encode()).hexdigest()
    return f"shardopt/elastic/clique/{digest[:32]}"

  def devices(
    self, members: Membership, attempt: int, live: Sequence[Any], me: int
  ) -> list:
    """The device list for this attempt of ``members`` (``me``: this
    process's index; process 0 chooses, the others read)."""
    key = self.key(members, attempt)
    if key in self._known:
      return self._known[key]
    islands = by_process(live)
    by_id = {d.id: d for d in live}
    ids = self._agree(
      key,
      me,
      (tuple(d.id for d in order) for order in candidates(islands)),
      lambda ids: [ids],
      f"every device order of the live islands {sorted(islands)} has been"
      " used by an earlier membership",
      " Restart the job, or give each island more local devices.",
    )
    order = [by_id[i] for i in ids]
    self._known[key] = order
    return order

  def matrix(
    self,
    members: Membership,
    attempt: int,
    live: Sequence[Any],
    me: int,
    island_of,
  ) -> list[list]:
    """The device matrix of a model-parallel round (:mod:`.shards`): one
    row per island (its devices sorted by id), the islands in an order
    whose every column (one gloo clique each) the job never used. Only the
    islands' order can change (a column must hold the same position on
    every island): m! matrices per membership of m islands."""
    key = self.key(members, attempt) + "/matrix"
    if key in self._known:
      return self._known[key]
    rows: dict[int, list] = {}
    for d in sorted(live, key=lambda d: d.id):
      rows.setdefault(island_of(d.process_index), []).append(d)

    def columns(order) -> list[tuple[int, ...]]:
      width = len(rows[order[0]])
      return [tuple(rows[i][p].id for i in order) for p in range(width)]

    order = self._agree(
      key,
      me,
      itertools.permutations(sorted(rows)),
      columns,
      f"every order of the live islands {sorted(rows)} has been used by an"
      " earlier membership of this model-parallel job",
      " Restart the job.",
    )
    matrix = [rows[i] for i in order]
    self._known[key] = matrix
    return matrix

  def _agree(self, key, me, choices, cliques_of, exhausted, fix) -> tuple:
    """The choice every process uses under ``key``: process 0 takes the
    first of ``choices`` (tuples of ints) whose gloo cliques
    (``cliques_of(choice)``: device id tuples) the job never used and
    publishes it; the others read it. Its cliques are used from now on."""
    if me == 0:
      for choice in choices:
        if not self._used.intersection(cliques_of(choice)):
          break
      else:
        raise RuntimeError(
          f"shardopt.elastic: {exhausted}, so no fresh gloo clique is left"
          " for this one (CPU collectives key their communicators by the"
          f" ordered device list).{fix}"
        )
      self._store.set(key, ",".join(map(str, choice)))
    else:
      value = self._store.get(key, self._timeout_s)
      choice = tuple(int(i) for i in value.split(","))
    self._used.update(cliques_of(choice))
    return choice
