"""One island's side of elastic training: its local steps, and the rounds it
runs with the live islands.

:class:`Island` wraps a periodic transform (``diloco``, ``local_sgd``,
``agn``). Its ``tx`` is the island-local part (:func:`.split.local_update`):
put it in the island's own jitted step; it never communicates outside the
island. :meth:`Island.sync` runs one round whenever a sync is due:

1. ``live_devices``: the live processes, each with its incarnation id (the
   round's *membership*); one barrier, at the block's end.
2. the layout: a *plain* round if every member took part in the last
   committed round, else a *healing* one (:mod:`.rows`);
3. the device list: one never used before for this membership and attempt
   (:mod:`.cliques`);
4. this island's rows: its contribution on the transform's wire (weight 0
   if it joins now; :mod:`.rows`);
5. one collective program over the live islands, blocked on inside the
   block: on a two-phase wire an ``all_to_all`` of the rows, each island's
   owned chunk summed, and an ``all_gather`` of the sums (an island sends
   about twice its payload, however many islands there are); on the top-k
   wire, and in a healing round, one ``all_gather`` of the rows;
6. on success everywhere, the commit: every island holds the same sums, in
   the same (island) order, divides by the contributing islands
   (:mod:`shardopt.wire.mean`), the outer optimizer moves the center, the
   sync's leaves land on it; a joining island takes the center, the outer
   state and the counters from the first up-to-date island's row. On
   ``ProcessFailureError`` or a collective error nothing is adopted and the
   same round is tried again over the new membership.
"""

from __future__ import annotations

import collections
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardopt import _args
from shardopt import _jax
from shardopt.elastic import cliques as _cliques
from shardopt.elastic import coordinator as _coordinator
from shardopt.elastic import ended as _ended
from shardopt.elastic import handshake
from shardopt.elastic import rows
from shardopt.elastic import shards
from shardopt.elastic import stall
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
      header carried it (a log matches it against what the island sent).
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
  ):
    self._engine = split.engine_of(tx, "shardopt.elastic.Island")
    self._init = tx.init
    self.tx = optax.GradientTransformationExtraArgs(self._init, self._update)
    self._dedicated = _check_dedicated(dedicated_coordinator)
    self._round_seconds = _check_round_seconds(
      round_seconds, work_per_step, self._engine
    )
    self._work_per_step = 1 if work_per_step is None else int(work_per_step)
    self._timeout_s = _seconds(timeout_s, "timeout_s", "e.g. 600")
    self._round_timeout_s = _check_round_timeout(round_timeout_s, timeout_s)
    self._stall_timeout_s = _check_stall_timeout(
      stall_timeout_s, round_timeout_s
    )
    self._max_attempts = _count(
      max_attempts, "max_attempts", "failed attempts of a round, e.g. 100"
    )
    self._on_event = _check_callable(on_event, "on_event", "(name, info)")
    self._on_event = self._on_event or (lambda name, info: None)
    self._deadline = None  # rounds on the clock: when the next is due
    self._count_at_commit = 0  # this island's local steps at its last round
    self._k = _check_processes_per_island(processes_per_island, self._dedicated)
    self._me = jax.process_index()
    self._all = jax.devices()
    self.trains = not (self._dedicated and self._me == 0)
    self.island = self._island_of(self._me)
    self.devices = [
      d for d in self._all if self._island_of(d.process_index) == self.island
    ]
    self._replicated = NamedSharding(
      Mesh(np.array(self.devices), ("island_devices",)), P()
    )
    self._store = _jax.KeyValueStore()
    self._cliques = _cliques.Cliques(self._store, timeout_s=self._timeout_s)
    self._fresh = True  # no round committed by this incarnation yet
    self._last: frozenset = frozenset()  # the last committed membership
    self._attempts: collections.Counter = collections.Counter()  # failed
    self._blocks: collections.Counter = collections.Counter()  # all
    self._compiled: dict = {}
    self._published = None  # the params' signature this process published
    self._arrivals: list = []  # stall keys written since the last commit
    self._heartbeat = None
    if self._dedicated and self.trains:
      self._heartbeat = _coordinator.Heartbeat(self._store, self._me)
    # Until its first round's block succeeds, and inside every round's
    # blocks: leave once process 0 marked the job as ended (.ended).
    self._end = _ended.watch(self._store, self._me)
    if self._fresh:
      self._end.arm()

  def _island_of(self, process: int) -> int:
    return int(rows.island_of(process, self._k, self._dedicated))

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
    return self._fresh

  def _update(self, grads, state, params=None, **extra_args):
    return split.local_update(self._engine, grads, state, params, extra_args)

  def due(self, state) -> bool:
    """Whether a sync is due after the state's last local step (on the
    clock: whether ``round_seconds`` have passed since the last round)."""
    if self._round_seconds is not None:
      return self._deadline is None or time.monotonic() >= self._deadline
    return split.due(self._engine, _host_int(state.count)) > 0

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
    number = isinstance(timeout_s, numbers.Real) and not isinstance(
      timeout_s, (bool, np.bool_)
    )
    if not number or not math.isfinite(timeout_s) or timeout_s < 0:
      raise ValueError(
        f"shardopt.elastic.Island.finish: timeout_s={timeout_s!r} must be a"
        " finite number of seconds >= 0 (e.g. 60)."
      )
    if not _args.is_integer(exit_code) or not 0 <= exit_code <= 255:
      raise ValueError(
        f"shardopt.elastic.Island.finish: exit_code={exit_code!r} must be an"
        " integer from 0 to 255 (a process's exit status)."
      )
    self._leave(_processes(self._last), timeout_s, exit_code, mark=True)

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
    take part).

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
    _check_callable(on_round, "on_round", "(params, state, round)", where)
    poll_s = _seconds(poll_s, "poll_s", "e.g. 0.05", where)
    self._publish(params)
    watcher = _coordinator.Watcher(self._store)
    tokens: dict = {}  # the islands of the last committed round: tokens
    joining: dict = {}  # the islands seen waiting to join: tokens
    idle_since = time.monotonic()  # no island up since
    with _coordinator.stop_on_sigterm() as stopped:
      while not stopped.is_set():
        alive = watcher.alive()
        up = [p for p, t in tokens.items() if t and alive.get(p) == t]
        joining = {}
        if up:
          ready = watcher.wanted(_host_int(state.sync_count) + 1)
        else:
          joining = watcher.joining(alive)
          ready = bool(joining)
          if not ready and self._last and self._finished():
            return params, state
          if not ready and time.monotonic() - idle_since > self._timeout_s:
            raise RoundFailedError(
              f"{where}: no island joined within timeout_s={self._timeout_s}"
              " s (at the job's start, or after every island died): the"
              " coordinator gives up. Start the islands (processes"
              f" 1..{jax.process_count() - 1}), or raise timeout_s."
            )
        if not ready:
          time.sleep(poll_s)
          continue
        done = self._rounds(0, params, state)
        if done is None:  # every island died in the round
          continue
        params, state, done = done
        if on_round is not None:
          on_round(params, state, done)
        tokens = watcher.tokens(p for p in done.live if p != 0)
        watcher.forget(_host_int(state.sync_count), joining, done.live)
        idle_since = time.monotonic()
    print(
      f"{where}: SIGTERM: the coordinator stops at round"
      f" {_host_int(state.sync_count)} and returns its last committed"
      " center and state.",
      file=sys.stderr,
      flush=True,
    )
    return params, state

  def _finished(self) -> bool:
    """Whether every island of the last committed round has finished."""
    others = {p for p, _ in self._last} - {0}
    done = {int(k.rsplit("/", 1)[-1]) for k in self._store.keys(_FINISHED)}
    return others <= done

  def _next_due(self, state) -> int:
    """The local step after which the islands' next sync is due."""
    step = _host_int(state.count) + 1
    while not split.due(self._engine, step):
      step += 1
    return step

  def _as_coordinator(self, members, sync: int, state):
    """The sync and state this process rounds with: its own for an island;
    for the coordinator, the sync due next if an island it committed with
    takes part (its count set to that step), else 0 (a handshake: the
    joining islands take its center and counters)."""
    if self.trains:
      return sync, state
    up = {p for p, _ in frozenset(members) & self._last} - {0}
    if self._fresh or not up:
      return 0, state
    if self._clocked:  # the only sync, whatever the islands' steps
      return 1, state
    step = self._next_due(state)
    count = jax.device_put(
      np.asarray(step, np.dtype(state.count.dtype)), state.count.sharding
    )
    return split.due(self._engine, step), state._replace(count=count)

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
    sync = self._sync_index(state, early)
    self._publish(params)
    if self._heartbeat is not None:  # tell the coordinator (it trains not)
      if self._fresh:
        self._heartbeat.join()
      else:
        self._heartbeat.want(_host_int(state.sync_count) + 1)
    watchdog = self._watchdog(_host_int(state.sync_count) + 1)
    self._end.arm()
    try:
      return self._rounds(sync, params, state)
    finally:
      self._end.disarm()
      if watchdog is not None:
        watchdog.cancel()

  def _forget(self, number: int) -> None:
    """Deletes the keys this process wrote for round ``number``, now
    committed (its stall arrivals, its ``want`` and ``join``
    announcements), so that the store stays the same size however many
    rounds run."""
    stall.forget(self._store, self._arrivals)
    if self._heartbeat is not None:
      self._heartbeat.forget(number)

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
    """Attempts of one round until one commits."""
    failures, since = [], time.monotonic()
    while True:
      members, start = None, time.monotonic()
      try:
        with _jax.live_devices(self._all) as live:
          members, live = self._taking_part(live)
          if members is not None:  # else this island is not complete yet
            sync_now, state_now = self._as_coordinator(members, sync, state)
            self._blocks[members] += 1  # every member counts alike
            with stall.watched(
              self._store,
              self._me,
              members,
              self._blocks[members],
              self._stall_timeout_s,
              _host_int(state.sync_count) + 1,
              self._arrivals,
            ):
              healing, exchanged, dropped = self._attempt(
                members, live, sync_now, params, state_now
              )
      except (_jax.process_failure_error(), jax.errors.JaxRuntimeError) as e:
        self._attempts[members] += 1
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
      params, state, done = self._commit(
        healing, sync_now, exchanged, params, state_now, dropped
      )
      done = done._replace(
        live=_processes(members),
        attempts=len(failures),
        seconds=time.monotonic() - start,
        failures=tuple(failures),
      )
      self._fresh, self._last = False, frozenset(members)
      self._forget(_host_int(state.sync_count))
      self._count_at_commit = _host_int(state.count)
      if self._round_seconds is not None:
        self._deadline = time.monotonic() + self._round_seconds
      self._on_event("round_committed", done._asdict())
      return params, state, done

  def _attempt(self, members, live, sync: int, params, state):
    """Steps 2-5: the layout, the device list, the rows, the exchange."""
    healing = self._fresh or not frozenset(members) <= self._last
    if healing:  # every member alike: one clear error, never gloo's abort
      error = handshake.disagreement(
        self._store,
        _processes(members),
        self._island_of,
        self._timeout_s,
        "shardopt.elastic.Island",
      )
      if error is not None:
        self._end_job(error, _processes(members))
    if shards.sharded(params):
      return self._attempt_sharded(members, live, sync, params, state, healing)
    order = self._cliques.devices(
      members, self._attempts[members], live, self._me
    )
    info = {"live": _processes(members), "healing": healing}
    if healing:
      row, dropped = self._healing_row(sync, params, state)
    else:
      row, dropped = self._plain_rows(order, sync, params, state)
    self._on_event("round_started", {**info, "sent": _sent(row)})
    if healing:
      exchanged = self._gather(order, row)
    else:
      exchanged = self._exchange(order, row, sync, params)
    exchanged = jax.block_until_ready(exchanged)
    self._on_event("round_gathered", info)
    return healing, (exchanged, order), dropped

  def _attempt_sharded(self, members, live, sync, params, state, healing):
    """:meth:`_attempt` for params sharded over the island's devices: rows
    built, exchanged and (in :meth:`_commit`) applied shard by shard, each
    device its own (:mod:`.shards`)."""
    self._check_shardable()
    matrix = self._cliques.matrix(
      members, self._attempts[members], live, self._me, self._island_of
    )
    order = [row[0] for row in matrix]  # one device per island
    info = {"live": _processes(members), "healing": healing}
    mine = self._mine(matrix)
    local_p = shards.local_trees(params, mine, "a params")
    local_s = shards.local_trees(state, mine, "a state")
    made = {
      d: (
        self._healing_row(sync, local_p[d], local_s[d], local=True)
        if healing
        else self._plain_rows(order, sync, local_p[d], local_s[d], local=True)
      )
      for d in mine
    }
    row = {d: m[0] for d, m in made.items()}
    dropped = {d: m[1] for d, m in made.items()}
    # Each device's row carries the digest of its own shards; the round's
    # log reads the headers gathered on the first of them (_commit).
    self._on_event("round_started", {**info, "sent": _sent(row[mine[0]])})
    if healing:
      key, body = ("gather",), self._gather_body()
    else:
      key = ("exchange", sync, len(order))
      body = self._exchange_body(order, sync, local_p[mine[0]])
    exchanged = shards.run(self._jit, key, matrix, body, row)
    jax.block_until_ready(list(exchanged.values()))  # a dict keyed by device
    self._on_event("round_gathered", info)
    return healing, (exchanged, order), dropped

  def _mine(self, matrix) -> list:
    """This process's devices of the round's matrix."""
    return [d for row in matrix for d in row if d.process_index == self._me]

  def _check_shardable(self) -> None:
    engine = self._engine
    if engine.num_fragments > 1 or engine.layer_axes is not None:
      raise ValueError(
        "shardopt.elastic.Island: params sharded over an island's devices"
        " run their rounds shard by shard, but Streaming DiLoCo's fragments"
        f" (num_fragments={engine.num_fragments}) and layer_axes are"
        " assigned from whole leaves; use num_fragments=1 and no layer_axes,"
        " or replicate the params over the island's devices."
      )

  def _taking_part(self, live):
    """The membership (process, incarnation) of the complete islands and
    their devices; ``(None, None)`` if this process's island is not complete
    and it is joining (IslandBrokenError if it was training)."""
    members = _cliques.membership(live, _jax.incarnations())
    count = collections.Counter(self._island_of(p) for p, _ in members)
    members = tuple(
      m for m in members if count[self._island_of(m[0])] == self._size(m[0])
    )
    if not self.trains and all(p == 0 for p, _ in members):
      return None, None  # the coordinator alone: no round without an island
    if all(p != self._me for p, _ in members):
      if not self._fresh:
        first = min(
          p for p in range(self._me + 1) if self._island_of(p) == self.island
        )
        raise IslandBrokenError(
          f"shardopt.elastic: island {self.island} (processes"
          f" {first}..{first + self._k - 1}) lost a process;"
          " an island of several processes cannot train without it. Exit"
          " this process and restart all of the island's processes (with"
          " the same process ids): the island heals in the round it joins."
        )
      return None, None
    processes = {p for p, _ in members}
    return members, [d for d in live if d.process_index in processes]

  def _size(self, process: int) -> int:
    """Processes in the island of ``process``."""
    return 1 if self._dedicated and process == 0 else self._k

  def _sync_index(self, state, early: bool) -> int:
    if self._fresh:
      return 0
    if self._round_seconds is not None:
      return 1  # rounds on the clock: the transform's only sync
    sync = split.due(self._engine, _host_int(state.count))
    if sync or not early:
      if not sync:
        raise ValueError(
          f"shardopt.elastic.Island.sync: no sync of {self._engine.name}"
          f" (axis {self._engine.axis_name!r}) is due after step"
          f" {_host_int(state.count)}; call it when island.due(state), or with"
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

  def _jit(self, key, fn, **kwargs):
    if key not in self._compiled:
      self._compiled[key] = jax.jit(fn, **kwargs)
    return self._compiled[key]

  def _healing_row(self, sync: int, params, state, local: bool = False):
    """This island's row of a healing round (on its devices; ``local``: of
    one device's shards, on it), and what the wire's encoding dropped from
    its contribution (error feedback)."""
    engine, me, island = self._engine, self._me, self.island
    up, trains, clocked = not self._fresh, self.trains, self._clocked
    fn = self._jit(
      ("healing_row", sync, up, local),
      lambda s, p, w: rows.healing_row(
        engine, island, me, sync, up, s, p, trains, w if clocked else None
      ),
      **({} if local else {"out_shardings": self._replicated}),
    )
    return fn(state, params, self._weight(state))

  def _plain_rows(
    self, order: list, sync: int, params, state, local: bool = False
  ):
    """This island's rows of a plain round for the processes of ``order``
    (on its devices; ``local``: of one device's shards, on it), and what
    the wire dropped from its contribution."""
    engine, me, island = self._engine, self._me, self.island
    owners, islands = self._owners(order)
    trains, clocked = self.trains, self._clocked
    fn = self._jit(
      ("plain_rows", sync, islands, len(order), local),
      lambda s, p, o, w: rows.plain_rows(
        engine,
        island,
        me,
        sync,
        s,
        p,
        o,
        islands,
        trains,
        w if clocked else None,
      ),
      **({} if local else {"out_shardings": self._replicated}),
    )
    return fn(state, params, jnp.asarray(owners), self._weight(state))

  @property
  def _clocked(self) -> bool:
    return self._round_seconds is not None

  def _weight(self, state) -> jax.Array:
    """This island's weight on rounds on the clock: its work since its last
    committed round (0 for the coordinator and a joining island)."""
    if not self._clocked or not self.trains or self._fresh:
      return jnp.float32(0)
    steps = _host_int(state.count) - self._count_at_commit
    # float32, as it travels (rows.weights): steps times work_per_step
    # (below 2**71) never overflows it.
    return jnp.float32(float(max(steps, 0) * self._work_per_step))

  def _owners(self, order: list) -> tuple[np.ndarray, int]:
    """Per process of ``order``, the chunk its island owns on a two-phase
    wire (:func:`.rows.islands_of`), and the number of islands."""
    owners = rows.islands_of(
      [d.process_index for d in order], self._k, self._dedicated
    )
    return owners, int(owners.max()) + 1

  def _program(self, key, order: list, body, row: jax.Array):
    """``body`` (of this process's ``row``) as one collective program over
    ``order``'s devices, one per process: its results on this process's
    device of ``order``."""
    mine = next(d for d in order if d.process_index == self._me)
    mesh = Mesh(np.array(order), ("islands",))
    local = next(s.data for s in row.addressable_shards if s.device == mine)
    local = local.reshape((1,) + local.shape) if local.ndim == 1 else local
    rows_in = jax.make_array_from_single_device_arrays(
      (len(order) * local.shape[0],) + local.shape[1:],
      NamedSharding(mesh, P("islands")),
      [local],
    )
    fn = self._jit(
      key + (tuple(d.id for d in order),),
      jax.shard_map(
        body, mesh=mesh, in_specs=P("islands"), out_specs=P(), check_vma=False
      ),
    )
    return jax.tree.map(lambda x: x.addressable_shards[0].data, fn(rows_in))

  def _gather(self, order: list, row: jax.Array) -> jax.Array:
    """One all_gather of the islands' rows over ``order``: every island's
    rows, on this island's device of ``order``."""
    return self._program(("gather",), order, self._gather_body(), row)

  @staticmethod
  def _gather_body():
    return lambda r: jax.lax.all_gather(r, "islands", tiled=True)

  def _exchange(self, order: list, row: jax.Array, sync: int, params):
    """A plain round's :func:`.rows.exchange` over ``order``."""
    _, islands = self._owners(order)
    return self._program(
      ("exchange", sync, islands),
      order,
      self._exchange_body(order, sync, params),
      row,
    )

  def _exchange_body(self, order: list, sync: int, params):
    engine = self._engine
    sizes = rows.sizes_of(engine, sync, params)
    _, islands = self._owners(order)
    return lambda r: rows.exchange(engine, sizes, r, "islands", islands)

  def _on_island(self, x: jax.Array) -> jax.Array:
    """A value on one device of this island, replicated on all of them."""
    return jax.make_array_from_single_device_arrays(
      x.shape,
      self._replicated,
      [jax.device_put(x, d) for d in self._replicated.addressable_devices],
    )

  def _commit(self, healing, sync, exchanged, params, state, dropped):
    """The round's results on this island (no collective); with sharded
    params (``exchanged`` per device) shard by shard."""
    exchanged, order = exchanged
    per_device = isinstance(exchanged, dict)
    any_x = next(iter(exchanged.values())) if per_device else exchanged
    if healing:
      head = _headers(np.asarray(any_x[:, : rows.HEADER_BYTES]))
    else:
      head = _columns(np.asarray(any_x.header))
    up = head["up_to_date"] > 0
    source = int(np.argmax(up)) if up.any() else 0
    if healing:
      sync = int(head["sync"][source]) if up.any() else 0
    contributing = up & (head["finite"] > 0)
    me = int(np.flatnonzero(head["process"] == self._me)[0])
    left_out = bool(up[me] and not contributing[me])
    first = rows.first_of_island(head["island"])
    trains = (head["process"] != 0) if self._dedicated else True
    skipped = int(np.sum(up & ~contributing & first & trains))
    left_out = left_out and self.trains
    flags = (jnp.asarray(left_out), jnp.int32(skipped))
    if healing:
      fresh = self._fresh
      fn = self._jit(
        ("heal", sync, fresh),
        lambda g, p, s, lo, sk, d: _heal(
          self._engine, sync, fresh, g, p, s, lo, sk, d
        ),
      )
      extra = ()
    else:
      owners, islands = self._owners(order)
      ranks = [self._island_of(d.process_index) for d in order]
      chunk = int(owners[ranks.index(self.island)])
      fn = self._jit(
        ("apply", sync, islands),
        lambda x, p, s, lo, sk, d, c: _apply_plain(
          self._engine, sync, islands, x, p, s, lo, sk, d, c
        ),
      )
      extra = (jnp.int32(chunk),)
    if per_device:  # each device its own shards, then whole arrays again
      local_p = shards.local_trees(params, list(exchanged), "a params")
      local_s = shards.local_trees(state, list(exchanged), "a state")
      out = {
        d: fn(x, local_p[d], local_s[d], *flags, dropped[d], *extra)
        for d, x in exchanged.items()
      }
      params = shards.global_tree({d: o[0] for d, o in out.items()}, params)
      state = shards.global_tree({d: o[1] for d, o in out.items()}, state)
    else:
      exchanged = jax.tree.map(self._on_island, exchanged)
      params, state = fn(exchanged, params, state, *flags, dropped, *extra)
    done = Round(
      number=_host_int(state.sync_count),
      step=_host_int(state.count),
      live=(),
      contributors=tuple(int(i) for i in head["process"][contributing]),
      weights=tuple(
        (int(p), int(w))
        for p, w in zip(
          head["process"][contributing],
          head["weight"][contributing],
          strict=True,
        )
      ),
      digests=tuple(
        (int(p), int(d))
        for p, d in zip(
          head["process"][contributing],
          head["digest"][contributing],
          strict=True,
        )
      ),
      joined=tuple(int(i) for i in head["process"][~up]) if up.any() else (),
      attempts=0,
      seconds=0.0,
      failures=(),
    )
    return params, state, done


def _sent(row: jax.Array) -> dict:
  """What this process's ``row`` (of a round, a healing round's or a plain
  round's) carries in its header: its contribution's digest and weight, and
  whether a committed round would count it."""
  head = np.asarray(row[..., : rows.HEADER_BYTES]).reshape(
    -1, rows.HEADER_BYTES
  )
  head = head[:1].copy().view(np.int32)
  field = lambda name: int(head[0, rows.FIELD[name]])  # noqa: E731
  return {
    "digest": field("digest"),
    "weight": float(rows.weights(head)[0]),
    "counted": bool(field("up_to_date") > 0 and field("finite") > 0),
  }


def _processes(members) -> tuple:
  return tuple(sorted(p for p, _ in members))


def _host_int(x) -> int:
  """A replicated scalar's value (also of an array over several processes'
  devices, where ``int(x)`` is refused)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return int(np.asarray(x))


# Every argument is checked when the Island is built, with one error type
# per kind of mistake (as shardopt._args): a flag that is not True/False or
# a callback that is not callable, TypeError; a number of seconds or a count
# that is not a number in its range (a string, a bool, a NaN, an infinity, a
# float where an integer is needed, a negative), or two arguments that
# contradict each other, ValueError. Each message names the argument, the
# value and the fix.
_WHERE = "shardopt.elastic.Island"
# work_per_step's bound: a weight (steps since the last round, below 2**31,
# times work_per_step) stays far inside float32's range (2**128) summed over
# any number of islands.
MAX_WORK_PER_STEP = 2**40


def _seconds(value, arg: str, fix: str, where: str = _WHERE) -> float:
  """``value`` as a finite number of seconds > 0; else a ``ValueError``
  naming ``arg`` (``fix``: an example of a good value)."""
  number = isinstance(value, numbers.Real) and not isinstance(
    value, (bool, np.bool_)
  )
  if not number or not math.isfinite(value) or value <= 0:
    raise ValueError(
      f"{where}: {arg}={value!r} must be a finite number of seconds > 0"
      f" ({fix})."
    )
  return float(value)


def _count(value, arg: str, fix: str, minimum: int = 1) -> int:
  """``value`` as an integer >= ``minimum``; else a ``ValueError``."""
  if not _args.is_integer(value) or int(value) < minimum:
    raise ValueError(
      f"{_WHERE}: {arg}={value!r} must be an integer >= {minimum} ({fix})."
    )
  return int(value)


def _check_callable(fn, arg: str, signature: str, where: str = _WHERE):
  if fn is not None and not callable(fn):
    raise TypeError(
      f"{where}: {arg}={fn!r} must be a function {arg}{signature}, or None."
    )
  return fn


def _check_round_timeout(seconds, timeout_s):
  if seconds is None:
    return None
  seconds = _seconds(seconds, "round_timeout_s", "None: no watchdog")
  if seconds <= timeout_s:
    raise ValueError(
      f"{_WHERE}: round_timeout_s={seconds!r} must be above"
      f" timeout_s={timeout_s!r}: a joining island waits up to timeout_s"
      " inside its sync, which the watchdog would end first. Raise"
      " round_timeout_s (to timeout_s plus a few collective timeouts) or"
      " lower timeout_s."
    )
  return seconds


def _check_stall_timeout(seconds, round_timeout_s=None):
  if seconds is None:
    return None
  seconds = _seconds(
    seconds,
    "stall_timeout_s",
    "above the normal skew between islands' arrivals, a joining island's"
    " first compile, e.g. 30; None: no stuck island is evicted",
  )
  if round_timeout_s is not None and seconds >= round_timeout_s:
    raise ValueError(
      f"{_WHERE}: stall_timeout_s={seconds!r} must be below"
      f" round_timeout_s={round_timeout_s!r}: the round watchdog would end"
      " the job before a stuck island evicts itself. Lower stall_timeout_s"
      " or raise round_timeout_s."
    )
  return seconds


def _check_processes_per_island(k, dedicated: bool = False) -> int:
  n = jax.process_count() - (1 if dedicated else 0)
  if not _args.is_integer(k) or k < 1 or n % k or n < 1:
    what = (
      f"the number of processes but the coordinator ({n})"
      if dedicated
      else f"the number of processes ({n})"
    )
    raise ValueError(
      f"{_WHERE}: processes_per_island={k!r} must be a"
      f" positive integer dividing {what}."
    )
  return int(k)


def _check_round_seconds(seconds, work_per_step, engine):
  if work_per_step is not None:
    _count(
      work_per_step,
      "work_per_step",
      "an inner step's weight on rounds on the clock: its tokens, say",
    )
    if work_per_step > MAX_WORK_PER_STEP:
      raise ValueError(
        f"{_WHERE}: work_per_step={work_per_step!r} must be <="
        f" 2**40 (MAX_WORK_PER_STEP): only the ratios of the weights"
        " count; divide every island's work_per_step by a common factor."
      )
    if seconds is None:
      raise ValueError(
        f"{_WHERE}: work_per_step={work_per_step!r} weighs rounds on the"
        " clock only, and round_seconds is None (rounds every sync_period"
        " steps weigh every island 1). Pass round_seconds, or drop"
        " work_per_step."
      )
  if seconds is None:
    return None
  seconds = _seconds(
    seconds, "round_seconds", "None: a round every sync_period steps"
  )
  if len(engine.syncs) != 1:
    raise ValueError(
      f"{_WHERE}: round_seconds runs the transform's only sync"
      f" on the clock, but {engine.name} has {len(engine.syncs)} syncs"
      " (num_fragments > 1: Streaming DiLoCo's fragments have no deadlines"
      " of their own); use num_fragments=1 with round_seconds."
    )
  return seconds


def _check_dedicated(flag) -> bool:
  flag = _args.flag(
    flag,
    "dedicated_coordinator",
    _WHERE,
    "True: process 0 trains nothing and keeps the center",
  )
  if flag and jax.process_count() < 2:
    raise ValueError(
      f"{_WHERE}: dedicated_coordinator=True needs at least 2"
      f" processes (the coordinator and an island); there are"
      f" {jax.process_count()}."
    )
  return flag


def _headers(head_bytes: np.ndarray) -> dict:
  """The gathered headers, sorted by (island, process): field -> column."""
  head = head_bytes.copy().view(np.int32).reshape(head_bytes.shape[0], -1)
  key = rows.sort_key(
    head[:, rows.FIELD["island"]], head[:, rows.FIELD["process"]]
  )
  return _columns(head[np.argsort(key, kind="stable")])


def _columns(head: np.ndarray) -> dict:
  """Sorted int32 headers: field -> column (the weight's as float32)."""
  columns = {name: head[:, i] for name, i in rows.FIELD.items()}
  columns["weight"] = rows.weights(head)
  return columns


def _apply_plain(
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
  """A plain round's commit: the mean over the contributing islands
  (:func:`.rows.combined_plain`), then :func:`.split.apply`; with error
  feedback the new error pieces are what the wire dropped in both phases
  (:func:`.rows.with_owned`)."""
  combined, count = rows.combined_plain(engine, exchanged, params, sync)
  error = None
  if engine.error_feedback:
    error = rows.with_owned(dropped, exchanged.dropped, chunk, islands)
  return _apply(
    engine, sync, state, params, combined, count, left_out, skipped, error
  )


def _apply(
  engine, sync, state, params, combined, count, left_out, skipped, error
):
  """:func:`.split.apply` of a round's combined pieces; ``error``: error
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


def _heal(
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
    params, state = _heal_sync(
      engine, sync, received, params, state, left_out, skipped, dropped
    )
  if fresh:  # the inner optimizer restarts where the island trains from
    state = state._replace(local_state=engine.optimizer.init(params))
  return params, state


def _heal_sync(
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
  return _apply(
    engine, sync, state, params, combined, count, left_out, skipped, dropped
  )
