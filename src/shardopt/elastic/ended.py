"""The job's end, told to a process that arrives after it.

Process 0 hosts JAX's coordination service. When it exits (after the job's
last round, :meth:`Island.finish`), every process still connected to the
service is aborted from C++ ("the JAX distributed service detected fatal
errors", a stack trace, SIGABRT). A process restarted near the end of the
job, which connected but joins no round because none will come, would wait
in its first round until then.

So process 0 marks the job as ended in the key-value store (:func:`mark`)
before it waits for the others and leaves; a process that finds the mark
says so on stderr and exits with :data:`EXIT_CODE` before process 0 does:
right after it connects (``shardopt.elastic.initialize``), or from a daemon
thread (:class:`Watch`) while it waits for its first round or inside a
round. Process 0 waits ``LEAVE_LAST_S`` after the others (``island.py``),
more than :data:`POLL_S`, so that the watch sees the mark first.
"""

from __future__ import annotations

import os
import sys
import threading
import time

KEY = "shardopt/ended/"
# The exit code of a process that found the job ended (started too late).
EXIT_CODE = 74
POLL_S = 0.2


def mark(store) -> None:
  """Process 0: the job has ended, no round will follow."""
  store.set(f"{KEY}0", "1", overwrite=True)


def has(store) -> bool:
  """Whether process 0 marked the job as ended."""
  try:
    return bool(store.keys(KEY))
  except Exception:  # noqa: BLE001 (the service is gone: JAX ends us)
    return False


def leave(me: int) -> None:
  """Says why on stderr and exits with :data:`EXIT_CODE` (``os._exit``:
  an interpreter exit would wait in ``jax.distributed.shutdown``)."""
  print(
    f"shardopt.elastic: process {me}: the job has ended (process 0 finished"
    " its last round and is leaving), so no round will take this process:"
    " it was started after the job's end, or is not part of its last"
    f" round. Exiting with code {EXIT_CODE}.",
    file=sys.stderr,
    flush=True,
  )
  sys.stdout.flush()
  os._exit(EXIT_CODE)


class Watch:
  """A daemon thread that, while armed, polls for :func:`mark` every
  :data:`POLL_S` seconds and :func:`leave` s once it is there."""

  def __init__(self, store, me: int):
    self._store, self._me = store, me
    self._armed = threading.Event()
    self._thread = None

  def arm(self) -> None:
    if self._me == 0:  # process 0 marks the end; it never waits for it
      return
    self._armed.set()
    if self._thread is None:
      self._thread = threading.Thread(target=self._poll, daemon=True)
      self._thread.start()

  def disarm(self) -> None:
    self._armed.clear()

  def _poll(self) -> None:
    while True:
      self._armed.wait()
      if has(self._store) and self._armed.is_set():
        leave(self._me)
      time.sleep(POLL_S)


_watches: dict[int, Watch] = {}


def watch(store, me: int) -> Watch:
  """This process's :class:`Watch` (one per process)."""
  if me not in _watches:
    _watches[me] = Watch(store, me)
  return _watches[me]
