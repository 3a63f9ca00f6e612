"""NoLoCo's parts for the periodic engine: a gossip exchange with one random
peer (instead of :mod:`.combine`'s all-reduce), what each replica sends, and
the outer step that pulls it toward its pair's average.

NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911, section 3; the authors'
``sparse_optimizer_c.py``): after ``H`` local steps replica ``i`` pairs with
one peer ``j`` and, with its slow weights ``phi_i`` (the engine's ``center``,
one per replica), fast weights ``theta_i`` and outer gradient
``Delta_i = phi_i - theta_i``::

  delta_i <- alpha * delta_i - beta * (Delta_i + Delta_j) / 2
                             - gamma * (phi_i - (phi_i + phi_j) / 2)
  phi_i   <- phi_i + delta_i,     theta_i <- phi_i

Both pair terms need only one array from the peer,
``c_j = beta * Delta_j - gamma * phi_j`` (:class:`Contribution`)::

  delta_i <- alpha * delta_i - (c_i + c_j) / 2 - gamma * phi_i

so a sync sends one params-sized array per replica over one
``collective-permute`` (:class:`Exchange`), and runs no all-reduce.

Pairs: the ``j``-th sync (``j = 1, 2, ...``, after step ``j * H``) pairs
the replicas by matching ``m = (j - 1) % num_matchings``; matching ``m`` is
the authors' draw, ``numpy.random.default_rng(seed + m).permutation(n)``,
whose entries ``perm[q]`` and ``perm[q + n // 2]`` form a pair (their
``batched`` with groups of 2). A ``lax.ppermute`` needs its pairs at trace
time, so the schedule (:func:`schedule`) holds one sync per matching, each
with period ``num_matchings * H`` and its own phase: the engine runs each in
its own ``lax.cond`` on the replicated counter, with its static pairs. Every
replica agrees on its peer without communicating, and a sync step runs one
``collective-permute``. (A ``lax.switch`` over the matchings inside one
sync would do the same, but would put every matching's permute in the one
branch that the HLO byte count reads.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _axes
from shardopt.finite import all_finite
from shardopt.periodic import contributions
from shardopt.periodic import schedules


def matching(size: int, seed: int, m: int) -> list[tuple[int, int]]:
  """Matching ``m`` of ``size`` replicas: ``[(a, b), ...]``, each replica in
  one pair."""
  perm = [int(x) for x in np.random.default_rng(seed + m).permutation(size)]
  half = size // 2
  return [(perm[q], perm[q + half]) for q in range(half)]


def schedule(period: int, num_matchings: int) -> tuple:
  """One sync per matching: matching ``m`` after steps ``t`` with ``t %
  (num_matchings * period) == ((m + 1) * period) % (num_matchings *
  period)``, so that the ``j``-th sync (after step ``j * period``) is
  matching ``(j - 1) % num_matchings``."""
  cycle = num_matchings * period
  return tuple(
    schedules.Sync(cycle, ((m + 1) * period) % cycle)
    for m in range(num_matchings)
  )


def check_size(size: int, transform: str, axis_name: Any) -> None:
  """Pairs need an even number of replicas."""
  if size % 2 or size < 2:
    raise ValueError(
      f"{transform}: axis {axis_name!r} has {size} replicas; NoLoCo pairs"
      " every replica with one peer at each sync, so the axis size must be"
      " even (and at least 2). Map the transform over an even number of"
      " replicas."
    )


@dataclasses.dataclass(frozen=True)
class Exchange:
  """One gossip round: each replica receives its peer's contribution.

  Called by the engine in place of :func:`.combine.combine` and returns the
  same five values: the peer's contribution (zeros where it is not
  finite), this replica's finiteness, ``in_group`` (2 if both of the pair
  are finite, else 0: the pair's outer step is skipped), ``in_axis`` (the
  axis size less the pair's non-finite contributions, so that the engine
  counts them in this replica's ``skipped``) and no error-feedback buffers.
  """

  axis_name: Any
  seed: int
  transform: str

  def __call__(self, mine: list, k: int, size: int):
    """The round of sync ``k`` (0-based, static: its matching)."""
    check_size(size, self.transform, self.axis_name)
    finite = all_finite(mine)
    pairs = matching(size, self.seed, k)
    both = pairs + [(b, a) for a, b in pairs]
    peer = [jax.lax.ppermute(x, self.axis_name, perm=both) for x in mine]
    peer_finite = all_finite(peer)
    both = finite & peer_finite
    peer = [jnp.where(both, p, jnp.zeros_like(p)) for p in peer]
    left_out = 2 - finite.astype(jnp.float32) - peer_finite.astype(jnp.float32)
    in_group = jnp.where(both, 2.0, 0.0)
    in_axis = jnp.float32(size) - left_out
    return peer, finite, in_group, in_axis, None


@dataclasses.dataclass(frozen=True)
class Contribution(contributions.PseudoGradients):
  """What a replica sends: ``c_i = beta * (phi_i - theta_i) - gamma *
  phi_i``, with ``theta_i`` its params after this step's local update."""

  beta: float
  gamma: float

  def of(self, accumulator, center, params, updates) -> list:
    deltas = super().of(accumulator, center, params, updates)
    return [
      self.beta * d - self.gamma * c.astype(d.dtype)
      for d, c in zip(deltas, center, strict=True)
    ]


@dataclasses.dataclass(frozen=True)
class Step:
  """NoLoCo's outer step on this replica's slow weights (the center):
  ``delta <- alpha * delta - (c_i + c_j) / 2 - gamma * phi``,
  ``phi <- phi + delta``; the state is ``delta`` (zeros at ``init``), one
  per replica."""

  alpha: float
  gamma: float

  def check(self, transform: str) -> None:
    del transform

  def init(self, params: Any, fragments, view) -> Any:
    del fragments, view
    return jax.tree.map(
      lambda p: _axes.cast_varying(
        jnp.zeros_like(p, _axes.accumulation_dtype(p.dtype)),
        _axes.varying_axes(p),
      ),
      params,
    )

  def step(self, combined, mine, center, global_state, any_finite, view):
    del view
    treedef = jax.tree.structure(global_state)
    momentum = jax.tree.leaves(global_state)
    new_center, new_momentum = [], []
    for peer, own, phi, d in zip(combined, mine, center, momentum, strict=True):
      wide = phi.astype(d.dtype)
      d_new = (
        self.alpha * d
        - (own.astype(d.dtype) + peer.astype(d.dtype)) / 2
        - self.gamma * wide
      )
      new_center.append(jnp.where(any_finite, wide + d_new, wide))
      new_momentum.append(jnp.where(any_finite, d_new, d))
    new_center = [
      x.astype(c.dtype) for x, c in zip(new_center, center, strict=True)
    ]
    return new_center, treedef.unflatten(new_momentum)
