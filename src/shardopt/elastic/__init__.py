"""Elastic islands: DiLoCo, local SGD and AGN that keep training when an
island dies, and take it back when it returns.

Each process is an island (its local devices train together every step);
islands meet only at the syncs of a periodic transform, in rounds over the
islands that are alive, on JAX's own fault-tolerance runtime
(``jax_enable_recoverability`` and
``jax.experimental.multihost_utils.live_devices``, experimental)::

  shardopt.elastic.initialize("10.0.0.1:1234", num_processes=N, process_id=i)
  tx = shardopt.diloco(optax.adamw(3e-4), "island", sync_period=H)
  island = shardopt.elastic.Island(tx)

  @jax.jit
  def inner_step(params, state, batch):       # never leaves the island
    grads = jax.grad(loss)(params, batch)
    updates, state = island.tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state, _ = island.sync(params, island.tx.init(params))  # join
  while int(state.count) < steps:
    params, state = inner_step(params, state, next_batch())
    if island.due(state):
      params, state, round = island.sync(params, state)
  island.finish()  # ends the process; process 0 leaves last

- **Inner steps never wait on another island.** ``island.tx`` is the
  transform's local step only; the sync runs as its own program, one
  ``live_devices`` block and one collective per round.
- **A failed round loses nothing.** A round commits only when its block
  succeeded on every live island; otherwise every survivor keeps its params
  and state (its local progress since the last sync included) and tries the
  same round again over the new membership.
- **Averages over the islands that take part**: the mean divides by the
  number of contributing islands (up to date and finite), and the center
  and the outer optimizer's state are bit-identical on every live island.
- **A returning island heals in the round it joins**: a restarted process
  (same ``process_id``) contributes with weight 0 and receives the center,
  the outer state and the counters in that round; its inner optimizer
  restarts (:class:`Island` says why).

What cannot be survived (process 0's death: it hosts the coordination
service; a peer that hangs but keeps heartbeating, without
``stall_timeout_s``) ends the job with an error, never a hang. With
``Island(tx, dedicated_coordinator=True)`` process 0 trains nothing and
keeps the center (``island.coordinate``), so any island may die, every one
of them at once too. ``docs/elastic.md`` has the details and the timings;
``examples/elastic_diloco.py`` runs it.
"""

from __future__ import annotations

import socket
import time

import jax

from shardopt import _jax
from shardopt.elastic import checks
from shardopt.elastic import ended as _ended
from shardopt.elastic import rows
from shardopt.elastic.island import Island
from shardopt.elastic.island import IslandBrokenError
from shardopt.elastic.island import Round
from shardopt.elastic.island import RoundFailedError

__all__ = [
  "Island",
  "IslandBrokenError",
  "Round",
  "RoundFailedError",
  "initialize",
]


def initialize(
  coordinator_address: str,
  num_processes: int,
  process_id: int,
  *,
  heartbeat_timeout_seconds: int = 5,
  collective_timeout_seconds: int = 10,
  initialization_timeout: int = 300,
  processes_per_island: int = 1,
  dedicated_coordinator: bool = False,
  connect_timeout_seconds: float = 60.0,
) -> None:
  """``jax.distributed.initialize`` for elastic islands.

  Turns on ``jax_enable_recoverability`` (survivors outlive a dead process;
  a restarted one may reconnect), gloo for CPU collectives, and a CPU
  collective timeout (XLA's default is 30 minutes: a survivor waiting on a
  peer that already gave up would wait that long); then deletes the stale
  rendezvous keys a previous incarnation of this process left for its own
  local collectives (else they fail with ``ALREADY_EXISTS``).

  Call it before any other JAX call (XLA reads its flags when the backend
  starts; setting ``XLA_FLAGS`` before importing jax is surest).

  Args:
    coordinator_address: ``host:port`` of process 0, which hosts the
      coordination service (and must outlive the job).
    num_processes: the number of processes (islands) at the start.
    process_id: this process's index; a restarted island reuses its own.
    heartbeat_timeout_seconds: how long the coordination service waits for
      a silent process before declaring it dead (detection latency).
    collective_timeout_seconds: ``--xla_cpu_collective_timeout_seconds``,
      added to ``XLA_FLAGS`` unless it is there.
    initialization_timeout: seconds to wait for every process at the start.
    processes_per_island: as :class:`Island`'s: the stale keys deleted are
      those of the cliques within this island's devices. (No process of the
      island runs a local collective before all of them have passed this
      call: each one's first ``Island.sync`` waits for the others.)
    dedicated_coordinator: as :class:`Island`'s (process 0 trains nothing;
      the islands are processes 1..N-1).
    connect_timeout_seconds: how long a process other than 0 waits for
      process 0's coordination service to accept a connection at
      ``coordinator_address`` before it gives up (a process started after
      the job ended, or whose coordinator is gone: nothing listens there).

  Raises:
    ConnectionError: nothing accepted a connection at
      ``coordinator_address`` within ``connect_timeout_seconds`` (without
      this check, JAX's client would wait ``initialization_timeout`` and
      then abort the process from C++).
  """
  connect_timeout_seconds = checks.seconds(
    connect_timeout_seconds,
    "connect_timeout_seconds",
    "e.g. 60",
    "shardopt.elastic.initialize",
  )
  if _jax.backends_initialized():
    raise RuntimeError(
      "shardopt.elastic.initialize: JAX's backends are already running, so"
      " the recoverability option and the XLA flags can no longer change."
      " Call initialize before any other JAX call."
    )
  _jax.add_xla_flag(
    "xla_cpu_collective_timeout_seconds", collective_timeout_seconds
  )
  _jax.enable_recoverability()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if process_id != 0:
    _wait_for_coordinator(
      coordinator_address, connect_timeout_seconds, process_id
    )
  jax.distributed.initialize(
    coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    initialization_timeout=initialization_timeout,
  )

  def island_of(process):
    return int(
      rows.island_of(process, processes_per_island, dedicated_coordinator)
    )

  store = _jax.KeyValueStore()
  if process_id != 0 and _ended.has(store):  # connected after the end
    _ended.leave(process_id)
  _ended.watch(store, process_id).arm()  # and if it ends before a round
  island = island_of(process_id)
  _jax.forget_cliques_within(
    store,
    [d.id for d in jax.devices() if island_of(d.process_index) == island],
  )


def _wait_for_coordinator(address: str, timeout_s: float, process_id: int):
  """Returns once something accepts a TCP connection at ``address``
  (``host:port``), trying every 0.2 s; raises ``ConnectionError`` after
  ``timeout_s`` seconds of refusals, saying why that usually happens.

  ``tests/test_elastic_launch.py`` checks the bound and the message with a
  process started where no coordinator runs.
  """
  host, _, port = address.rpartition(":")
  host = host.strip("[]")  # an IPv6 literal
  start = time.monotonic()
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return
    except OSError as e:
      why = e
    waited = time.monotonic() - start
    if waited >= timeout_s:
      raise ConnectionError(
        f"shardopt.elastic.initialize: process {process_id} found no"
        f" coordinator at {address}: nothing accepted a connection there"
        f" within connect_timeout_seconds={timeout_s:g} s ({why}). The job"
        " has ended (process 0, which hosts the coordination service, has"
        " exited), or its coordinator is gone or not started yet. Start"
        " this process while the job runs, or raise"
        " connect_timeout_seconds if process 0 starts later than the"
        " others."
      ) from why
    time.sleep(min(0.2, max(timeout_s - waited, 0.0)))
