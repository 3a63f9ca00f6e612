"""The quorum: who takes part in a round, and on which devices.

A round's members are the processes of the complete islands that are live
(``live_devices``), each with its incarnation id (a *membership*); from it
and the rounds committed before, every member decides alike, with no
communication:

- whether it is a *plain* round (every member took part in the last
  committed round) or a *healing* one (:mod:`.heal`);
- the device list its collective runs on, one never used before for this
  membership and attempt (:mod:`.cliques`), with one row of devices per
  island when the params are sharded (:mod:`.shards`);
- which chunk each island owns on a two-phase wire (:func:`owners`).

It also keeps what the members write in the key-value store to find each
other: a stuck member's eviction (:mod:`.stall`), an island's ``want`` and
``join`` announcements to a dedicated coordinator, and the coordinator's
side of them (:class:`Turns`; :mod:`.coordinator` says how).
"""

from __future__ import annotations

import collections
import contextlib
from typing import NamedTuple

import jax
import numpy as np

from shardopt import _jax
from shardopt.elastic import cliques as _cliques
from shardopt.elastic import coordinator as _coordinator
from shardopt.elastic import rows
from shardopt.elastic import stall
from shardopt.periodic import split


class Devices(NamedTuple):
  """The devices one attempt of a round runs on, the same on every
  member."""

  order: list  # the collective's devices, one per process (with sharded
  # params, one per island: the matrix's first column), in clique order
  matrix: list | None = None  # sharded params: one row of devices per island
  mine: list | None = None  # sharded params: this process's matrix devices


def owners(order: list, k: int, dedicated: bool) -> tuple[np.ndarray, int]:
  """Per device of ``order``, the chunk its island owns on a two-phase
  wire (:func:`.rows.islands_of`), and the number of islands."""
  ranks = rows.islands_of([d.process_index for d in order], k, dedicated)
  return ranks, int(ranks.max()) + 1


def processes(members) -> tuple:
  """The processes of a membership, sorted."""
  return tuple(sorted(p for p, _ in members))


def host_int(x) -> int:
  """A replicated scalar's value (also of an array over several processes'
  devices, where ``int(x)`` is refused)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return int(np.asarray(x))


class Quorum:
  """This process's view of the rounds' memberships.

  Args:
    store: the coordination service's key-value store.
    process: this process's index.
    processes_per_island: consecutive processes per island.
    dedicated: process 0 is the dedicated coordinator (island 0 alone).
    trains: False on the dedicated coordinator.
    timeout_s: how long a process waits for process 0's device list.
    stall_timeout_s: a stuck member's eviction (None: none).
  """

  def __init__(
    self,
    store,
    *,
    process: int,
    processes_per_island: int,
    dedicated: bool,
    trains: bool,
    timeout_s: float,
    stall_timeout_s: float | None,
  ):
    self._store = store
    self.process, self.k, self.dedicated = (
      process,
      processes_per_island,
      dedicated,
    )
    self._stall_timeout_s = stall_timeout_s
    self.trains = trains
    self.all = jax.devices()
    self.island = self.island_of(process)
    self.devices = [
      d for d in self.all if self.island_of(d.process_index) == self.island
    ]
    self._cliques = _cliques.Cliques(store, timeout_s=timeout_s)
    self.fresh = True  # no round committed by this incarnation yet
    self.last: frozenset = frozenset()  # the last committed membership
    self._attempts: collections.Counter = collections.Counter()  # failed
    self._blocks: collections.Counter = collections.Counter()  # all
    self._arrivals: list = []  # stall keys written since the last commit
    self._heartbeat = None
    if dedicated and trains:
      self._heartbeat = _coordinator.Heartbeat(store, process)

  def island_of(self, process: int) -> int:
    """The island of ``process``."""
    return int(rows.island_of(process, self.k, self.dedicated))

  def size(self, process: int) -> int:
    """Processes in the island of ``process``."""
    return 1 if self.dedicated and process == 0 else self.k

  def first_process(self) -> int:
    """This island's first process."""
    return min(
      p for p in range(self.process + 1) if self.island_of(p) == self.island
    )

  def announce(self, sync_count: int) -> None:
    """Tells a dedicated coordinator that this island waits for a round:
    to join (a fresh island) or round ``sync_count + 1``."""
    if self._heartbeat is None:
      return
    if self.fresh:
      self._heartbeat.join()
    else:
      self._heartbeat.want(sync_count + 1)

  def taking_part(self, live):
    """Step 1: the membership (process, incarnation) of the complete
    islands and their devices; ``(None, None)`` if this process's island
    is not complete, or the coordinator is alone."""
    members = _cliques.membership(live, _jax.incarnations())
    count = collections.Counter(self.island_of(p) for p, _ in members)
    members = tuple(
      m for m in members if count[self.island_of(m[0])] == self.size(m[0])
    )
    if not self.trains and all(p == 0 for p, _ in members):
      return None, None  # the coordinator alone: no round without an island
    if all(p != self.process for p, _ in members):
      return None, None
    taking = {p for p, _ in members}
    return members, [d for d in live if d.process_index in taking]

  def healing(self, members) -> bool:
    """Step 2: a healing round unless every member took part in the last
    committed round."""
    return self.fresh or not frozenset(members) <= self.last

  def devices_for(self, members, live, sharded: bool) -> Devices:
    """Step 3: the attempt's devices, never used before for this
    membership and attempt (:mod:`.cliques`)."""
    attempt = self._attempts[members]
    if not sharded:
      order = self._cliques.devices(members, attempt, live, self.process)
      return Devices(order)
    matrix = self._cliques.matrix(
      members, attempt, live, self.process, self.island_of
    )
    mine = [d for row in matrix for d in row if d.process_index == self.process]
    return Devices([row[0] for row in matrix], matrix, mine)

  @contextlib.contextmanager
  def watched(self, members, number: int):
    """An attempt's block body: its arrival written at its end, and this
    process's eviction if it is stuck (:mod:`.stall`)."""
    self._blocks[members] += 1  # every member counts alike
    with stall.watched(
      self._store,
      self.process,
      members,
      self._blocks[members],
      self._stall_timeout_s,
      number,
      self._arrivals,
    ):
      yield

  def failed(self, members) -> None:
    """An attempt of ``members`` failed: the next one takes a new device
    list."""
    self._attempts[members] += 1

  def committed(self, members, number: int) -> None:
    """Round ``number`` committed over ``members``: the last membership;
    the keys this process wrote for the round are deleted (its stall
    arrivals, its ``want`` and ``join``), so that the store stays the same
    size however many rounds run."""
    self.fresh, self.last = False, frozenset(members)
    stall.forget(self._store, self._arrivals)
    if self._heartbeat is not None:
      self._heartbeat.forget(number)

  def as_coordinator(self, members, sync: int, state, engine, clocked: bool):
    """The sync and state the dedicated coordinator rounds with: the sync
    due next if an island it committed with takes part (its count set to
    that step), else 0 (a handshake: the joining islands take its center
    and counters)."""
    up = {p for p, _ in frozenset(members) & self.last} - {0}
    if self.fresh or not up:
      return 0, state
    if clocked:  # the only sync, whatever the islands' steps
      return 1, state
    step = host_int(state.count) + 1
    while not split.due(engine, step):
      step += 1
    count = jax.device_put(
      np.asarray(step, np.dtype(state.count.dtype)), state.count.sharding
    )
    return split.due(engine, step), state._replace(count=count)


class Turns:
  """The dedicated coordinator's side of the islands' announcements: when
  it takes part in a round (:mod:`.coordinator`)."""

  def __init__(self, store):
    self._watcher = _coordinator.Watcher(store)
    self._tokens: dict = {}  # the islands of the last committed round
    self._joining: dict = {}  # the islands seen waiting to join

  def turn(self, sync_count: int) -> str:
    """``"round"``: the islands wait for one (an up-to-date island wants
    round ``sync_count + 1``, or none is up and one waits to join);
    ``"wait"``: an island is up, none wants a round yet; ``"idle"``: no
    island is up or joining."""
    alive = self._watcher.alive()
    up = [p for p, t in self._tokens.items() if t and alive.get(p) == t]
    self._joining = {}
    if up:
      return "round" if self._watcher.wanted(sync_count + 1) else "wait"
    self._joining = self._watcher.joining(alive)
    return "round" if self._joining else "idle"

  def committed(self, live: tuple, sync_count: int) -> None:
    """A round committed over ``live`` (processes): their tokens, and the
    keys of its rounds and joins deleted."""
    self._tokens = self._watcher.tokens(p for p in live if p != 0)
    self._watcher.forget(sync_count, self._joining, live)
