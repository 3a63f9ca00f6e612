"""How the replicas' contributions combine: one collective round within a
sync's groups, a non-finite contribution left out.
"""

from __future__ import annotations

import jax.numpy as jnp

from shardopt import _axes
from shardopt import wire as _wire
from shardopt.collectives import reduce_for
from shardopt.collectives import reduce_with_error
from shardopt.finite import all_finite
from shardopt.wire import mean


def combine(
  mine: list,
  axis_name,
  groups,
  *,
  reduction: str,
  wire: _wire.Wire,
  whole_axis_count: bool,
  transform: str,
  error: list | None = None,
):
  """One collective round on ``wire``; a non-finite contribution is left out.

  Returns the combined contribution (sum or mean over the finite replicas of
  the group), this replica's finiteness, the number of finite replicas in its
  group and (with ``whole_axis_count`` and groups) in the whole axis, and
  (with ``error``, error feedback on a quantized wire) the new error
  buffers: ``error`` is added to this replica's contribution (not if it is
  left out) and what the wire drops from it is kept (see
  :meth:`shardopt.wire.Wire.all_reduce`). The arithmetic of the
  mean is :mod:`shardopt.wire.mean`'s, as in an elastic round.
  """
  finite = all_finite(mine)
  masked = mean.weigh(mine, finite)
  if error:
    error = mean.weigh(error, finite)
  flag = finite.astype(jnp.float32)
  if _axes.vma_checked():
    flag = _axes.cast_varying(flag, _axes.axis_names(axis_name))
  # The finite flag (a count once summed) never travels in a narrow dtype:
  # a bfloat16 sum of 299 ones reads 298 (bfloat16 steps by 2 above 256).
  # With a float32 (or wider) wire it rides with the contributions, one
  # round; with a narrow or a quantized wire it has its own float32
  # all-reduce (same groups).
  if wire.carries_counts:
    *total, in_group = reduce_for(
      transform,
      masked + [flag],
      axis_name,
      reduction="sum",
      axis_index_groups=groups,
      wire=wire,
    )
  else:
    if error:
      total, error = reduce_with_error(
        transform,
        masked,
        error,
        axis_name,
        reduction="sum",
        axis_index_groups=groups,
        wire=wire,
      )
    else:
      total = reduce_for(
        transform,
        masked,
        axis_name,
        reduction="sum",
        axis_index_groups=groups,
        wire=wire,
      )
    in_group = reduce_for(
      transform, flag, axis_name, reduction="sum", axis_index_groups=groups
    )
  in_group = jnp.round(in_group)
  in_axis = in_group
  if groups is not None and whole_axis_count:
    in_axis = jnp.round(reduce_for(transform, flag, axis_name, reduction="sum"))
  total = mean.divide(total, in_group, reduction)
  return total, finite, in_group, in_axis, error
