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
from shardopt import _shapes
from shardopt import wire
from shardopt.collectives import reduce_for
from shardopt.collectives import reduce_with_error
from shardopt.wire import feedback
from shardopt.wire.feedback import ErrorFeedbackState


def _reducing_transform(
  name: str,
  axis_name: Any,
  reduction: str,
  axis_index_groups,
  on_wire: wire.Wire,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """``cross_shard_mean``/``cross_shard_sum`` on ``on_wire`` (canonical)."""
  _axes.check_reduction(reduction, name, axis_name)
  if feedback.check(error_feedback, on_wire, name, axis_name):

    def init_fn(params):
      return ErrorFeedbackState(
        feedback.zeros_like_tree(params), optax.EmptyState()
      )

    def update_fn(updates, state, params=None):
      _shapes.check_like_params(name, updates, params, axis_name)
      del params
      updates, error = reduce_with_error(
        name,
        updates,
        state.error,
        axis_name,
        reduction=reduction,
        axis_index_groups=axis_index_groups,
        wire=on_wire,
      )
      return updates, ErrorFeedbackState(error, state.inner_state)

    return optax.GradientTransformation(init_fn, update_fn)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    _shapes.check_like_params(name, updates, params, axis_name)
    del params
    updates = reduce_for(
      name,
      updates,
      axis_name,
      reduction=reduction,
      axis_index_groups=axis_index_groups,
      wire=on_wire,
    )
    return updates, state

  return optax.GradientTransformation(init_fn, update_fn)


def cross_shard_mean(
  axis_name: Any,
  *,
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """Averages updates across the replicas of ``axis_name``.

  The optax form of ``CrossShardOptimizer(reduction=MEAN)``: put it in an
  ``optax.chain`` after any per-replica transform (e.g. clipping) and before
  the optimizer. See :func:`shardopt.reduce` for the exact semantics under
  ``pmap`` and ``shard_map``, groups, and ``comm_dtype``; stateless unless
  ``error_feedback=True``.

  With a quantized ``comm_dtype`` (e.g. ``jnp.int8``, or
  :func:`shardopt.quantized`) and ``error_feedback=True``, each replica keeps
  what quantization dropped from its contribution in
  :class:`ErrorFeedbackState` ``.error`` (float32, per replica, in the
  gradient's shape: spec ``P(axis)`` under ``jax.shard_map``) and adds it to
  its next gradient. The owner of a chunk also keeps what the requantization
  of the reduced chunk dropped, times the group size. Then the running sum
  of the outputs equals the running sum of the exact means minus the mean of
  the error buffers, to float32 rounding: its error stays within a few
  quantization steps instead of growing with the number of steps.

  Args:
    axis_name: the ``pmap``/mesh axis name (or tuple of names); None makes
      the transform the identity (plain ``jit``: the compiler reduces).
    axis_index_groups: optional equal-size groups of replica indices; each
      group averages on its own.
    comm_dtype: optional wire dtype: floating (e.g. ``jnp.bfloat16``, a
      cast) or quantized (``jnp.int8``, ``jnp.float8_e4m3fn``,
      ``jnp.float8_e5m2``, ``jnp.int4``, :func:`shardopt.quantized`).
    error_feedback: keep what a quantized wire drops and send it next step
      (needs a quantized ``comm_dtype``).

  Returns:
    An ``optax.GradientTransformation`` with ``optax.EmptyState``, or with
    :class:`ErrorFeedbackState` when ``error_feedback=True``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = optax.chain(shardopt.cross_shard_mean("batch"), optax.sgd(1.0))
    >>> def step(w, g):
    ...   updates, _ = tx.update(g, tx.init(w), w)
    ...   return optax.apply_updates(w, updates)
    >>> w = jax.pmap(step, axis_name="batch")(jnp.zeros(8), jnp.arange(1.0, 9.0))
    >>> np.asarray(w)
    array([-4.5, -4.5, -4.5, -4.5, -4.5, -4.5, -4.5, -4.5], dtype=float32)

    An int4 wire, constant gradients: the error of the running sum of the
    means after 20 steps, without and with error feedback.

    >>> g = np.random.default_rng(0).normal(size=(8, 1024)).astype(np.float32)
    >>> def drift(error_feedback):
    ...   tx = shardopt.cross_shard_mean(
    ...       "batch", comm_dtype=jnp.int4, error_feedback=error_feedback)
    ...   def run(g):
    ...     state, total = tx.init(g), jnp.zeros_like(g)
    ...     for _ in range(20):
    ...       mean, state = tx.update(g, state)
    ...       total = total + mean
    ...     return total
    ...   total = jax.pmap(run, axis_name="batch")(g)[0]
    ...   return round(float(np.max(np.abs(total - 20 * g.mean(0)))), 2)
    >>> drift(False), drift(True)
    (3.57, 0.17)

  References:
    TensorFlow, ``tf.compat.v1.tpu.CrossShardOptimizer``.

    Seide et al., 1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs, Interspeech 2014
    (error feedback).
  """
  name = "shardopt.cross_shard_mean"
  return _reducing_transform(
    name,
    axis_name,
    "mean",
    axis_index_groups,
    wire.of(comm_dtype, name, axis_name),
    error_feedback,
  )


def cross_shard_sum(
  axis_name: Any,
  *,
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """Sums updates across the replicas of ``axis_name``.

  The optax form of ``CrossShardOptimizer(reduction=SUM)``, and, together
  with :func:`scale_loss`, of TensorFlow's MEAN path written literally
  (scale the loss by ``1/n``, then sum the gradients).

  Args:
    axis_name: the ``pmap``/mesh axis name (or tuple of names), or None.
    axis_index_groups: optional equal-size groups of replica indices.
    comm_dtype: optional wire dtype, floating or quantized (see
      :func:`cross_shard_mean`).
    error_feedback: as for :func:`cross_shard_mean` (the owner keeps the
      requantization's drop once, not times the group size).

  Returns:
    An ``optax.GradientTransformation`` with ``optax.EmptyState``, or
    :class:`ErrorFeedbackState` when ``error_feedback=True``.

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
  name = "shardopt.cross_shard_sum"
  return _reducing_transform(
    name,
    axis_name,
    "sum",
    axis_index_groups,
    wire.of(comm_dtype, name, axis_name),
    error_feedback,
  )


def cross_shard(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  reduction: str = "mean",
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """Wraps ``inner`` so it sees gradients reduced across replicas.

  ``CrossShardOptimizer(inner)`` as one transform. Its state *is* ``inner``'s
  state (no wrapper), so TensorFlow's ``get_slot``/``get_slot_names`` map to
  ``optax.tree_utils.tree_get(state, "mu")`` and friends. With
  ``error_feedback=True`` (a quantized ``comm_dtype``) the state is
  :class:`ErrorFeedbackState` ``(error, inner_state)``; ``tree_get`` still
  finds ``inner``'s fields.

  Args:
    inner: the optimizer applied to the reduced gradients.
    axis_name: the ``pmap``/mesh axis name (or tuple of names), or None.
    reduction: ``"mean"`` (default) or ``"sum"``; anything else raises
      ``ValueError("Unsupported reduction: ...")`` here, as TensorFlow does.
    axis_index_groups: optional equal-size groups of replica indices.
    comm_dtype: optional wire dtype, floating or quantized (see
      :func:`cross_shard_mean`).
    error_feedback: keep what a quantized wire drops and send it next step
      (see :func:`cross_shard_mean`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s
    state (or :class:`ErrorFeedbackState` with ``error_feedback=True``).

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
  on_wire = wire.of(comm_dtype, name, axis_name)
  if feedback.check(error_feedback, on_wire, name, axis_name):
    inner = optax.with_extra_args_support(inner)

    def init_with_error(params):
      return ErrorFeedbackState(
        feedback.zeros_like_tree(params), inner.init(params)
      )

    def update_with_error(updates, state, params=None, **extra_args):
      _shapes.check_like_params(name, updates, params, axis_name)
      updates, error = reduce_with_error(
        name,
        updates,
        state.error,
        axis_name,
        reduction=reduction,
        axis_index_groups=axis_index_groups,
        wire=on_wire,
      )
      updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args
      )
      return updates, ErrorFeedbackState(error, inner_state)

    return optax.GradientTransformationExtraArgs(
      init_with_error, update_with_error
    )

  def update_fn(updates, state, params=None, **extra_args):
    _shapes.check_like_params(name, updates, params, axis_name)
    updates = reduce_for(
      name,
      updates,
      axis_name,
      reduction=reduction,
      axis_index_groups=axis_index_groups,
      wire=on_wire,
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
