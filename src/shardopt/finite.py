"""A finite check every replica agrees on: ``all_finite``, ``apply_if_finite``.

``optax.apply_if_finite(inner)`` decides on each replica's own gradients. When
``inner`` communicates (``cross_shard``, ``tower``, ``accumulate``), a NaN on
one replica sends only that replica into the skip branch while the others
wait in the all-reduce of the update branch: under ``pmap`` the step
deadlocks. :func:`apply_if_finite` makes the decision with :func:`all_finite`
over the axis, one scalar all-reduce, so every replica decides the same; it
runs ``inner`` on every replica alike and keeps its results or the old state.

The examples below assume 8 devices, e.g. a CPU forced to show them with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardopt import _args
from shardopt import _axes
from shardopt import _shapes
from shardopt._skip import update_or_skip
from shardopt.collectives import reduce_for

_ALL_FINITE = "shardopt.all_finite"
_APPLY_IF_FINITE = "shardopt.apply_if_finite"


def _locally_finite(tree: Any) -> jax.Array:
  """A bool scalar: every element of every leaf of ``tree`` here is finite."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


def all_finite(
  tree: Any, axis_name: Any = None, *, axis_index_groups=None
) -> jax.Array:
  """True iff every element of ``tree`` is finite on every replica (of a group).

  Each replica tests its own leaves, then one all-reduce of a 4-byte flag (the
  number of replicas that saw a NaN or an inf, summed with
  :func:`shardopt.reduce`) makes the answer the same on every replica of the
  axis, or of each group with ``axis_index_groups``. Under a checking
  ``jax.shard_map`` the result without groups is typed invariant, so it can
  leave through ``out_specs=P()`` and decide a ``lax.cond`` that all-reduces;
  leaves typed invariant are the same on every replica and are not
  communicated. ``axis_name=None`` tests this replica only (no collective).

  Args:
    tree: a pytree of arrays (gradients, typically); ``None`` leaves are
      skipped, integer leaves are always finite.
    axis_name: the ``pmap``/mesh axis name (or tuple of names), or None.
    axis_index_groups: optional equal-size groups of replica indices; each
      group then agrees on its own answer.

  Returns:
    A bool scalar, the same on every replica of the axis (or group).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, shardopt
    >>> grads = jnp.ones((8, 3)).at[5, 1].set(jnp.nan)  # a NaN on replica 5
    >>> f = jax.pmap(lambda g: (shardopt.all_finite(g), shardopt.all_finite(g, "i")),
    ...              axis_name="i")
    >>> here, everywhere = f(grads)
    >>> np.asarray(here)
    array([ True,  True,  True,  True,  True, False,  True,  True])
    >>> np.asarray(everywhere)
    array([False, False, False, False, False, False, False, False])
    >>> g = jax.pmap(lambda g: shardopt.all_finite(
    ...     g, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]), axis_name="i")
    >>> np.asarray(g(grads))
    array([ True,  True,  True,  True, False, False, False, False])
  """
  finite = _locally_finite(tree)
  if axis_name is None:
    if axis_index_groups is not None:
      raise ValueError(
        f"{_ALL_FINITE}: axis_index_groups={axis_index_groups!r} needs a"
        " named axis, but axis_name=None. Pass the pmap/mesh axis name."
      )
    return finite
  bad = jnp.logical_not(finite).astype(jnp.float32)
  if axis_index_groups is not None and _axes.vma_checked():
    # A flag typed invariant is the same everywhere; groups need it varying
    # to be summed within each group (shardopt.reduce rejects invariant
    # leaves with groups).
    bad = _axes.cast_varying(bad, _axes.axis_names(axis_name))
  bad_replicas = reduce_for(
    _ALL_FINITE,
    bad,
    axis_name,
    reduction="sum",
    axis_index_groups=axis_index_groups,
  )
  return bad_replicas == 0


_NO_AXIS_NAME = object()  # apply_if_finite's axis_name was not given


def _old_order(max_consecutive_errors, old_order: tuple, axis_name):
  """``(axis_name, max_consecutive_errors)`` of a call in either order:
  optax's ``(inner, max_consecutive_errors, *, axis_name=...)``, or the
  order of shardopt <= 0.1, ``(inner, axis_name, max_consecutive_errors)``,
  which warns."""
  if not old_order:
    if axis_name is _NO_AXIS_NAME:
      raise TypeError(
        f"{_APPLY_IF_FINITE}: axis_name is required (keyword-only): the"
        " mesh or pmap axis over which every replica must agree to skip,"
        " e.g. apply_if_finite(inner, 5, axis_name='data'). A port of"
        " optax.apply_if_finite(inner, 5) that decides on each replica's"
        " own gradients is axis_name=None."
      )
    return axis_name, max_consecutive_errors
  if len(old_order) > 1 or axis_name is not _NO_AXIS_NAME:
    raise TypeError(
      f"{_APPLY_IF_FINITE}: takes (inner, max_consecutive_errors, *,"
      f" axis_name=...), got {2 + len(old_order)} positional arguments"
      + ("" if axis_name is _NO_AXIS_NAME else " and axis_name")
      + "."
    )
  warnings.warn(
    f"{_APPLY_IF_FINITE}(inner, axis_name, max_consecutive_errors) is"
    " deprecated: use optax's order, apply_if_finite(inner,"
    f" {old_order[0]!r}, axis_name={max_consecutive_errors!r}).",
    DeprecationWarning,
    stacklevel=3,
  )
  return max_consecutive_errors, old_order[0]


def apply_if_finite(
  inner: optax.GradientTransformation,
  max_consecutive_errors: int,
  *old_order: Any,
  axis_name: Any = _NO_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
  """Skips the update on every replica when any replica's gradient is not finite.

  ``optax.apply_if_finite`` with the decision made by :func:`all_finite`
  over ``axis_name``, so every replica decides the same:

  1. ``finite = all_finite(updates, axis_name)``: one 4-byte all-reduce, the
     guard's only collective (none with ``axis_name=None``);
  2. ``notfinite_count`` counts consecutive non-finite steps (reset to 0 by a
     finite one), ``total_notfinite`` all of them, ``last_finite`` is
     ``finite``;
  3. ``inner.update`` runs on every step, with every collective it holds (the
     same program on every replica, so none can hang). If ``finite`` or
     ``notfinite_count > max_consecutive_errors``, its updates and new state
     are returned; otherwise the updates are zeros and ``inner_state`` is
     kept, bit for bit, whatever NaN or inf the skipped update computed.

  Step 3 is a select, not a ``lax.cond``: each new state leaf is selected
  where ``inner`` computes it, so ``inner``'s update still fuses with the
  caller's ``optax.apply_updates`` and a donated step copies nothing more
  than the unguarded one. The guard costs what the finite check costs, one
  read of the gradients (``benchmarks/cost.py`` group 5;
  ``docs/reliability.md``).

  The state is ``optax.ApplyIfFiniteState``, so checkpoints and
  ``optax.tree_utils.tree_get`` work as for optax's. With a ``inner`` that
  does not communicate, the numbers are ``optax.apply_if_finite``'s on the
  replica that sees a NaN, and on every other replica too.

  Safe around transforms that communicate (``cross_shard``, ``tower``,
  ``accumulate``), where ``optax.apply_if_finite`` deadlocks under ``pmap``.
  Around ``accumulate`` a non-finite mini-step is skipped whole: its gradient
  is not accumulated. The zero updates of a skipped step carry the types of
  ``inner``'s updates, so under a checking ``jax.shard_map`` replicated
  ``P()`` params stay ``P()``. The counters may arrive typed varying (the
  whole state under ``P(axis)``) or stacked (``jax.pmap(tx.init)``).

  The arguments are in ``optax.apply_if_finite``'s order, shardopt's
  ``axis_name`` keyword-only: a port of ``optax.apply_if_finite(inner, 5)``
  fails with an error that asks for ``axis_name``. The order of shardopt
  <= 0.1, ``apply_if_finite(inner, axis_name, max_consecutive_errors)``,
  still works for this release, with a ``DeprecationWarning``.

  Args:
    inner: the transform to guard.
    max_consecutive_errors: how many consecutive non-finite steps are
      skipped; the next one is applied (as in optax).
    *old_order: the deprecated order's ``max_consecutive_errors`` (then the
      second argument is the axis name).
    axis_name: keyword-only, required: the ``pmap``/mesh axis name (or tuple
      of names) over which the replicas must agree; None decides on this
      replica's gradients alone (``optax.apply_if_finite``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    ``optax.ApplyIfFiniteState``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.apply_if_finite(
    ...     shardopt.cross_shard(optax.sgd(1.0), "batch"), 3, axis_name="batch")
    >>> def step(w, g):
    ...   updates, state = tx.update(g, tx.init(w), w)
    ...   return updates, state.total_notfinite
    >>> grads = jnp.ones(8).at[2].set(jnp.inf)  # replica 2 overflowed
    >>> updates, skipped = jax.pmap(step, axis_name="batch")(jnp.zeros(8), grads)
    >>> np.asarray(updates)  # every replica skipped, none hung
    array([0., 0., 0., 0., 0., 0., 0., 0.], dtype=float32)
    >>> np.asarray(skipped)
    array([1, 1, 1, 1, 1, 1, 1, 1], dtype=int32)

  References:
    ``optax.apply_if_finite``; Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, 2018 (skipping steps whose scaled
    gradients overflow).
  """
  axis_name, max_consecutive_errors = _old_order(
    max_consecutive_errors, old_order, axis_name
  )
  if not _args.is_integer(max_consecutive_errors) or max_consecutive_errors < 0:
    raise ValueError(
      f"{_APPLY_IF_FINITE}: max_consecutive_errors={max_consecutive_errors!r}"
      " must be a non-negative integer, the number of consecutive"
      " non-finite steps to skip before an update is applied anyway (e.g."
      " 5)."
    )
  _axes.check_transform(inner, _APPLY_IF_FINITE)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return optax.ApplyIfFiniteState(
      notfinite_count=jnp.zeros([], jnp.int32),
      last_finite=jnp.array(True, jnp.bool_),
      total_notfinite=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _shapes.check_like_params(_APPLY_IF_FINITE, updates, params, axis_name)
    if axis_name is not None:
      _axes.axis_size(axis_name, _APPLY_IF_FINITE)
    finite = all_finite(updates, axis_name)
    notfinite_count = jnp.where(
      finite,
      jnp.zeros_like(state.notfinite_count),
      optax.safe_increment(state.notfinite_count),
    )
    consecutive = _axes.scalar_counter(
      notfinite_count, _APPLY_IF_FINITE, "state.notfinite_count"
    )
    # A select, not a lax.cond: the inner update stays fusable with the
    # caller's apply_updates (see shardopt._skip).
    new_updates, inner_state = update_or_skip(
      jnp.logical_or(finite, consecutive > max_consecutive_errors),
      inner.update,
      updates,
      state.inner_state,
      params,
      **extra_args,
    )
    return new_updates, optax.ApplyIfFiniteState(
      notfinite_count=notfinite_count,
      last_finite=_axes.cast_tree_like(
        jnp.reshape(finite, jnp.shape(state.last_finite)), state.last_finite
      ),
      total_notfinite=jnp.where(
        finite,
        state.total_notfinite,
        optax.safe_increment(state.total_notfinite),
      ),
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
