"""One island's side of elastic training: its local steps, and the rounds it
runs with the live islands.

:class:`Island` wraps a periodic transform (``diloco``, ``local_sgd``,
``agn``). Its ``tx`` is the island-local part (:func:`.split.local_update`):
put it in the island's own jitted step; it never communicates outside the
island. :meth:`Island.sync` runs one round whenever a sync is due:

1. ``live_devices``: the live processes, each with its incarnation id (the
   round's *membership*; :mod:`.quorum`); one barrier, at the block's end.
2. the layout: a *plain* round if every member took part in the last
   committed round, else a *healing* one (:mod:`.quorum`, :mod:`.heal`);
3. the device list: one never used before for this membership and attempt
   (:mod:`.quorum`, :mod:`.cliques`);
4. this island's rows: its contribution on the transform's wire, with its
   weight (0 if it joins now; :mod:`.exchange`, :mod:`.rows`);
5. one collective program over the live islands, blocked on inside the
   block: on a two-phase wire an ``all_to_all`` of the rows, each island's
   owned chunk summed, and an ``all_gather`` of the sums (an island sends
   about twice its payload, however many islands there are); on the top-k
   wire, and in a healing round, one ``all_gather`` of the rows
   (:mod:`.exchange`);
6. on success everywhere, the commit: every island holds the same sums, in
   the same (island) order, divides by the contributing islands' total
   weight (:mod:`shardopt.wire.mean`), the outer optimizer moves the
   center, the sync's leaves land on it (:mod:`.commit`); a joining island
   takes the center, the outer state and the counters from the first
   up-to-date island's row (:mod:`.heal`). On ``ProcessFailureError`` or a
   collective error nothing is adopted and the same round is tried again
   over the new membership.

:class:`Island` holds this process's parts (its :class:`.quorum.Quorum`,
:class:`.exchange.Exchange`, :class:`.heal.Heal`, :class:`.commit.Commit`)
and runs the steps in order (:meth:`Island._rounds`); it keeps the round's
watchdog, the job's end (:meth:`Island.finish`) and the dedicated
coordinator's loop (:meth:`Island.coordinate`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardopt import _jax
from shardopt.elastic import async_rounds
from shardopt.elastic import checks
from shardopt.elastic import commit
from shardopt.elastic import coordinator as _coordinator
from shardopt.elastic import ended as _ended
from shardopt.elastic import exchange
from shardopt.elastic import handshake
from shardopt.elastic import heal
from shardopt.elastic import quorum
from shardopt.elastic import rows
from shardopt.elastic import shards
from shardopt.periodic import split


class Round(NamedTuple):
  """What one committed round did.

  Attributes:
    number: rounds committed so far (the state's ``sync_count``); 0 for the
      handshake at the job's start, where no island had trained yet.
    step: the local steps taken (the state's ``count``).
    live: the processes that took part, sorted.
    contributors: the processes whose contribution the mean counted.
    joined: the processes that joined in this round (weight 0) and healed.
    attempts: failed attempts before this one committed.
    seconds: wall time of the committed attempt.
    failures: why each failed attempt failed.
    weights: ``((process, weight), ...)`` of the contributing processes:
      1 each, or on rounds on the clock the work each did since its last
      committed round (its inner steps times ``work_per_step``).
    digests: ``((process, digest), ...)`` of the contributing processes:
      each one's ``rows.digest`` of its contribution, as its row's
      header carried it (a log matches it against what the island sent);
      in asynchronous rounds each contribution's offer id
      (``mailbox.offer_id`` in ``shardopt/elastic``), in the order the outer step combined
      them (a process may appear twice).
    version: asynchronous rounds: the center version this island received
      (on the coordinator, the version the outer step made); None in
      synchronous rounds.
  """

  number: int
  step: int
  live: tuple
  contributors: tuple
  joined: tuple
  attempts: int
  seconds: float
  failures: tuple
  weights: tuple = ()
  digests: tuple = ()
  version: int | None = None


# The exit code of a process whose round watchdog fired (``round_timeout_s``).
WATCHDOG_EXIT_CODE = 75
# The exit code of every process of a round whose islands' params differ
# (tree structure, shapes, dtypes) or are not floating point (.handshake).
PARAMS_EXIT_CODE = 77
# How much later process 0's watchdog fires than the others'.
_COORDINATOR_GRACE_S = 5.0
# Island.finish: the key-value directory of the processes that are done, and
# how long process 0 waits after the last of them said so.
_FINISHED = "shardopt/finished/"
_LEAVE_LAST_S = 1.0  # above ended.POLL_S: a late process leaves first
# The exit code of a process that found the job ended (.ended).
ENDED_EXIT_CODE = _ended.EXIT_CODE


class RoundFailedError(RuntimeError):
  """A round failed ``max_attempts`` times in a row (or a joining island's
  other processes did not come up within ``timeout_s``)."""


class IslandBrokenError(RuntimeError):
  """A process of this island died: an island of several processes cannot
  train without it. Restart all of the island's processes."""


class Island:
  """This process's island: local steps with ``tx``, rounds with
  ``sync``.

  An island is one process, or ``processes_per_island`` consecutive ones
  (island ``i`` is processes ``i*k .. i*k+k-1``) that fail and restart
  together: its local step is one program over its ``devices``. If one of
  them dies, the island's others cannot go on (their next local collective
  fails, or their next round raises :class:`IslandBrokenError`); the island
  takes part again once all of its processes are back. Island 0 holds
  process 0, which hosts the coordination service: its death ends the job
  (with ``dedicated_coordinator=True`` island 0 is process 0 alone, which
  trains nothing).

  A joining island's inner optimizer *restarts* (``optimizer.init``) rather
  than copying a peer's: an island's moments describe its own data and its
  own trajectory since the last sync, which the center it adopts is not, and
  copying them would cost the healing round two more copies of the params.
  The same rule restarts an island whose contribution was not finite.

  Args:
    tx: ``shardopt.diloco``, ``shardopt.local_sgd`` or ``shardopt.agn``
      (fragments and every ``comm_dtype`` included: a float, quantized
      blocks or ``shardopt.topk``, with error feedback where the wire takes
      it; not hierarchical, overlap, warm-up or ``axis_index_groups``, which
      are refused here, when the ``Island`` is built). Its ``axis_name`` names the islands; the
      island-local step never binds it.
    processes_per_island: processes per island (dividing the number of
      processes).
    timeout_s: how long a process waits for process 0 to publish a round's
      device list (a joining island waits there for the survivors' next
      sync); on the dedicated coordinator, how long :meth:`coordinate`
      waits for an island while none is up.
    max_attempts: failed attempts of one round before
      :class:`RoundFailedError` (an integer >= 1).
    round_timeout_s: the watchdog's bound on one :meth:`sync` (all its
      attempts). A peer that hangs while its heartbeats go on is alive to
      the coordination service, so ``live_devices``' barrier would wait for
      it forever: past this bound the process prints why to stderr and
      exits with code 75 (``WATCHDOG_EXIT_CODE``; None: no watchdog).
      Process 0 waits 5 s more, so that the others exit with their own
      message before its exit (it hosts the coordination service) aborts
      them. It must be above ``timeout_s`` (keep it above ``timeout_s``
      plus a few collective timeouts).
    stall_timeout_s: evict a stuck island rather than end the job: a
      process still inside a round's attempt this many seconds after every
      other process of it reached its end prints why and exits with code 76;
      the others go on without it, and it heals when restarted
      (``docs/elastic.md``). Keep it above the normal skew of the islands'
      arrivals; it must be below ``round_timeout_s``. None (the default): no
      eviction; the round watchdog ends the job.
    dedicated_coordinator: process 0 trains nothing: it calls
      :meth:`coordinate` (not :meth:`sync`), takes part in every round with
      weight 0 and keeps the center, the outer state and the counters, so
      that any island may die, every one of them at once too (they resume
      from it); the islands are processes 1..N-1 (``processes_per_island``
      consecutive ones each). Pass the same value on every process (and to
      :func:`shardopt.elastic.initialize`).
    round_seconds: rounds on the clock: a round is due (:meth:`due`) this
      many seconds after this island's last committed round, however many
      inner steps it took (islands of unequal speed never wait for the
      slowest to reach a step count). Each island's contribution is
      weighted by the work it did since its last committed round (its
      inner steps times ``work_per_step``; 0: it contributes nothing), and
      the combine is the weighted mean (plain averaging when the weights are
      equal). The transform's ``sync_period`` is then unused; one fragment
      only. None (the default): rounds every ``sync_period`` steps, weight 1.
    work_per_step: the weight of one inner step on rounds on the clock (its
      tokens, say, if islands differ in batch size): an integer from 1 to
      ``2**40``, only with ``round_seconds`` (None: 1). A weight travels as
      a float32, the precision of the mean's arithmetic: exact up to
      ``2**24``, rounded to 24 significant bits above (a relative 6e-8),
      and far from overflow for any count of steps (the weight is below
      ``2**71``; float32 reaches ``2**128``).
    on_event: ``on_event(name, info)`` at ``"round_started"`` (inside the
      round's ``live_devices`` block, before its collective),
      ``"round_gathered"`` (after it), ``"round_failed"`` and
      ``"round_committed"``; for logs and fault injection.
      ``"round_started"``'s ``info["sent"]`` is what this process's row
      carries: ``{"digest": int, "weight": float, "counted": bool}``
      (``rows.digest`` of its contribution; ``counted``: up to date
      and finite, so that a committed round would combine it).
    asynchronous: islands that never wait (with
      ``dedicated_coordinator=True``, one process per island, one fragment,
      no ``comm_dtype``): :meth:`sync` exchanges with the coordinator alone
      (its contribution in, weighted by its inner steps times
      ``work_per_step``; the newest center out, with its version in
      ``Round.version``) and returns; the coordinator applies an outer step
      once ``min_quorum`` contributions are pending or ``grace_seconds``
      after the first of them (``shardopt/elastic/async_rounds.py``,
      docs/elastic.md "Asynchronous rounds"). Its only wait is the
      coordinator's handling of its own exchange.
    min_quorum: asynchronous rounds: pending contributions that make an
      outer step due (an integer >= 1; 1: every contribution).
    grace_seconds: asynchronous rounds: an outer step this long after the
      first pending contribution arrived, quorum or not (None: the quorum
      alone).
    staleness: asynchronous rounds: how a contribution computed from a
      center ``s`` versions old is weighed: ``"none"`` (1) or
      ``"inverse"`` (``1 / (1 + s)``). With ``min_quorum=1`` pass
      ``shardopt.delayed_nesterov(momentum_period=number of islands)`` as the
      transform's outer optimizer.

  Raises:
    TypeError: ``dedicated_coordinator`` is not True/False, or ``on_event``
      is not callable.
    ValueError: a number of seconds that is not a finite number > 0, a count
      that is not an integer in its range, or arguments that contradict each
      other (``round_timeout_s <= timeout_s``, ``stall_timeout_s >=
      round_timeout_s``, ``work_per_step`` without ``round_seconds``); the
      message names the argument, the value and the fix.

  After construction, ``island.tx`` is the island-local transform (put its
  ``update`` in the island's jitted step, ``init`` builds the state),
  ``island.devices`` the island's devices, sorted by id (build the island's
  mesh from them), ``island.island`` its index and ``island.trains`` False
  on a dedicated coordinator.
  """

  def __init__(
    self,
    tx: optax.GradientTransformation,
    *,
    processes_per_island: int = 1,
    timeout_s: float = 600.0,
    max_attempts: int = 100,
    round_timeout_s: float | None = 900.0,
    stall_timeout_s: float | None = None,
    dedicated_coordinator: bool = False,
    round_seconds: float | None = None,
    work_per_step: int | None = None,
    on_event: Callable[[str, dict], None] | None = None,
    asynchronous: bool = False,
    min_quorum: int = 1,
    grace_seconds: float | None = None,
    staleness: str = "none",
  ):
    self._engine = split.engine_of(tx, "shardopt.elastic.Island")
    self._init = tx.init
    self.tx = optax.GradientTransformationExtraArgs(self._init, self._update)
    self._dedicated = checks.dedicated(dedicated_coordinator)
    self._round_seconds = checks.round_seconds(
      round_seconds, work_per_step, self._engine
    )
    self._work_per_step = 1 if work_per_step is None else int(work_per_step)
    self._timeout_s = checks.seconds(timeout_s, "timeout_s", "e.g. 600")
    self._round_timeout_s = checks.round_timeout(round_timeout_s, timeout_s)
    stall_timeout_s = checks.stall_timeout(stall_timeout_s, round_timeout_s)
    self._max_attempts = checks.count(
      max_attempts, "max_attempts", "failed attempts of a round, e.g. 100"
    )
    on_event = checks.callable_or_none(on_event, "on_event", "(name, info)")
    self._on_event = on_event or (lambda name, info: None)
    self._deadline = None  # rounds on the clock: when the next is due
    self._count_at_commit = 0  # this island's local steps at its last round
    k = checks.processes_per_island(processes_per_island, self._dedicated)
    self._k = k
    (
      self._asynchronous,
      self._min_quorum,
      self._grace_seconds,
      self._staleness,
    ) = checks.asynchronous(
      asynchronous,
      dedicated=self._dedicated,
      k=k,
      engine=self._engine,
      min_quorum=min_quorum,
      grace_seconds=grace_seconds,
      staleness=staleness,
    )
    self._exchanger = None  # asynchronous rounds: this island's side
    self._me = jax.process_index()
    self.trains = not (self._dedicated and self._me == 0)
    self._store = _jax.KeyValueStore()
    self._quorum = quorum.Quorum(
      self._store,
      process=self._me,
      processes_per_island=k,
      dedicated=self._dedicated,
      trains=self.trains,
      timeout_s=self._timeout_s,
      stall_timeout_s=stall_timeout_s,
    )
    self.island = self._quorum.island
    self.devices = self._quorum.devices
    replicated = NamedSharding(
      Mesh(np.array(self.devices), ("island_devices",)), P()
    )
    self._compiled: dict = {}
    where = {"process": self._me, "island": self.island, "trains": self.trains}
    self._heal = heal.Heal(
      self._engine, self._jit, replicated=replicated, **where
    )
    self._exchange = exchange.Exchange(
      self._engine,
      self._jit,
      self._heal,
      processes_per_island=k,
      dedicated=self._dedicated,
      replicated=replicated,
      **where,
    )
    self._commit = commit.Commit(
      self._engine,
      self._jit,
      island=self.island,
      processes_per_island=k,
      dedicated=self._dedicated,
      replicated=replicated,
    )
    self._published = None  # the params' signature this process published
    # Until its first round's block succeeds, and inside every round's
    # blocks: leave once process 0 marked the job as ended (.ended).
    self._end = _ended.watch(self._store, self._me)
    self._end.arm()

  def init(self, params):
    """``island.tx.init(params)`` laid out for rounds: the state's leaves
    that follow the params (the center, the moments, the error buffers)
    sharded as the params are, the others (counters, scalars) replicated
    over the island's devices. Needed when the params are sharded over the
    island's devices (model-parallel islands); the same as
    ``jax.jit(island.tx.init)`` otherwise."""
    state = jax.jit(self.tx.init)(params)
    leaves = jax.tree.leaves(params)
    if not leaves or not isinstance(leaves[0].sharding, NamedSharding):
      return state
    replicated = NamedSharding(leaves[0].sharding.mesh, P())
    return optax.tree_map_params(
      self.tx,
      lambda s, p: jax.device_put(s, p.sharding),
      state,
      params,
      transform_non_params=lambda s: jax.device_put(s, replicated),
    )

  @property
  def fresh(self) -> bool:
    """True until this process commits its first round."""
    return self._quorum.fresh

  @property
  def _fresh(self) -> bool:
    return self._quorum.fresh

  @property
  def _clocked(self) -> bool:
    return self._round_seconds is not None

  def _update(self, grads, state, params=None, **extra_args):
    return split.local_update(self._engine, grads, state, params, extra_args)

  def due(self, state) -> bool:
    """Whether a sync is due after the state's last local step (on the
    clock: whether ``round_seconds`` have passed since the last round)."""
    if self._clocked:
      return self._deadline is None or time.monotonic() >= self._deadline
    return split.due(self._engine, quorum.host_int(state.count)) > 0

  def _weight(self, state):
    """This island's weight (:func:`.rows.island_weight`): None on rounds
    every ``sync_period`` steps; on rounds on the clock its work since its
    last committed round (0 for the coordinator and a joining island)."""
    return rows.island_weight(
      self._clocked,
      self.trains and not self._fresh,
      quorum.host_int(state.count) - self._count_at_commit,
      self._work_per_step,
    )

  def _jit(self, key, fn, **kwargs):
    """The island's cache of compiled programs (rows, exchange, commit)."""
    if key not in self._compiled:
      self._compiled[key] = jax.jit(fn, **kwargs)
    return self._compiled[key]

  # ------------------------------------------------------------------- end

  def finish(self, *, timeout_s: float = 60.0, exit_code: int = 0):
    """Ends this process so that no process of the job aborts: never
    returns.

    Process 0 hosts the coordination service; a process still connected
    when it leaves is aborted (SIGABRT) by its client. So every other
    process says in the key-value store that it is done and exits at once;
    process 0 first marks the job as ended (a process restarted too late
    then says so and exits with ``ENDED_EXIT_CODE``, 74, rather than being
    aborted: ``shardopt/elastic/ended.py``), waits for the others that took
    part in the last committed round (up to ``timeout_s``: a dead one never
    says so), then 1 s more, and exits last. Each process exits with ``exit_code`` through
    ``os._exit``: a normal interpreter exit would run
    ``jax.distributed.shutdown``'s barrier, which waits for every process of
    the job, dead ones included.

    Call it after the last round, on every process (the loop in
    ``docs/elastic.md``); flushes stdout and stderr first.

    What ``os._exit`` drops: everything the interpreter would do on its way
    out (``atexit`` handlers, ``finally`` blocks of other threads, buffers
    of files not closed) and every piece of asynchronous work in flight: an
    orbax ``AsyncCheckpointer`` save still writing is cut short, as is any
    array not yet transferred (``jax.block_until_ready`` it first). Wait for
    what must outlive the process before calling it:
    ``checkpointer.wait_until_finished()`` (orbax), ``f.close()``.

    Args:
      timeout_s: how long process 0 waits for the others to say they are
        done (a finite number of seconds >= 0).
      exit_code: the process's exit status (0..255).
    """
    checks.finish(timeout_s, exit_code)
    self._leave(
      quorum.processes(self._quorum.last), timeout_s, exit_code, mark=True
    )

  def _leave(self, processes, timeout_s: float, exit_code: int, mark=False):
    """:meth:`finish`'s protocol: process 0 leaves last, after the others
    of ``processes`` said they are done (up to ``timeout_s``); ``mark``:
    process 0 first marks the job's end (.ended; not when the job ends on
    an error every member found alike, which each reports itself)."""
    store = self._store
    self._end.disarm()  # this process leaves with its own exit code
    if self._me != 0:
      store.set(f"{_FINISHED}{self._me}", "1", overwrite=True)
    else:
      if mark:  # a process that arrives now leaves at once
        _ended.mark(store)
      others = set(processes) - {0}
      deadline = time.monotonic() + timeout_s
      while others and time.monotonic() < deadline:
        done = {int(k.rsplit("/", 1)[-1]) for k in store.keys(_FINISHED)}
        others -= done
        if others:
          time.sleep(0.1)
      time.sleep(_LEAVE_LAST_S)  # the others' os._exit has returned
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

  def _end_job(self, error: Exception, processes) -> None:
    """Ends this process with ``error``, which every process of the round
    found alike (a raise would end the interpreter, whose exit aborts the
    processes still connected once process 0 has gone): says it on stderr
    and leaves as :meth:`finish` does, with ``PARAMS_EXIT_CODE``."""
    print(
      f"shardopt.elastic: process {self._me}: {type(error).__name__}:"
      f" {error} Exiting with code {PARAMS_EXIT_CODE}.",
      file=sys.stderr,
      flush=True,
    )
    self._leave(processes, self._timeout_s, PARAMS_EXIT_CODE)

  # ------------------------------------------------------------ coordinator

  # ------------------------------------------------------------ coordinator

  def coordinate(
    self,
    params,
    state,
    *,
    on_round: Callable | None = None,
    poll_s: float = 0.05,
  ):
    """Process 0's loop under ``dedicated_coordinator=True``: it takes part
    in every round, contributing nothing, until every island of the last
    committed round has finished (:meth:`finish`); then returns ``(params,
    state)``: the last committed center (as params) and state. Call
    :meth:`finish` after it.

    It keeps the center, the outer state and the counters, so islands that
    return after every one of them died resume from the last committed
    round (``shardopt/elastic/coordinator.py`` says how it learns when to
    take part). Under ``asynchronous=True`` it answers each island's
    exchange instead, until an island has finished and every other one it
    served has finished or died (``async_rounds.serve`` in ``shardopt/elastic``).

    Args:
      params: the initial params (the center every island starts from).
      state: ``island.tx.init(params)``.
      on_round: ``on_round(params, state, round)`` after each committed
        round (a :class:`Round`; for logs).
      poll_s: how often it reads the key-value store while waiting.

    Returns ``(params, state)`` also on SIGTERM (JAX's preemption notifier
    would swallow it): at its next wait, after the round in flight; it says
    so on stderr. Call :meth:`finish` after it either way.

    Raises:
      RoundFailedError: no island was up (joined, or took part in the last
        committed round) for ``timeout_s`` (the Island's): at the job's
        start, or after every island died.
    """
    where = "shardopt.elastic.Island.coordinate"
    if self.trains:
      raise ValueError(
        "shardopt.elastic.Island.coordinate: only process 0 under"
        " dedicated_coordinator=True coordinates; islands call sync."
      )
    checks.callable_or_none(
      on_round, "on_round", "(params, state, round)", where
    )
    poll_s = checks.seconds(poll_s, "poll_s", "e.g. 0.05", where)
    if self._asynchronous:
      return self._serve(params, state, on_round)
    self._publish(params)
    turns = quorum.Turns(self._store)
    idle_since = time.monotonic()  # no island up since
    with _coordinator.stop_on_sigterm() as stopped:
      while not stopped.is_set():
        turn = turns.turn(quorum.host_int(state.sync_count))
        if turn == "idle":
          if self._quorum.last and self._finished():
            return params, state
          if time.monotonic() - idle_since > self._timeout_s:
            raise RoundFailedError(
              f"{where}: no island joined within timeout_s={self._timeout_s}"
              " s (at the job's start, or after every island died): the"
              " coordinator gives up. Start the islands (processes"
              f" 1..{jax.process_count() - 1}), or raise timeout_s."
            )
        if turn != "round":
          time.sleep(poll_s)
          continue
        done = self._rounds(0, params, state)
        if done is None:  # every island died in the round
          continue
        params, state, done = done
        if on_round is not None:
          on_round(params, state, done)
        turns.committed(done.live, quorum.host_int(state.sync_count))
        idle_since = time.monotonic()
    print(
      f"{where}: SIGTERM: the coordinator stops at round"
      f" {quorum.host_int(state.sync_count)} and returns its last committed"
      " center and state.",
      file=sys.stderr,
      flush=True,
    )
    return params, state

  def _finished(self) -> bool:
    """Whether every island of the last committed round has finished."""
    others = {p for p, _ in self._quorum.last} - {0}
    done = {int(k.rsplit("/", 1)[-1]) for k in self._store.keys(_FINISHED)}
    return others <= done

  # ------------------------------------------------------------------ rounds

  def sync(self, params, state, *, early: bool = False):
    """Runs one round over the live islands, tried again until it commits.

    Call it when :meth:`due` (and once before the first local step: a fresh
    process joins with weight 0 and takes the center, the outer state and
    the counters; at the job's start every island takes process 0's).

    Args:
      params: this island's params after its local steps.
      state: the transform's state (``tx.init(params)`` for a fresh island).
      early: run the transform's only sync though it is not due (a last
        round at the end of training); single-fragment transforms only.

    Returns:
      ``(params, state, round)``; ``round`` is a :class:`Round`.

    In a healing round (the job's start included) the islands' params are
    compared first (``elastic/handshake.py``): if their tree structure, a shape or
    a dtype differs, or a leaf is not floating point, every process of the
    round says so on stderr, naming the island and the leaf, and exits with
    ``PARAMS_EXIT_CODE`` (77) (process 0 last, as :meth:`finish`).
    """
    if not self.trains:
      raise ValueError(
        "shardopt.elastic.Island.sync: process 0 is the dedicated"
        " coordinator (dedicated_coordinator=True): it trains nothing; call"
        " island.coordinate(params, state) there instead."
      )
    if self._asynchronous:
      return self._exchange_async(params, state)
    sync = self._sync_index(state, early)
    self._publish(params)
    self._quorum.announce(quorum.host_int(state.sync_count))
    watchdog = self._watchdog(quorum.host_int(state.sync_count) + 1)
    self._end.arm()
    try:
      return self._rounds(sync, params, state)
    finally:
      self._end.disarm()
      if watchdog is not None:
        watchdog.cancel()

  # ------------------------------------------------------ asynchronous rounds

  def _exchange_async(self, params, state):
    """:meth:`sync` under ``asynchronous=True``: one exchange with the
    coordinator (:class:`.async_rounds.Exchanger`), under the watchdog."""
    if self._exchanger is None:
      self._exchanger = async_rounds.Exchanger(
        self._engine,
        self._store,
        self._me,
        self.devices[0],
        timeout_s=self._timeout_s,
        work_per_step=self._work_per_step,
      )
    fresh = self._quorum.fresh
    watchdog = self._watchdog(quorum.host_int(state.sync_count) + 1)
    self._end.arm()
    try:
      params, state, info = self._exchanger.exchange(params, state, fresh=fresh)
    except Exception as e:  # noqa: BLE001 (the coordinator is gone or stuck)
      raise RoundFailedError(
        f"shardopt.elastic.Island.sync: process {self._me}'s exchange with"
        f" the coordinator failed ({type(e).__name__}: {e}); the coordinator"
        " (process 0) is gone, or did not answer within"
        f" timeout_s={self._timeout_s} s."
      ) from e
    finally:
      self._end.disarm()
      if watchdog is not None:
        watchdog.cancel()
    me = ((self._me, ""),)
    self._quorum.committed(me, quorum.host_int(state.sync_count))
    if self._clocked:
      self._deadline = time.monotonic() + self._round_seconds
    # what the coordinator applies (0: nothing offered, or not pulled)
    weight = info["weight"] if info["offer"] is not None else 0.0
    dropped = info["weight"] > 0 and info["offer"] is None
    done = Round(
      number=quorum.host_int(state.sync_count),
      step=info["count"],
      live=(0, self._me),
      contributors=(self._me,) if weight > 0 else (),
      joined=(self._me,) if fresh else (),
      attempts=0,
      seconds=info["seconds"],
      failures=(
        (
          "ContributionDropped: the coordinator could not pull this"
          " island's contribution (it is not applied)",
        )
        if dropped
        else ()
      ),
      weights=((self._me, weight),) if weight > 0 else (),
      digests=((self._me, info["offer"]),) if weight > 0 else (),
      version=info["version"],
    )
    self._on_event("round_committed", done._asdict())
    return params, state, done

  def _serve(self, params, state, on_round):
    """:meth:`coordinate` under ``asynchronous=True``
    (``async_rounds.serve`` in ``shardopt/elastic``)."""
    where = "shardopt.elastic.Island.coordinate"

    def finished() -> set:
      return {int(k.rsplit("/", 1)[-1]) for k in self._store.keys(_FINISHED)}

    def on_step(applied, outer):
      if on_round is None:
        return
      done = Round(
        number=applied.version,
        step=0,
        live=(0, *sorted(set(applied.contributors))),
        contributors=applied.contributors,
        joined=(),
        attempts=0,
        seconds=0.0,
        failures=(),
        weights=tuple(zip(applied.contributors, applied.weights, strict=True)),
        digests=tuple(zip(applied.contributors, applied.offers, strict=True)),
        version=applied.version,
      )
      on_round(outer.params, outer.state, done)

    try:
      params, state, served = async_rounds.serve(
        self._engine,
        params,
        state,
        store=self._store,
        device=self.devices[0],
        min_quorum=self._min_quorum,
        grace_seconds=self._grace_seconds,
        staleness=self._staleness,
        timeout_s=self._timeout_s,
        finished=finished,
        on_step=on_step,
      )
    except TimeoutError as e:
      raise RoundFailedError(
        f"{where}: no island exchanged within timeout_s={self._timeout_s} s"
        " (at the job's start, or after every island died): the coordinator"
        " gives up. Start the islands (processes"
        f" 1..{jax.process_count() - 1}), or raise timeout_s."
      ) from e
    self._quorum.committed(tuple((p, "") for p in served), 0)
    return params, state

  def _publish(self, params) -> None:
    """This process's params' signature, for the others' check
    (``elastic/handshake.py``); written again only when it changed."""
    text = handshake.signature(params)
    if text != self._published:
      handshake.publish(self._store, self._me, text)
      self._published = text

  def _watchdog(self, number: int):
    """A timer that ends the process if this sync does not return in time
    (see ``round_timeout_s``)."""
    if self._round_timeout_s is None:
      return None
    # Process 0 hosts the coordination service: once it exits, the others
    # are aborted by it. It waits a little longer, so that they say why.
    bound = self._round_timeout_s + (
      _COORDINATOR_GRACE_S if self._me == 0 else 0
    )

    def expire():
      print(
        f"shardopt.elastic: process {self._me}: round {number} did not"
        f" commit within round_timeout_s={bound} s: a peer that hangs while"
        " its heartbeats go on (live_devices waits for it), or a lost"
        f" coordinator. Exiting with code {WATCHDOG_EXIT_CODE}.",
        file=sys.stderr,
        flush=True,
      )
      os._exit(WATCHDOG_EXIT_CODE)

    timer = threading.Timer(bound, expire)
    timer.daemon = True
    timer.start()
    return timer

  def _rounds(self, sync: int, params, state):
    """Attempts of one round until one commits: steps 1-5 inside the
    ``live_devices`` block (:meth:`_attempt`), step 6 after it
    (:meth:`_commit_round`); on a failure, the same round again."""
    failures, since = [], time.monotonic()
    number = quorum.host_int(state.sync_count) + 1
    while True:
      members, start = None, time.monotonic()
      try:
        with _jax.live_devices(self._quorum.all) as live:
          members, live = self._taking_part(live)  # 1. the membership
          if members is not None:  # else this island is not complete yet
            sync_now, state_now = sync, state
            if not self.trains:
              sync_now, state_now = self._quorum.as_coordinator(
                members, sync, state, self._engine, self._clocked
              )
            with self._quorum.watched(members, number):
              healing, exchanged, dropped = self._attempt(
                members, live, sync_now, params, state_now
              )
      except (_jax.process_failure_error(), jax.errors.JaxRuntimeError) as e:
        self._quorum.failed(members)
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        failures.append(why)
        self._on_event(
          "round_failed",
          {"why": why, "seconds": time.monotonic() - start},
        )
        if len(failures) >= self._max_attempts:
          raise RoundFailedError(
            f"shardopt.elastic: a round failed {len(failures)} times in a"
            f" row; the last: {why}"
          ) from e
        continue
      if members is None:
        if not self.trains:  # the coordinator alone: back to waiting
          return None
        if time.monotonic() - since > self._timeout_s:
          raise RoundFailedError(
            f"shardopt.elastic: island {self.island}'s other"
            f" processes did not come up within {self._timeout_s} s."
          )
        continue
      # The block succeeded on every member: this process commits the
      # round, even if process 0 marks the job's end meanwhile (.ended).
      self._end.disarm()
      params, state, counted = self._commit_round(  # 6. the commit
        healing, sync_now, exchanged, params, state_now, dropped
      )
      done = Round(
        number=quorum.host_int(state.sync_count),
        step=quorum.host_int(state.count),
        live=quorum.processes(members),
        contributors=counted.contributors,
        joined=counted.joined,
        attempts=len(failures),
        seconds=time.monotonic() - start,
        failures=tuple(failures),
        weights=counted.weights,
        digests=counted.digests,
      )
      self._quorum.committed(members, quorum.host_int(state.sync_count))
      self._count_at_commit = quorum.host_int(state.count)
      if self._clocked:
        self._deadline = time.monotonic() + self._round_seconds
      self._on_event("round_committed", done._asdict())
      return params, state, done

  def _taking_part(self, live):
    """Step 1: the membership and its devices (:meth:`.quorum.Quorum
    .taking_part`); ``(None, None)`` while this island is joining and not
    complete; :class:`IslandBrokenError` if it was training."""
    members, live = self._quorum.taking_part(live)
    if members is None and self.trains and not self._fresh:
      first = self._quorum.first_process()
      raise IslandBrokenError(
        f"shardopt.elastic: island {self.island} (processes"
        f" {first}..{first + self._k - 1}) lost a process;"
        " an island of several processes cannot train without it. Exit"
        " this process and restart all of the island's processes (with"
        " the same process ids): the island heals in the round it joins."
      )
    return members, live

  def _attempt(self, members, live, sync: int, params, state):
    """Steps 2-5: the layout, the device list, the rows, the exchange."""
    healing = self._quorum.healing(members)  # 2. the layout
    if healing:  # every member alike: one clear error, never gloo's abort
      self._agree_on_params(members)
    sharded = shards.sharded(params)
    if sharded:
      self._exchange.check_shardable()
    devices = self._quorum.devices_for(members, live, sharded)  # 3.
    up, weight = not self._fresh, self._weight(state)
    row, dropped = self._exchange.rows(  # 4. this island's rows
      healing, devices, sync, params, state, up, weight
    )
    info = {"live": quorum.processes(members), "healing": healing}
    sent = self._exchange.sent(row, devices)
    self._on_event("round_started", {**info, "sent": sent})
    exchanged = self._exchange.run(healing, devices, sync, params, row)  # 5.
    self._on_event("round_gathered", info)
    return healing, (exchanged, devices.order), dropped

  def _agree_on_params(self, members) -> None:
    """A healing round's params handshake (``elastic/handshake.py``): on a
    disagreement every member ends the job alike, with
    ``PARAMS_EXIT_CODE``."""
    error = handshake.disagreement(
      self._store,
      quorum.processes(members),
      self._quorum.island_of,
      self._timeout_s,
      "shardopt.elastic.Island",
    )
    if error is not None:
      self._end_job(error, quorum.processes(members))

  def _commit_round(self, healing, sync, exchanged, params, state, dropped):
    """Step 6: the round's results on this island (no collective): the
    headers read (:func:`.commit.read`), then a healing round's adoption
    (:mod:`.heal`) or a plain round's commit (:mod:`.commit`)."""
    exchanged, order = exchanged
    counted = commit.read(
      healing,
      sync,
      exchanged,
      self._me,
      dedicated=self._dedicated,
      trains=self.trains,
    )
    if healing:
      fn, extra = self._heal.adopt(counted.sync, self._fresh), ()
    else:
      fn, extra = self._commit.plain(sync, order)
    params, state = self._commit.run(
      fn, exchanged, params, state, counted, dropped, extra
    )
    return params, state, counted

  def _sync_index(self, state, early: bool) -> int:
    if self._fresh:
      return 0
    if self._round_seconds is not None:
      return 1  # rounds on the clock: the transform's only sync
    sync = split.due(self._engine, quorum.host_int(state.count))
    if sync or not early:
      if not sync:
        raise ValueError(
          f"shardopt.elastic.Island.sync: no sync of {self._engine.name}"
          f" (axis {self._engine.axis_name!r}) is due after step"
          f" {quorum.host_int(state.count)}; call it when island.due(state), or with"
          " early=True for a last round."
        )
      return sync
    if self._dedicated:
      raise ValueError(
        "shardopt.elastic.Island.sync: early=True cannot run with a"
        " dedicated coordinator, which trains nothing and so learns when a"
        " round is due from the schedule alone; end training on a due step"
        " (steps a multiple of the sync period)."
      )
    if len(self._engine.syncs) != 1:
      raise ValueError(
        "shardopt.elastic.Island.sync: early=True runs the transform's only"
        f" sync, but {self._engine.name} has {len(self._engine.syncs)}"
        " (num_fragments > 1); call sync when island.due(state)."
      )
    return 1
