"""A coordinator that trains nothing: process 0 keeps the center, so that any
island may die, every one of them at once too.

With ``Island(tx, dedicated_coordinator=True)`` process 0 hosts JAX's
coordination service and takes part in every round as a member that
contributes nothing (weight 0): it holds the center, the outer optimizer's
state and the counters, bit for bit what the islands hold, and is the
source of every healing round. The islands are processes 1..N-1.

The coordinator must enter a round's collective when the islands do, not
earlier (a collective waits for its peers only up to the collective
timeout), and it trains nothing, so it cannot know on its own when that is.
The islands tell it through the coordination service's key-value store,
which needs no collective and no barrier:

- ``shardopt/alive/<process>``: a counter every island bumps twice a second
  from a thread, under a token drawn per incarnation (a restarted process
  has a new one). An island whose counter stops for :data:`DEAD_AFTER_S` is
  dead to the coordinator.
- ``shardopt/want/<round>/<process>``: an up-to-date island is at round
  ``round`` (its rounds committed, plus one).
- ``shardopt/join/<process>/<token>``: a fresh island waits to join.

Each island deletes its own ``want`` and ``join`` keys once the round they
announced has committed; the coordinator deletes the ``want`` keys of
committed rounds (a dead island's too) and the ``join`` keys it saw, each
by its token: a restarted island's fresh ``join`` key (a new token) is
never among them.

The coordinator waits, outside any collective, for the next round's
``want`` key (so rounds every ``sync_period`` steps and rounds on the clock
alike) while some island it committed with is alive; else for a
``join`` key (the job's start, or islands returning after every one of
them died: they resume from the center it kept); and ends when every island
of the last committed round has finished (:meth:`Island.finish`).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
import time

ALIVE = "shardopt/alive/"
WANT = "shardopt/want/"
JOIN = "shardopt/join/"
# An island whose alive counter has not moved for this long is dead to the
# coordinator (JAX's own heartbeat timeout is 5 s by default).
DEAD_AFTER_S = 6.0
_BEAT_S = 0.5


def _values(store, directory: str) -> dict[str, str]:
  """``{last key component: value}`` of a key-value directory."""
  out = {}
  for key, value in store.items(directory):
    out[key.rsplit("/", 1)[-1]] = value
  return out


class Heartbeat:
  """An island's side: its alive counter (a daemon thread), and its
  ``want``/``join`` announcements."""

  def __init__(self, store, me: int):
    self._store, self._me = store, me
    self.token = secrets.token_hex(8)
    self._stop = threading.Event()
    thread = threading.Thread(target=self._beat, daemon=True)
    thread.start()

  def _beat(self) -> None:
    n = 0
    while not self._stop.is_set():
      n += 1
      try:
        self._store.set(
          f"{ALIVE}{self._me}", f"{self.token}:{n}", overwrite=True
        )
      except Exception:  # noqa: BLE001 (the coordinator is gone: the
        pass  # round watchdog ends this process)
      self._stop.wait(_BEAT_S)

  def want(self, number: int) -> None:
    """This up-to-date island is at round ``number``."""
    self._store.set(f"{WANT}{number}/{self._me}", self.token, overwrite=True)

  def join(self) -> None:
    """This fresh island waits to join."""
    self._store.set(f"{JOIN}{self._me}/{self.token}", "1", overwrite=True)

  def forget(self, number: int) -> None:
    """Deletes this island's announcements once round ``number`` (which it
    joined, or wanted) has committed."""
    for key in (f"{WANT}{number}/{self._me}", f"{JOIN}{self._me}/{self.token}"):
      try:
        self._store.delete(key)
      except Exception:  # noqa: BLE001 (the coordinator is gone: the
        pass  # round watchdog ends this process)


class Watcher:
  """The coordinator's side: who is alive (with which token), who wants
  which round, who waits to join."""

  def __init__(self, store):
    self._store = store
    self._seen: dict[int, tuple[str, float]] = {}  # process -> (value, when)

  def alive(self) -> dict[int, str]:
    """``{process: token}`` of the islands whose counter moved lately."""
    now = time.monotonic()
    out = {}
    for name, value in _values(self._store, ALIVE).items():
      process = int(name)
      last = self._seen.get(process)
      if last is None or last[0] != value:
        self._seen[process] = (value, now)
      if now - self._seen[process][1] <= DEAD_AFTER_S:
        out[process] = value.split(":", 1)[0]
    return out

  def tokens(self, processes) -> dict[int, str | None]:
    """The current token of each of ``processes`` (fresh or not: an island
    inside a round's barrier may not beat)."""
    values = _values(self._store, ALIVE)
    return {
      p: values[str(p)].split(":", 1)[0] if str(p) in values else None
      for p in processes
    }

  def wanted(self, number: int) -> bool:
    """Whether an island is at round ``number``."""
    return bool(self._store.keys(f"{WANT}{number}/"))

  def joining(self, alive: dict[int, str]) -> dict[int, str]:
    """``{process: token}`` of the live islands that wait to join (their
    token is current)."""
    out = {}
    for key in self._store.keys(JOIN):
      process, token = key[len(JOIN) :].split("/", 1)
      if process.isdigit() and alive.get(int(process)) == token:
        out[int(process)] = token
    return out

  def forget(self, rounds_up_to: int, joined: dict[int, str], live) -> None:
    """Deletes the ``want`` keys of rounds up to ``rounds_up_to`` and the
    ``join`` keys of ``joined`` (``{process: token}``, as :meth:`joining`
    saw them before the round) whose process is in ``live`` (the committed
    round served them): only those keys, by their token."""
    for key in self._store.keys(WANT):
      number = key[len(WANT) :].split("/", 1)[0]
      if number.isdigit() and int(number) <= rounds_up_to:
        self._store.delete(key)
    for process, token in joined.items():
      if process in live:
        self._store.delete(f"{JOIN}{process}/{token}")


@contextlib.contextmanager
def stop_on_sigterm():
  """``with stop_on_sigterm() as stopped:`` an event set when the process
  gets SIGTERM. JAX's preemption notifier (``jax.distributed``) installs a
  SIGTERM handler that only records the preemption, so a coordinator
  waiting for islands would never end; this one lets it return. Outside the
  main thread (where Python cannot install a handler) the event is never
  set. Afterwards SIGTERM gets its previous Python handler back, or the
  default one (which ends the process) if the previous was not Python's."""
  stopped = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield stopped
    return
  previous = signal.getsignal(signal.SIGTERM)
  signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
  try:
    yield stopped
  finally:
    signal.signal(
      signal.SIGTERM, previous if previous is not None else signal.SIG_DFL
    )
