"""Pier's outer-momentum schedule for ``diloco`` (Fan and Zhang, arXiv
2511.17849): momentum warm-up and momentum decay."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from shardopt import _args

_NAME = "shardopt.pier_momentum"


def _fraction(value: Any, arg: str) -> float:
  if (
    isinstance(value, (bool, np.bool_))
    or not isinstance(value, (int, float, np.number))
    or not 0 <= value <= 1
  ):
    raise ValueError(
      f"{_NAME}: {arg}={value!r} must be a number in [0, 1], a fraction of"
      " total_outer_steps; e.g. 0.1."
    )
  return float(value)


def pier_momentum(
  total_outer_steps: int,
  *,
  peak: float = 0.9,
  warmup_fraction: float = 0.1,
  decay_fraction: float = 0.1,
  final: float = 0.0,
):
  """Pier's outer momentum: a linear warm-up from 0, then a linear decay.

  A schedule of the outer step ``k`` (``k = 0`` at the first sync), to pass
  as ``shardopt.diloco(..., outer_momentum=pier_momentum(K))`` with ``K``
  the run's number of outer steps (``steps // sync_period``)::

    W = round(warmup_fraction * K),  D = round(decay_fraction * K)
    mu(k) = peak * k / W                           for k < W
          = peak                                   for W <= k < K - D
          = peak + (final - peak) * (k - K + D) / D  for K - D <= k < K
          = final                                  for k >= K

  (with ``D = 0`` the momentum stays at ``peak`` from ``W`` on).

  The paper names its two techniques (momentum warm-up and momentum
  decay) without formulas on the pages this was built from: the linear
  ramps, the defaults (peak 0.9, DiLoCo's; 10% warm-up; the last 10%
  decaying to 0) are shardopt's reading, said so in ``docs/pier.md``.

  Args:
    total_outer_steps: ``K``, the run's outer steps; an integer >= 1.
    peak: the momentum after the warm-up, in ``[0, 1)``.
    warmup_fraction: the warm-up's share of ``K``, in ``[0, 1]``.
    decay_fraction: the decay's share of ``K`` (the last outer steps), in
      ``[0, 1]``; ``warmup_fraction + decay_fraction <= 1``.
    final: the momentum at the end of the decay, in ``[0, 1)``.

  Returns:
    A function of the outer step count (an int or a scalar array) returning
    the momentum (float32).

  Example:
    >>> import numpy as np, shardopt
    >>> schedule = shardopt.pier_momentum(10, peak=0.9, warmup_fraction=0.2,
    ...                                   decay_fraction=0.2)
    >>> np.round([float(schedule(k)) for k in range(11)], 3).tolist()
    [0.0, 0.45, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.45, 0.0]
  """
  if not _args.is_integer(total_outer_steps) or total_outer_steps < 1:
    raise ValueError(
      f"{_NAME}: total_outer_steps={total_outer_steps!r} must be an integer"
      " >= 1, the run's outer steps (steps // sync_period)."
    )
  for arg, value in (("peak", peak), ("final", final)):
    if (
      isinstance(value, (bool, np.bool_))
      or not isinstance(value, (int, float, np.number))
      or not 0 <= value < 1
    ):
      raise ValueError(
        f"{_NAME}: {arg}={value!r} must be a momentum in [0, 1); e.g. 0.9."
      )
  warm = round(
    _fraction(warmup_fraction, "warmup_fraction") * total_outer_steps
  )
  decay = round(_fraction(decay_fraction, "decay_fraction") * total_outer_steps)
  if warm + decay > total_outer_steps:
    raise ValueError(
      f"{_NAME}: warmup_fraction={warmup_fraction!r} plus"
      f" decay_fraction={decay_fraction!r} cover more than"
      f" total_outer_steps={total_outer_steps}; their sum must be <= 1."
    )
  total = int(total_outer_steps)
  peak, final = float(peak), float(final)

  def schedule(count):
    k = jnp.asarray(count, jnp.float32)
    up = peak * k / warm if warm else jnp.float32(peak)
    start = total - decay
    down = (
      peak + (final - peak) * jnp.minimum(k - start, decay) / decay
      if decay
      else jnp.float32(peak)
    )
    mu = jnp.where(k < warm, up, jnp.where(k < start, peak, down))
    return mu.astype(jnp.float32)

  return schedule
