"""CrossShardOptimizer as optax transforms: reduce gradients across replicas.

TensorFlow's ``tf.compat.v1.tpu.CrossShardOptimizer`` scales the loss by
``1/num_shards`` (``1/group_size`` with groups) for MEAN, then sums gradients
across shards (within groups) in ``apply_gradients`` and hands them to the
wrapped optimizer. The sum is deferred to ``apply_gradients`` so each replica
can clip its own gradient first. In optax the same shape is a chain::

    optax.chain(optax.clip_by_global_norm(1.0),          # per replica
                shardopt.cross_shard_mean("batch"),       # combine
                optax.adam(1e-3))                         # apply once

``scale_loss`` + ``cross_shard_sum`` reproduce TensorFlow literally;
``cross_shard_mean`` gives the same result in one step.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from shardopt import _axes
from shardopt.collectives import reduce


def _reducing_transform(
  name: str, axis_name: Any, reduction: str, axis_index_groups, comm_dtype
) -> optax.GradientTransformation:
  _axes.check_reduction(reduction, name, axis_name)
  _axes.check_comm_dtype(comm_dtype, name, axis_name)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    updates = reduce(
      updates,
      axis_name,
      reduction=reduction,
      axis_index_groups=axis_index_groups,
      comm_dtype=comm_dtype,
      _transform=name,
    )
    return updates, state

  return optax.GradientTransformation(init_fn, update_fn)


def cross_shard_mean(
  axis_name: Any, *, axis_index_groups=None, comm_dtype=None
) -> optax.GradientTransformation:
  """Averages updates across the replicas of ``axis_name`` (stateless).

  The optax form of ``CrossShardOptimizer(reduction=MEAN)``: put it in an
  ``optax.chain`` after any per-replica transform (e.g. clipping) and before
  the optimizer. See :func:`shardopt.reduce` for the exact semantics under
  ``pmap`` and ``shard_map``, groups, and ``comm_dtype``.

  Args:
    axis_name: the ``pmap``/mesh axis name (or tuple of names); None makes
      the transform the identity (plain ``jit``: the compiler reduces).
    axis_index_groups: optional equal-size groups of replica indices; each
      group averages on its own.
    comm_dtype: optional floating dtype used on the wire (e.g. bfloat16).

  Returns:
    An ``optax.GradientTransformation`` with ``optax.EmptyState``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = optax.chain(shardopt.cross_shard_mean("batch"), optax.sgd(1.0))
    >>> def step(w, g):
    ...   updates, _ = tx.update(g, tx.init(w), w)
    ...   return optax.apply_updates(w, updates)
    >>> w = jax.pmap(step, axis_name="batch")(jnp.zeros(8), jnp.arange(1.0, 9.0))
    >>> np.asarray(w)
    array([-4.5, -4.5, -4.5, -4.5, -4.5, -4.5, -4.5, -4.5], dtype=float32)

  References:
    TensorFlow, ``tf.compat.v1.tpu.CrossShardOptimizer``.
  """
  return _reducing_transform(
    "shardopt.cross_shard_mean",
    axis_name,
    "mean",
    axis_index_groups,
    comm_dtype,
  )


def cross_shard_sum(
  axis_name: Any, *, axis_index_groups=None, comm_dtype=None
) -> optax.GradientTransformation:
  """Sums updates across the replicas of ``axis_name`` (stateless).

  The optax form of ``CrossShardOptimizer(reduction=SUM)``, and, together
  with :func:`scale_loss`, of TensorFlow's MEAN path written literally
  (scale the loss by ``1/n``, then sum the gradients).

  Args:
    axis_name: the ``pmap``/mesh axis name (or tuple of names), or None.
    axis_index_groups: optional equal-size groups of replica indices.
    comm_dtype: optional floating dtype used on the wire.

  Returns:
    An ``optax.GradientTransformation`` with ``optax.EmptyState``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = optax.chain(shardopt.cross_shard_sum("batch"), optax.sgd(1.0))
    >>> def step(w, g):
    ...   updates, _ = tx.update(g, tx.init(w), w)
    ...   return optax.apply_updates(w, updates)
    >>> w = jax.pmap(step, axis_name="batch")(jnp.zeros(8), jnp.ones(8))
    >>> np.asarray(w)
    array([-8., -8., -8., -8., -8., -8., -8., -8.], dtype=float32)

  References:
    TensorFlow, ``tf.compat.v1.tpu.CrossShardOptimizer``.
  """
  return _reducing_transform(
    "shardopt.cross_shard_sum", axis_name, "sum", axis_index_groups, comm_dtype
  )


def cross_shard(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  reduction: str = "mean",
  axis_index_groups=None,
  comm_dtype=None,
) -> optax.GradientTransformation:
  """Wraps ``inner`` so it sees gradients reduced across replicas.

  ``CrossShardOptimizer(inner)`` as one transform. Its state *is* ``inner``'s
  state (no wrapper), so TensorFlow's ``get_slot``/``get_slot_names`` map to
  ``optax.tree_utils.tree_get(state, "mu")`` and friends.

  Args:
    inner: the optimizer applied to the reduced gradients.
    axis_name: the ``pmap``/mesh axis name (or tuple of names), or None.
    reduction: ``"mean"`` (default) or ``"sum"``; anything else raises
      ``ValueError("Unsupported reduction: ...")`` here, as TensorFlow does.
    axis_index_groups: optional equal-size groups of replica indices.
    comm_dtype: optional floating dtype used on the wire.

  Returns:
    An ``optax.GradientTransformation`` whose state is ``inner``'s state.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.cross_shard(optax.adam(0.1), "batch")
    >>> def step(w, g):
    ...   state = tx.init(w)
    ...   updates, state = tx.update(g, state, w)
    ...   return optax.tree_utils.tree_get(state, "mu")
    >>> mu = jax.pmap(step, axis_name="batch")(jnp.zeros(8), jnp.arange(8.0))
    >>> np.round(np.asarray(mu), 3)  # (1 - b1) * mean(0..7)
    array([0.35, 0.35, 0.35, 0.35, 0.35, 0.35, 0.35, 0.35], dtype=float32)

  References:
    TensorFlow, ``tf.compat.v1.tpu.CrossShardOptimizer``.
  """
  name = "shardopt.cross_shard"
  _axes.check_transform(inner, name)
  _axes.check_reduction(reduction, name, axis_name)
  _axes.check_comm_dtype(comm_dtype, name, axis_name)

  def update_fn(updates, state, params=None, **extra_args):
    updates = reduce(
      updates,
      axis_name,
      reduction=reduction,
      axis_index_groups=axis_index_groups,
      comm_dtype=comm_dtype,
      _transform=name,
    )
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def scale_loss(
  loss: jax.Array,
  axis_name: Any,
  *,
  reduction: str = "mean",
  axis_index_groups=None,
) -> jax.Array:
  """Scales a per-replica loss the way TensorFlow's cross-shard wrappers do.

  ``loss / n`` for ``"mean"`` (``n`` = the axis size, or the group size with
  groups), ``loss`` for ``"sum"``. Followed by :func:`cross_shard_sum`, this
  is ``CrossShardOptimizer``'s MEAN path written literally. Scaling the loss
  *and* using ``cross_shard_mean`` divides twice.

  Args:
    loss: this replica's loss.
    axis_name: the axis (or tuple of axes); None returns ``loss`` unchanged.
    reduction: ``"mean"`` or ``"sum"``.
    axis_index_groups: optional groups; the divisor is then the group size.

  Returns:
    The scaled loss.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, shardopt
    >>> f = jax.pmap(lambda l: shardopt.scale_loss(l, "i"), axis_name="i")
    >>> np.asarray(f(jnp.full(8, 4.0)))
    array([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], dtype=float32)
  """
  name = "shardopt.scale_loss"
  _axes.check_reduction(reduction, name, axis_name)
  if axis_name is None:
    if axis_index_groups is not None:
      raise ValueError(
        f"{name}: axis_index_groups={axis_index_groups!r} needs a named"
        " axis, but axis_name=None. Pass the pmap/mesh axis name."
      )
    return loss
  size = _axes.axis_size(axis_name, name)
  groups = _axes.validate_groups(axis_index_groups, size, name, axis_name)
  if reduction == "sum":
    return loss
  return loss / _axes.group_size(groups, size)
