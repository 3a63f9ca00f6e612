"""Every argument of :class:`.island.Island`, checked when it is built.

One error type per kind of mistake (as :mod:`shardopt._args`): a flag that
is not True/False or a callback that is not callable, ``TypeError``; a
number of seconds or a count that is not a number in its range (a string, a
bool, a NaN, an infinity, a float where an integer is needed, a negative),
or two arguments that contradict each other, ``ValueError``. Each message
names the argument, the value and the fix.
"""

from __future__ import annotations

import math
import numbers

import jax
import numpy as np

from shardopt import _args

WHERE = "shardopt.elastic.Island"
# work_per_step's bound: a weight (steps since the last round, below 2**31,
# times work_per_step) stays far inside float32's range (2**128) summed over
# any number of islands.
MAX_WORK_PER_STEP = 2**40


def _is_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(
    value, (bool, np.bool_)
  )


def seconds(value, arg: str, fix: str, where: str = WHERE) -> float:
  """``value`` as a finite number of seconds > 0; else a ``ValueError``
  naming ``arg`` (``fix``: an example of a good value)."""
  if not _is_number(value) or not math.isfinite(value) or value <= 0:
    raise ValueError(
      f"{where}: {arg}={value!r} must be a finite number of seconds > 0"
      f" ({fix})."
    )
  return float(value)


def count(value, arg: str, fix: str, minimum: int = 1) -> int:
  """``value`` as an integer >= ``minimum``; else a ``ValueError``."""
  if not _args.is_integer(value) or int(value) < minimum:
    raise ValueError(
      f"{WHERE}: {arg}={value!r} must be an integer >= {minimum} ({fix})."
    )
  return int(value)


def callable_or_none(fn, arg: str, signature: str, where: str = WHERE):
  """``fn`` if it is callable or None; else a ``TypeError``."""
  if fn is not None and not callable(fn):
    raise TypeError(
      f"{where}: {arg}={fn!r} must be a function {arg}{signature}, or None."
    )
  return fn


def round_timeout(seconds_, timeout_s):
  """``round_timeout_s``: None, or seconds above ``timeout_s``."""
  if seconds_ is None:
    return None
  seconds_ = seconds(seconds_, "round_timeout_s", "None: no watchdog")
  if seconds_ <= timeout_s:
    raise ValueError(
      f"{WHERE}: round_timeout_s={seconds_!r} must be above"
      f" timeout_s={timeout_s!r}: a joining island waits up to timeout_s"
      " inside its sync, which the watchdog would end first. Raise"
      " round_timeout_s (to timeout_s plus a few collective timeouts) or"
      " lower timeout_s."
    )
  return seconds_


def stall_timeout(seconds_, round_timeout_s=None):
  """``stall_timeout_s``: None, or seconds below ``round_timeout_s``."""
  if seconds_ is None:
    return None
  seconds_ = seconds(
    seconds_,
    "stall_timeout_s",
    "above the normal skew between islands' arrivals, a joining island's"
    " first compile, e.g. 30; None: no stuck island is evicted",
  )
  if round_timeout_s is not None and seconds_ >= round_timeout_s:
    raise ValueError(
      f"{WHERE}: stall_timeout_s={seconds_!r} must be below"
      f" round_timeout_s={round_timeout_s!r}: the round watchdog would end"
      " the job before a stuck island evicts itself. Lower stall_timeout_s"
      " or raise round_timeout_s."
    )
  return seconds_


def processes_per_island(k, dedicated: bool = False) -> int:
  """``processes_per_island``: a positive integer dividing the number of
  processes (less the dedicated coordinator)."""
  n = jax.process_count() - (1 if dedicated else 0)
  if not _args.is_integer(k) or k < 1 or n % k or n < 1:
    what = (
      f"the number of processes but the coordinator ({n})"
      if dedicated
      else f"the number of processes ({n})"
    )
    raise ValueError(
      f"{WHERE}: processes_per_island={k!r} must be a"
      f" positive integer dividing {what}."
    )
  return int(k)


def round_seconds(seconds_, work_per_step, engine):
  """``round_seconds`` (None, or seconds; one sync only) and
  ``work_per_step`` (None, or an integer from 1 to
  :data:`MAX_WORK_PER_STEP`, only with ``round_seconds``)."""
  if work_per_step is not None:
    count(
      work_per_step,
      "work_per_step",
      "an inner step's weight on rounds on the clock: its tokens, say",
    )
    if work_per_step > MAX_WORK_PER_STEP:
      raise ValueError(
        f"{WHERE}: work_per_step={work_per_step!r} must be <="
        f" 2**40 (MAX_WORK_PER_STEP): only the ratios of the weights"
        " count; divide every island's work_per_step by a common factor."
      )
    if seconds_ is None:
      raise ValueError(
        f"{WHERE}: work_per_step={work_per_step!r} weighs rounds on the"
        " clock only, and round_seconds is None (rounds every sync_period"
        " steps weigh every island 1). Pass round_seconds, or drop"
        " work_per_step."
      )
  if seconds_ is None:
    return None
  seconds_ = seconds(
    seconds_, "round_seconds", "None: a round every sync_period steps"
  )
  if len(engine.syncs) != 1:
    raise ValueError(
      f"{WHERE}: round_seconds runs the transform's only sync"
      f" on the clock, but {engine.name} has {len(engine.syncs)} syncs"
      " (num_fragments > 1: Streaming DiLoCo's fragments have no deadlines"
      " of their own); use num_fragments=1 with round_seconds."
    )
  return seconds_


def dedicated(flag) -> bool:
  """``dedicated_coordinator``: True/False, True with 2 processes or more."""
  flag = _args.flag(
    flag,
    "dedicated_coordinator",
    WHERE,
    "True: process 0 trains nothing and keeps the center",
  )
  if flag and jax.process_count() < 2:
    raise ValueError(
      f"{WHERE}: dedicated_coordinator=True needs at least 2"
      f" processes (the coordinator and an island); there are"
      f" {jax.process_count()}."
    )
  return flag


def finish(timeout_s, exit_code) -> None:
  """:meth:`.island.Island.finish`'s arguments: ``timeout_s`` a finite
  number of seconds >= 0, ``exit_code`` an exit status (0..255)."""
  where = f"{WHERE}.finish"
  if not _is_number(timeout_s) or not math.isfinite(timeout_s) or timeout_s < 0:
    raise ValueError(
      f"{where}: timeout_s={timeout_s!r} must be a"
      " finite number of seconds >= 0 (e.g. 60)."
    )
  if not _args.is_integer(exit_code) or not 0 <= exit_code <= 255:
    raise ValueError(
      f"{where}: exit_code={exit_code!r} must be an"
      " integer from 0 to 255 (a process's exit status)."
    )


def asynchronous(
  flag,
  *,
  dedicated: bool,
  k: int,
  engine,
  min_quorum,
  grace_seconds,
  staleness,
):
  """``asynchronous`` (True/False) and its options: ``(flag, min_quorum,
  grace_seconds, staleness)``. Asynchronous rounds need a dedicated
  coordinator, one process per island, one sync (no fragments) and the
  float32 wire; the options only with ``asynchronous=True``."""
  from shardopt.elastic import asynchronous as _asynchronous  # noqa: PLC0415

  flag = _args.flag(
    flag,
    "asynchronous",
    WHERE,
    "True: each island exchanges with the dedicated coordinator alone",
  )
  if not flag:
    given = {
      "min_quorum": min_quorum != 1,
      "grace_seconds": grace_seconds is not None,
      "staleness": staleness != "none",
    }
    for arg, set_ in given.items():
      if set_:
        raise ValueError(
          f"{WHERE}: {arg} is an option of asynchronous rounds, and"
          " asynchronous=False (synchronous rounds wait for every live"
          f" island). Pass asynchronous=True, or drop {arg}."
        )
    return False, 1, None, "none"
  refusals = {
    "dedicated_coordinator=False (the coordinator keeps the center and"
    " applies the outer steps): pass dedicated_coordinator=True": not dedicated,
    f"processes_per_island={k} (an island's exchange is one process's):"
    " use one process per island": k != 1,
    f"{engine.name} with num_fragments > 1 (one center per exchange):"
    " build it with num_fragments=1": len(engine.syncs) != 1,
    f"{engine.name} with comm_dtype={engine.wire.spec!r} (an exchange"
    " sends float32): build it without comm_dtype": engine.wire.spec
    is not None,
  }
  for what, present in refusals.items():
    if present:
      raise ValueError(f"{WHERE}: asynchronous=True cannot run with {what}.")
  min_quorum = count(
    min_quorum,
    "min_quorum",
    "contributions that make an outer step due, e.g. 1",
  )
  if grace_seconds is not None:
    grace_seconds = seconds(
      grace_seconds,
      "grace_seconds",
      "an outer step this long after the first pending contribution, or"
      " None: the quorum alone",
    )
  return True, min_quorum, grace_seconds, _asynchronous.check_rule(staleness)
