"""The performance benchmarks' harness: their sections, CLI and timing.

``python -m benchmarks.perf [--quick] [--only NAME]`` runs :data:`SECTIONS`
(each a module of this package with ``run(quick)`` and ``plot``) into
``benchmarks/results/latest.{json,md}`` (:func:`benchmarks._report.main`),
merged with the studies' sections already there. ``quantized``,
``accumulate_bytes`` and ``elastic`` run on their own (``python -m
benchmarks.perf.NAME``); ``quantized`` times with :func:`compare` too.

Timing: warm-up excluded, candidates interleaved, medians, ratios. On a
shared, noisy machine absolute times mean little; what survives is the
ratio of two candidates timed side by side. :func:`compare` therefore

* calls every candidate ``warmup`` times first (compilation and first-touch
  allocation happen there) and throws those timings away;
* then runs ``repeats`` rounds, each calling every candidate once in turn
  (A B C A B C ...; the order rotates every round so no candidate always runs
  right after the same neighbour), blocking on the result each time;
* reports each candidate's median time and its ratio to the baseline
  (``median(candidate) / median(baseline)``), plus the median of the per-round
  ratios as a second estimate that is robust to slow drift of machine load.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from benchmarks import _report

SECTIONS = (
  "overhead",
  "groups",
  "communication",
  "memory",
  "projection",
  "powersgd",
  "cost",
)
MIN_REPEATS = 7


def _time_once(fn: Callable[[], Any], inner: int) -> float:
  start = time.perf_counter()
  out = None
  for _ in range(inner):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / inner


def compare(
  candidates: Mapping[str, Callable[[], Any]],
  *,
  baseline: str,
  repeats: int = 9,
  warmup: int = 2,
  inner: int = 1,
) -> dict:
  """Times zero-argument callables interleaved and returns medians and ratios.

  Args:
    candidates: name -> callable returning JAX arrays (blocked on after each
      call). Insertion order is the order within a round.
    baseline: the name every ratio is taken against.
    repeats: timed rounds (at least 7).
    warmup: untimed calls of each candidate before the first round.
    inner: calls per timing sample (the sample is their mean).

  Returns:
    ``{"baseline", "repeats", "inner", "candidates": {name: {"median_s",
    "min_s", "max_s", "iqr_rel", "ratio", "paired_ratio", "times_s"}}}`` where
    ``ratio``
    is median(name) / median(baseline), ``paired_ratio`` the median over
    rounds of time(name) / time(baseline) in that round, and ``times_s`` the
    samples in round order.
  """
  if repeats < MIN_REPEATS:
    raise ValueError(f"compare: repeats={repeats}; use at least {MIN_REPEATS}.")
  if baseline not in candidates:
    raise ValueError(
      f"compare: baseline {baseline!r} is not one of {list(candidates)}."
    )
  names = list(candidates)
  for name in names:
    for _ in range(warmup):
      jax.block_until_ready(candidates[name]())
  samples = {name: [] for name in names}
  for round_index in range(repeats):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(_time_once(candidates[name], inner))
  base = samples[baseline]
  base_median = statistics.median(base)
  out = {}
  for name in names:
    times = samples[name]
    median = statistics.median(times)
    quartiles = statistics.quantiles(times, n=4)
    out[name] = {
      "median_s": median,
      "min_s": min(times),
      "max_s": max(times),
      "iqr_rel": (quartiles[2] - quartiles[0]) / median,
      "ratio": median / base_median,
      "paired_ratio": statistics.median(
        t / b for t, b in zip(times, base, strict=True)
      ),
      "times_s": times,
    }
  return {
    "baseline": baseline,
    "repeats": repeats,
    "inner": inner,
    "candidates": out,
  }


def ratio(result: dict, numerator: str, denominator: str) -> dict:
  """``{"ratio", "paired_ratio"}`` of two candidates of one :func:`compare`."""
  a = result["candidates"][numerator]
  b = result["candidates"][denominator]
  return {
    "ratio": a["median_s"] / b["median_s"],
    "paired_ratio": statistics.median(
      x / y for x, y in zip(a["times_s"], b["times_s"], strict=True)
    ),
  }


def run_section(name: str, quick: bool, results: dict, out: str) -> dict:
  """Runs section ``name`` of this package; projection reads section 3's
  bytes from ``results`` when it is there (else measures them itself)."""
  module = importlib.import_module(f"benchmarks.perf.{name}")
  if name == "projection":
    measured = results["sections"].get("communication", {}).get("data")
    return _report.run_module(module, quick, out, measured)
  return _report.run_module(module, quick, out)


def main(argv: Sequence[str] | None = None) -> int:
  return _report.main(
    argv,
    prog="benchmarks.perf",
    sections=SECTIONS,
    run_section=run_section,
    description="Run the performance benchmarks (step cost, overhead,"
    " memory, wire cost).",
  )
