"""Asynchronous rounds: the coordinator's rule, and an island's adoption of
the center it receives.

In an asynchronous round an island exchanges with the dedicated coordinator
alone: its contribution goes in, the newest center comes back, and it trains
on from it without waiting for any other island. The coordinator keeps the
contributions that arrived and are not yet applied, and moves the center
(:class:`Outer`):

1. ``add``: a contribution arrives, with the center *version* it was
   computed from and its weight (the island's inner steps since its last
   exchange);
2. ``due``: an outer step is due once ``min_quorum`` contributions are
   pending, or ``grace_seconds`` after the first pending one arrived;
3. ``step``: the pending contributions are combined in arrival order,
   ``sum_k w_k f(s_k) delta_k / (n w_bar)``, where ``n`` is their number,
   ``w_bar`` the mean weight of every contribution received so far (these
   included), ``s_k`` how many versions old the center it was computed
   from is and ``f`` the staleness rule (``"none"``: 1; ``"inverse"``:
   ``1 / (1 + s)``, Zhang et al., arXiv 1511.05950); the transform's own
   outer optimizer moves the center (:func:`shardopt.periodic.split.apply`:
   the same step as a synchronous round's); the center's version goes up
   by one.

Dividing by ``n w_bar`` rather than by the step's own ``sum_k w_k`` weighs
contributions by work *across* outer steps, as a synchronous round on the
clock weighs islands by their steps: with one contribution per step (quorum
1) a fast island's contribution of many steps moves the center more than a
slow one's of few, in proportion. When every contribution has the same
weight (rounds every ``sync_period`` steps) the two are the same. Measured
at islands of 1x, 3x and 9x speed exchanging every 2 s (docs/elastic.md,
"Asynchronous rounds"): the center's held-out loss 0.0037-0.0038 against
0.0049-0.0050 with the step's own sum, and 0.0041 for synchronous rounds on
the clock.

With an outer step per contribution (``min_quorum=1``), DiLoCo's Nesterov
momentum would be pushed once per island and round; pass
``shardopt.delayed_nesterov(momentum_period=number of islands)`` as the outer
optimizer (docs/elastic.md, "Asynchronous rounds").

:func:`adopt` is the island's side: the received center becomes its params
(the sync's leaves) and its state's center.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt.periodic import split

STALENESS_RULES = ("none", "inverse")

_WHERE = "shardopt.elastic.Island"


class Contribution(NamedTuple):
  """One island's contribution, as the coordinator received it.

  Attributes:
    process: the island's first process id.
    version: the center version it was computed from.
    weight: the island's inner steps since its last exchange (> 0).
    values: one float32 array per piece of the params (the transform's
      contribution, e.g. ``center - params`` for ``diloco``).
    arrived: ``time.monotonic()`` when it arrived.
    offer: the offer's id (:func:`.mailbox.offer_id`; None when built by
      hand): what the logs of both sides match on.
  """

  process: int
  version: int
  weight: float
  values: list
  arrived: float
  offer: int | None = None


@dataclasses.dataclass(frozen=True)
class Applied:
  """One outer step: the version it made and what went into it."""

  version: int
  contributors: tuple[int, ...]
  weights: tuple[float, ...]
  staleness: tuple[int, ...]
  offers: tuple = ()  # each contribution's offer id, in arrival order


def staleness_factor(rule: str, staleness: int) -> float:
  """``f(s)`` of the staleness rule ``rule`` (:data:`STALENESS_RULES`)."""
  if rule == "inverse":
    return 1.0 / (1.0 + staleness)
  return 1.0


def check_rule(rule: Any) -> str:
  if rule not in STALENESS_RULES:
    raise ValueError(
      f"{_WHERE}: staleness={rule!r} is not a staleness rule; pass one of"
      f" {STALENESS_RULES} ('none' weighs a stale contribution like a fresh"
      " one; 'inverse' by 1 / (1 + versions behind))."
    )
  return rule


@jax.jit
def _combine(values: list, factors: jax.Array, total: jax.Array) -> list:
  """``sum_k factors[k] values[k] / total``, summed in arrival order."""
  out = []
  for p in range(len(values[0])):
    acc = jnp.zeros_like(values[0][p])
    for k in range(len(values)):
      acc = acc + factors[k] * values[k][p]
    out.append(acc / total)
  return out


class Outer:
  """The coordinator's center, its versions, and the pending contributions.

  Args:
    engine: the periodic transform's engine (:func:`.split.engine_of`).
    params: the coordinator's params (the center's leaves).
    state: the transform's state on the coordinator (its center and the
      outer optimizer's state).
    min_quorum: contributions that make an outer step due (>= 1).
    grace_seconds: or this long after the first pending one arrived (None:
      the quorum alone).
    staleness: the staleness rule, one of :data:`STALENESS_RULES`.
  """

  def __init__(
    self,
    engine,
    params,
    state,
    *,
    min_quorum: int = 1,
    grace_seconds: float | None = None,
    staleness: str = "none",
  ):
    self.engine = engine
    self.params = params
    self.state = state
    self.min_quorum = min_quorum
    self.grace_seconds = grace_seconds
    self.staleness = check_rule(staleness)
    self.version = 0
    self.pending: list[Contribution] = []
    self._received = 0  # contributions received so far, and their weight
    self._received_weight = 0.0
    self._apply = jax.jit(self._apply_fn)

  def add(self, contribution: Contribution) -> None:
    """Step 1: ``contribution`` is pending."""
    self.pending.append(contribution)

  def due(self, now: float | None = None) -> bool:
    """Step 2: whether an outer step is due at ``now`` (monotonic)."""
    if not self.pending:
      return False
    if len(self.pending) >= self.min_quorum:
      return True
    if self.grace_seconds is None:
      return False
    now = time.monotonic() if now is None else now
    return now - self.pending[0].arrived >= self.grace_seconds

  def step(self) -> Applied:
    """Step 3: one outer step over the pending contributions."""
    pending, self.pending = self.pending, []
    stale = [self.version - c.version for c in pending]
    weights = [float(c.weight) for c in pending]
    factors = jnp.asarray(
      [
        w * staleness_factor(self.staleness, s)
        for w, s in zip(weights, stale, strict=True)
      ],
      jnp.float32,
    )
    self._received += len(weights)
    self._received_weight += sum(weights)
    mean_weight = self._received_weight / self._received
    combined = _combine(
      [list(c.values) for c in pending],
      factors,
      jnp.asarray(len(weights) * mean_weight, jnp.float32),
    )
    self.params, self.state = self._apply(self.params, self.state, combined)
    self.version += 1
    return Applied(
      self.version,
      tuple(c.process for c in pending),
      tuple(weights),
      tuple(stale),
      tuple(c.offer for c in pending),
    )

  def warm(self) -> None:
    """Compiles the outer step of ``min_quorum`` contributions before the
    first one arrives, so that no island's exchange waits for it (it did:
    0.26-0.42 s, each island's second exchange, measured here). Changes
    nothing: the step runs on zeros and its result is dropped."""
    center = self.center()
    zeros = laid_out([np.zeros(c.shape, np.float32) for c in center], center)
    combined = _combine(
      [zeros] * self.min_quorum,
      jnp.ones([self.min_quorum], jnp.float32),
      jnp.asarray(float(self.min_quorum), jnp.float32),
    )
    jax.block_until_ready(self._apply(self.params, self.state, combined))

  def center(self) -> list:
    """The center's pieces (float32), what an exchange hands an island."""
    parts = split.pieces(self.engine, self.params, 1)
    return split.take(jax.tree.leaves(self.state.center), parts)

  def _apply_fn(self, params, state, combined):
    return split.apply(
      self.engine,
      1,
      state,
      params,
      combined,
      any_contribution=jnp.asarray(True),
      left_out=jnp.asarray(False),
      skipped=jnp.zeros([], jnp.int32),
    )


def laid_out(values: list, like: list) -> list:
  """``values`` laid out as the arrays of ``like`` are (their sharding and
  dtype): how the coordinator holds what it pulled, and so what its outer
  step is compiled for."""
  return [
    jax.device_put(v, x.sharding).astype(x.dtype)
    for v, x in zip(values, like, strict=True)
  ]


def contribution(engine, params, state) -> list:
  """An island's contribution to its exchange (float32 pieces)."""
  values = split.contribution(engine, 1, state, params)
  return [jnp.asarray(v, jnp.float32) for v in values]


def adopt(engine, params, state, center: list):
  """The island's params and state after an exchange: the sync's leaves of
  the params, and the state's center, become ``center``; the inner
  optimizer's state carries on (DiLoCo's rule across rounds)."""
  parts = split.pieces(engine, params, 1)
  leaves = jax.tree.leaves(params)
  pulled = [
    c.astype(p.dtype)
    for c, p in zip(center, split.take(leaves, parts), strict=True)
  ]
  treedef = jax.tree.structure(params)
  centers = jax.tree.leaves(state.center)
  new_center = [
    c.astype(x.dtype)
    for c, x in zip(center, split.take(centers, parts), strict=True)
  ]
  accumulator = jax.tree.leaves(state.accumulator)
  if accumulator:  # agn: the next contribution sums from zero
    zeros = [jnp.zeros_like(a) for a in split.take(accumulator, parts)]
    accumulator = split.put(accumulator, parts, zeros)
  state = state._replace(
    sync_count=state.sync_count + 1,
    center=treedef.unflatten(split.put(centers, parts, new_center)),
    accumulator=engine.contribution.state(treedef, accumulator),
  )
  return treedef.unflatten(split.put(leaves, parts, pulled)), state
