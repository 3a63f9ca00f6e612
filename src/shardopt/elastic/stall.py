"""A stuck island evicts itself, so that the others go on without it.

An island that hangs while its heartbeats go on (a deadlock, a stuck
device) is alive to the coordination service, so the round's
``live_devices`` barrier would wait for it forever. With a stall timeout
``S`` (``Island(stall_timeout_s=S)``), every process of a round's attempt:

1. writes, at the end of the attempt's block body (committed or failed), its
   arrival in the key-value store: ``shardopt/arrived/<membership>/<attempt>/
   <process>`` (each process deletes its own once a round commits:
   :func:`forget`);
2. meanwhile watches, from a thread, the others' arrivals: once every other
   process of the membership has arrived and it has not, for ``S`` seconds,
   it prints why on stderr and exits with :data:`STALL_EXIT_CODE`.

The others then see it dead (about a heartbeat timeout later), their barrier
returns with ``ProcessFailureError``, and the round is tried again without
it; restarted, it heals like any returning island. Process 0 hosts the
coordination service: if it is the stuck one, its exit ends the job.
(Measured on this machine with JAX's runtime:
``../shared/probes/coordinator_probe.py``, scenario q2.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time

# The exit code of a process that evicted itself (``stall_timeout_s``).
STALL_EXIT_CODE = 76
_ARRIVED = "shardopt/arrived/"
_POLL_S = 0.25


def _digest(members) -> str:
  """A short name of a membership ((process, incarnation) pairs)."""
  text = ",".join(f"{p}:{i}" for p, i in sorted(members))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def forget(store, written: list) -> None:
  """Deletes this process's arrival keys ``written`` (:func:`watched`
  appends each it writes) once a round has committed: every member has then
  passed the block's closing barrier, so none watches them any more (a
  member stuck in an attempt holds every other member at that barrier).
  ``written`` is emptied."""
  for key in written:
    try:
      store.delete(key)
    except Exception:  # noqa: BLE001 (the coordinator is gone: nothing to
      pass  # bound any more)
  written.clear()


@contextlib.contextmanager
def watched(
  store,
  me: int,
  members,
  attempt: int,
  stall_timeout_s,
  number,
  written: list | None = None,
):
  """The body of one attempt's block: this process's arrival written at its
  end, and its self-eviction if the others all arrived ``stall_timeout_s``
  seconds before it (None: nothing is watched or written). ``attempt``
  counts this membership's blocks, committed or not, so that every member
  names the same attempt the same way (a membership holds each process's
  incarnation: a restarted one starts a new count for everyone). The key
  it writes is appended to ``written`` (for :func:`forget`)."""
  if stall_timeout_s is None:
    yield
    return
  prefix = f"{_ARRIVED}{_digest(members)}/{attempt}/"
  others = {p for p, _ in members} - {me}
  stop = threading.Event()

  def watch() -> None:
    since = None
    while not stop.wait(_POLL_S):
      try:
        arrived = {int(k.rsplit("/", 1)[-1]) for k in store.keys(prefix)}
      except Exception:  # noqa: BLE001 (the coordinator is gone: the round
        continue  # watchdog, round_timeout_s, ends this process then)
      if not others <= arrived:
        continue
      since = time.monotonic() if since is None else since
      if time.monotonic() - since > stall_timeout_s and not stop.is_set():
        coordinator = (
          " It hosts the coordination service: the job ends with it."
          if me == 0
          else ""
        )
        print(
          f"shardopt.elastic: process {me} is stuck in round {number}: every"
          f" other process of the round reached its end more than"
          f" stall_timeout_s={stall_timeout_s} s ago. It leaves so that the"
          f" others go on without it (exit code {STALL_EXIT_CODE}); restart"
          f" it and it heals.{coordinator}",
          file=sys.stderr,
          flush=True,
        )
        os._exit(STALL_EXIT_CODE)

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    try:
      store.set(prefix + str(me), "1")
      if written is not None:
        written.append(prefix + str(me))
    except Exception:  # noqa: BLE001 (the coordinator is gone: the round
      pass  # fails anyway, and its watchdog bounds what follows)
