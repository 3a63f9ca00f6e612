"""``noloco``: the periodic engine with a gossip outer step (no all-reduce).

The parts are :mod:`.gossip`'s; this module checks the arguments and hands
them to the engine (:mod:`.engine`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from shardopt import _args
from shardopt.periodic import checks
from shardopt.periodic import engine
from shardopt.periodic import gossip

NAME = "shardopt.noloco"


def _number(value: Any, arg: str, low: float, high: float, hint: str) -> float:
  """A real number in ``[low, high)`` (``high`` None: no upper bound)."""
  if (
    isinstance(value, (bool, np.bool_))
    or not isinstance(value, (int, float, np.number))
    or not low <= value
    or (high is not None and not value < high)
  ):
    bound = f"[{low:g}, {high:g})" if high is not None else f">= {low:g}"
    raise ValueError(
      f"{NAME}: {arg}={value!r} must be a number {bound}; {hint}."
    )
  return float(value)


def _refuse(comm_dtype, error_feedback, num_fragments, axis_index_groups):
  """The ``diloco`` options NoLoCo's algorithm has no place for."""
  why = {
    "comm_dtype": (
      comm_dtype,
      comm_dtype is not None,
      "what a replica sends holds its weights themselves (beta * Delta -"
      " gamma * phi), not a small difference a narrow or quantized wire"
      " could carry; leave comm_dtype=None (the params' own dtype)",
    ),
    "error_feedback": (
      error_feedback,
      error_feedback is not False,
      "there is no quantized wire to feed back; leave error_feedback=False",
    ),
    "num_fragments": (
      num_fragments,
      num_fragments != 1,
      "the paper's gossip step moves every leaf at each sync; leave"
      " num_fragments=1",
    ),
    "axis_index_groups": (
      axis_index_groups,
      axis_index_groups is not None,
      "each replica already pairs with one peer of the whole axis; map the"
      " transform over the replicas that gossip and leave"
      " axis_index_groups=None",
    ),
  }
  for arg, (value, bad, fix) in why.items():
    if bad:
      raise ValueError(f"{NAME}: {arg}={value!r} is not offered: {fix}.")


def noloco(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  sync_period: int = 50,
  outer_learning_rate: float = 0.7,
  outer_momentum: float = 0.5,
  pull: float | None = None,
  seed: int = 0,
  num_matchings: int = 16,
  warmup_steps: int = 0,
  comm_dtype=None,
  error_feedback: bool = False,
  num_fragments: int = 1,
  axis_index_groups=None,
) -> optax.GradientTransformationExtraArgs:
  """NoLoCo: local steps, then a gossip outer step with one random peer.

  Every replica takes ``sync_period`` (``H``) steps of ``inner`` on its own
  params; then, with no all-reduce, each replica ``i`` pairs with one peer
  ``j`` (a random perfect matching of the replicas, the same on every
  replica) and moves its own slow weights ``phi_i`` (``state.center``, one
  per replica) by the modified Nesterov step of the paper (section 3), with
  ``Delta = phi - theta`` the outer gradient of the fast weights
  ``theta``::

    delta_i <- alpha * delta_i - beta * (Delta_i + Delta_j) / 2
                               - gamma * (phi_i - (phi_i + phi_j) / 2)
    phi_i   <- phi_i + delta_i;   theta_i <- phi_i

  (``alpha = outer_momentum``, ``beta = outer_learning_rate``, ``gamma =
  pull``; the momentum ``delta`` is ``state.global_state``, per replica).
  The last term pulls each replica toward its pair's average: the
  replicas are never identical, but gossip keeps them close (the spread
  settles; ``docs/noloco.md`` measures it). The update is the authors'
  code's (``sparse_optimizer_c.py``, momentum added to ``phi``).

  Communication: one ``lax.ppermute`` per sync, a params-sized float array
  sent and one received by each replica (``c = beta * Delta - gamma *
  phi``, which carries both pair terms), and no all-reduce. The ``j``-th
  sync (after step ``j * H``) uses matching ``(j - 1) % num_matchings``;
  matching ``m`` pairs ``perm[q]`` with ``perm[q + n // 2]`` for ``perm =
  numpy.random.default_rng(seed + m).permutation(n)`` (the authors' draw).
  A ppermute's pairs are fixed at trace time, so the schedule holds one
  sync per matching, each in its own ``lax.cond`` on the replicated
  counter (period ``num_matchings * H``, phases ``H, 2H, ...``): a sync
  step runs one ``collective-permute``, and ``shardopt.due(tx, t)`` and
  ``sync=`` work as for :func:`local_sgd`.

  A pair with a non-finite contribution skips its outer step (both stay on
  their slow weights); ``state.skipped`` counts the contributions left
  out of this replica's pairs (one row per replica, like ``restart``).

  Not offered: a narrow or quantized wire (what travels holds the weights
  themselves), error feedback, fragments and ``axis_index_groups``.

  Args:
    inner: the inner optimizer (Adam in the paper).
    axis_name: the replica axis; its size must be even.
    sync_period: inner steps per outer step (``H``); the paper's default
      runs use 50.
    outer_learning_rate: ``beta``, 0.7 in the paper.
    outer_momentum: ``alpha`` in ``[0, 1)``, 0.5 in the paper.
    pull: ``gamma``, the weight of the pull toward the pair's average;
      None (the default) takes ``outer_learning_rate``, as the authors'
      code does. 0 turns the pull off (the pair then averages only its
      outer gradients).
    seed: the seed of the pairings.
    num_matchings: how many pairings the step cycles through; an integer
      >= 1.
    warmup_steps: steps of synchronous training first (see
      :func:`agn`).
    comm_dtype, error_feedback, num_fragments, axis_index_groups: accepted
      only at their defaults (None, False, 1, None), so that a ``diloco``
      call moved over is refused with a ``ValueError`` that says why.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`PeriodicState`. ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.noloco(optax.sgd(1.0), "batch", sync_period=1)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.pmap(step, axis_name="batch")
    >>> params = jnp.zeros(8)
    >>> state = jax.pmap(tx.init)(params)
    >>> params, state = step(params, state, -jnp.arange(8.0))
    >>> # pairs (2, 5), (4, 0), (3, 1), (6, 7): replica 0 moves by
    >>> # 0.7 * (0 + 4) / 2 = 1.4 (the slow weights agree: no pull yet)
    >>> np.round(np.asarray(params), 4)
    array([1.4 , 1.4 , 2.45, 1.4 , 1.4 , 2.45, 4.55, 4.55], dtype=float32)

  References:
    Kolehmainen et al., `NoLoCo: No-all-reduce Low Communication Training
    Method for Large Models <https://arxiv.org/abs/2506.10911>`_, 2025.
  """
  checks.check_axis_name(axis_name, NAME)
  _refuse(comm_dtype, error_feedback, num_fragments, axis_index_groups)
  period = checks.check_period(sync_period, "sync_period", NAME)
  beta = _number(
    outer_learning_rate,
    "outer_learning_rate",
    0.0,
    None,
    "the paper uses 0.7",
  )
  if not beta > 0:
    raise ValueError(
      f"{NAME}: outer_learning_rate={outer_learning_rate!r} must be > 0;"
      " the paper uses 0.7."
    )
  alpha = _number(
    outer_momentum, "outer_momentum", 0.0, 1.0, "the paper uses 0.5"
  )
  gamma = beta
  if pull is not None:
    gamma = _number(
      pull, "pull", 0.0, None, "None (the default) takes outer_learning_rate"
    )
  if not _args.is_integer(seed):
    raise ValueError(
      f"{NAME}: seed={seed!r} must be an integer (the seed of the pairings)."
    )
  if not _args.is_integer(num_matchings) or int(num_matchings) < 1:
    raise ValueError(
      f"{NAME}: num_matchings={num_matchings!r} must be an integer >= 1 (the"
      " pairings the syncs cycle through); 16 is the default."
    )
  return engine.periodic(
    NAME,
    inner,
    axis_name,
    syncs=gossip.schedule(period, int(num_matchings)),
    contribution=gossip.Contribution(beta, gamma),
    outer_step=gossip.Step(alpha, gamma),
    warmup_steps=checks.check_warmup_steps(warmup_steps, NAME),
    exchange=gossip.Exchange(axis_name, int(seed), NAME),
  )
