"""A numpy reference of asynchronous rounds (issue 50): the coordinator's rule,
as an event simulation, for the later implementation's tests to match.

Islands train on their own and never wait. Island ``i`` runs ``sync_period``
inner steps (SGD on its own toy quadratic ``0.5 * |x - targets[i]|^2``),
which take ``sync_period / speeds[i]`` seconds, starting from the newest
center it received (version ``v``). Then it exchanges with the coordinator:
its contribution (pseudo-gradient ``center_v - x_after``, weight = inner
steps done) goes in, the newest center comes back (after the outer step its
own arrival triggered, if any), and it starts again from that.

The coordinator keeps the contributions that have arrived and not been
applied (``pending``) and applies ONE outer step over all of them when

- ``quorum`` contributions are pending (counted as contributions, not
  distinct islands: a fast island may fill the quorum alone), or
- ``grace`` seconds have passed since the first pending one arrived (if
  ``grace`` is not None).

Each outer step makes a new center version. A contribution computed from
version ``v`` and applied at the step that makes version ``V + 1`` (the
center is at ``V``) has staleness ``s = V - v``. The outer gradient is the
work-weighted sum ``g = sum_k w_k f(s_k) delta_k / (n w_bar)`` (``n``
pending contributions, ``w_bar`` the mean weight of every contribution
received so far, these included: work weighs across outer steps) and the outer
step is SGD with Nesterov momentum (DiLoCo's outer optimizer, optax's
``sgd(lr, momentum, nesterov=True)``: ``m <- beta m + g``,
``x <- x - lr (g + beta m)``), under one of the staleness rules:

- ``"none"``: ``f(s) = 1``.
- ``"inverse"``: ``f(s) = 1 / (1 + s)``, the staleness-dependent learning
  rate of Zhang et al., "Staleness-aware Async-SGD" (arXiv 1511.05950: the
  rate divided by the staleness), with ``1 + s`` so a fresh one keeps 1.
- ``"delayed_nesterov"``: ``f(s) = 1``, and the momentum is updated only at
  every ``dn_period``-th outer step (Liu et al., "Asynchronous Local-SGD
  Training for Language Modeling", arXiv 2401.09135, the "Delayed Nesterov"
  (DN) update). The outer gradients are summed into a buffer ``b``; at steps
  that are not the ``dn_period``-th, ``x <- x - lr (c beta m + g / N)``; at the
  ``dn_period``-th, ``m <- beta m + b / N``, ``x <- x - lr ((1 - c (N - 1))
  beta m + g / N)``, ``b <- 0`` (``N = dn_period``, ``c = dn_c``). With
  ``c = 0``, ``N`` steps of single contributions equal ONE synchronous
  Nesterov step on their mean (``tests/test_async_rounds_reference.py``
  checks it). CAVEAT: the search tool returned the paper's abstract, not its
  algorithm box, so this is the rule as the abstract states it (momentum
  updated with a delay, gradients applied as they come) in the form above;
  check the exact placement of ``c`` against the paper's DN algorithm before
  the implementation copies it.

:func:`simulate` returns one :class:`Version` per outer step: the version
number, the time, the contributors (island ids, in arrival order), their
weights, their staleness, and the center after the step.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

RULES = ("none", "inverse", "delayed_nesterov")


@dataclasses.dataclass
class Version:
  version: int  # the center version this outer step made (1, 2, ...)
  time: float
  contributors: list[int]
  weights: list[float]
  staleness: list[int]
  center: np.ndarray


def inner_steps(x, target, steps: int, lr: float):
  """``steps`` SGD steps on ``0.5 * |x - target|^2`` (closed form)."""
  return target + (1.0 - lr) ** steps * (x - target)


def staleness_factor(rule: str, s: int) -> float:
  if rule == "inverse":
    return 1.0 / (1.0 + s)
  return 1.0


def simulate(
  *,
  speeds,
  targets,
  x0,
  sync_period: int,
  inner_lr: float,
  outer_lr: float,
  outer_momentum: float,
  quorum: int = 1,
  grace: float | None = None,
  rule: str = "none",
  dn_period: int | None = None,
  dn_c: float = 0.0,
  until: float,
) -> list[Version]:
  """Runs the islands and the coordinator until ``until`` seconds; returns
  the outer steps (see the module docstring). ``speeds[i]``: inner steps per
  second of island ``i``; ``targets[i]``: its quadratic's minimum.
  ``dn_period`` defaults to the number of islands."""
  if rule not in RULES:
    raise ValueError(f"rule {rule!r}: one of {RULES}")
  targets = [np.asarray(t, np.float64) for t in targets]
  n = len(speeds)
  dn_n = dn_period or n
  center = np.asarray(x0, np.float64).copy()
  version = 0
  momentum = np.zeros_like(center)
  buffer = np.zeros_like(center)
  steps_done = 0  # outer steps, for the DN period
  pending: list[
    tuple[float, int, int, np.ndarray, float]
  ] = []  # (t, i, v, delta, w)
  out: list[Version] = []
  start = {
    i: (center.copy(), 0) for i in range(n)
  }  # island -> (center, version)
  # events: (time, order, island); order breaks ties by island id.
  events = [(sync_period / speeds[i], i, i) for i in range(n)]
  heapq.heapify(events)

  received = []  # every contribution's weight, for w_bar

  def outer_step(t: float) -> None:
    nonlocal center, version, momentum, buffer, steps_done
    received.extend(p[4] for p in pending)
    total_w = len(pending) * sum(received) / len(received)
    stale = [version - p[2] for p in pending]
    g = (
      sum(
        p[4] * staleness_factor(rule, s) * p[3]
        for p, s in zip(pending, stale, strict=True)
      )
      / total_w
    )
    beta = outer_momentum
    if rule == "delayed_nesterov":
      steps_done += 1
      buffer = buffer + g
      if steps_done % dn_n == 0:
        momentum = beta * momentum + buffer / dn_n
        center = center - outer_lr * (
          (1.0 - dn_c * (dn_n - 1)) * beta * momentum + g / dn_n
        )
        buffer = np.zeros_like(buffer)
      else:
        center = center - outer_lr * (dn_c * beta * momentum + g / dn_n)
    else:
      momentum = beta * momentum + g
      center = center - outer_lr * (g + beta * momentum)
    version += 1
    out.append(
      Version(
        version,
        t,
        [p[1] for p in pending],
        [p[4] for p in pending],
        stale,
        center.copy(),
      )
    )
    pending.clear()

  while events:
    t, _, i = events[0]
    grace_due = (
      pending[0][0] + grace if (pending and grace is not None) else None
    )
    if grace_due is not None and grace_due < t:
      if grace_due > until:
        break
      outer_step(grace_due)
      continue
    if t > until:
      break
    heapq.heappop(events)
    c, v = start[i]
    x = inner_steps(c, targets[i], sync_period, inner_lr)
    pending.append((t, i, v, c - x, float(sync_period)))
    if len(pending) >= quorum:
      outer_step(t)
    start[i] = (center.copy(), version)
    heapq.heappush(events, (t + sync_period / speeds[i], i, i))
  return out


def global_loss(x, targets) -> float:
  """The mean of the islands' quadratics at ``x``."""
  return float(
    np.mean(
      [0.5 * np.sum((np.asarray(x) - np.asarray(t)) ** 2) for t in targets]
    )
  )
