"""The mean over the contributors: every combine of shardopt's syncs.

A sync (the periodic engine's, within a mapped step; an elastic round, over
the islands) averages only the contributions that count: finite ones, from
replicas that are up to date, each with its weight. Whatever carries the
bytes in between, the arithmetic is these two steps:

1. ``weight`` and ``weigh``, on the sender: a contribution that does not count is
   replaced by zeros (a select, so that a left-out NaN cannot leak into the
   sum); one that counts is multiplied by its weight unless the weight is a
   flag (0/1);
2. the wire sums the weighted contributions, and the weights, in member
   order;
3. ``divide``, on every receiver: the sum over the total weight (at
   least 1: no contributor leaves a zero sum), for a mean; a sum stays.

With weights 0/1 that is plain averaging over the contributors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def weight(counts: jax.Array, weight: jax.Array | None = None) -> jax.Array:
  """A contribution's weight in the sum: the flag ``counts`` where no
  weight is given (plain averaging: 1 where it counts), else ``weight`` (a
  float) where it counts and 0 elsewhere; what :func:`weigh` takes."""
  counts = jnp.asarray(counts, bool)
  if weight is None:
    return counts
  return jnp.where(counts, jnp.asarray(weight, jnp.float32), 0.0)


def weigh(values: list, weight: jax.Array) -> list:
  """Step 1: ``values`` where ``weight`` (a bool flag, or a float weight
  ``> 0``), times the weight if it is a float; zeros elsewhere."""
  weight = jnp.asarray(weight)
  if weight.dtype == jnp.bool_:
    return [jnp.where(weight, v, jnp.zeros_like(v)) for v in values]
  return [
    jnp.where(weight > 0, v * weight.astype(v.dtype), jnp.zeros_like(v))
    for v in values
  ]


def divide(totals: list, total_weight: jax.Array, reduction: str) -> list:
  """Step 3: the summed contributions over ``max(total_weight, 1)`` for
  ``reduction == "mean"``; unchanged for ``"sum"``."""
  if reduction != "mean":
    return list(totals)
  divisor = jnp.maximum(total_weight, 1.0)
  return [t / divisor.astype(t.dtype) for t in totals]
