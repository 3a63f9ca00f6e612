"""AGNOptimizer and the periodic-communication family: ``agn``, ``local_sgd``, ``diloco``.

One engine, three thin public wrappers. Every replica trains on its own
(local) copy of the params with ``optimizer``; every ``period`` steps the
replicas combine one *contribution* each across the axis, a *global*
optimizer moves a shared ``center`` with it, and the returned updates move
every replica's params onto the new center::

  contribution    AGN: a_i = (sum of the gradients since the last sync) / T
                  local_sgd / diloco: a_i = center - local_params_i
  combination     a = mean_i a_i  (or sum_i a_i for agn(reduction="sum"))
  global step     center <- global_optimizer(center, a)
  pull            params_i <- center

With ``global_optimizer = sgd(1)`` and the params contribution,
``center - mean_i(center - local_i) = mean_i(local_i)``: periodic model
averaging (``local_sgd``). With ``sgd(lr, momentum, nesterov=True)`` it is
DiLoCo's outer step.

Communication happens only on sync steps: the collectives sit inside the sync
branch of one ``jax.lax.cond`` whose predicate is the replicated step counter.
The other ``period - 1`` steps run no collective at all.

TensorFlow's AGNOptimizer is asynchronous: each worker commits its normalized
accumulator to a parameter server on its own schedule. shardopt is
synchronous SPMD: all replicas commit in the same step, and the commits are
combined with ``reduction`` ("mean" by default; "sum" is what a parameter
server does when it applies every worker's commit in one round).

The examples assume 8 devices (for instance a CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _axes
from shardopt.collectives import reduce

_GRADIENTS = "gradients"
_PARAMS = "params"


class AGNState(NamedTuple):
  """State of :func:`agn`, :func:`local_sgd` and :func:`diloco`.

  Every field is an array (or a pytree of arrays), so a checkpoint taken in
  the middle of a communication period restores and continues bit-identically
  (``jax.tree.map(np.asarray, state)`` round-trips).

  Attributes:
    count: int32 scalar, local steps taken (the same on every replica).
    sync_count: int32 scalar, synchronisations done (TensorFlow's global step
      of the center variables); one all-reduce round each.
    accumulator: the sum of this replica's gradients since the last sync,
      float32 for low-precision gradients (``agn`` only; ``local_sgd`` and
      ``diloco`` keep an empty tuple here: their contribution is read from
      the params at the sync step).
    center: the shared params every replica is pulled onto at a sync,
      bit-identical on every replica (within a group with
      ``axis_index_groups``).
    local_state: this replica's state of the local ``optimizer``.
    global_state: the global optimizer's state (for the center), the same on
      every replica (within a group).
    skipped: int32 scalar, how many replica contributions were left out of a
      combination because they were not finite, summed over all syncs and
      over the whole axis.
  """
  count: chex.Array
  sync_count: chex.Array
  accumulator: Any
  center: Any
  local_state: Any
  global_state: Any
  skipped: chex.Array


def _accumulation_dtype(dtype) -> np.dtype:
  """float32 for low-precision floats (bf16, f16), the dtype itself otherwise."""
  return jnp.promote_types(dtype, jnp.float32)


def _check_period(value: Any, arg: str, transform: str) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)) or int(value) < 1:
    raise ValueError(
        f"{transform}: {arg}={value!r} must be an integer >= 1 (the number of"
        f" local steps between two synchronisations); e.g. {arg}=10.")
  return int(value)


def _check_axis_name(axis_name: Any, transform: str) -> None:
  if axis_name is None:
    raise ValueError(
        f"{transform}: axis_name=None, but {transform} needs a named axis: the"
        " replicas train apart between synchronisations, so they must be"
        " mapped over a named axis. Call it inside jax.pmap(...,"
        " axis_name='batch') or jax.shard_map over a mesh axis, and pass that"
        " name.")


def _all_finite(tree: Any) -> jax.Array:
  """A boolean scalar: every element of every leaf is finite."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


def _cast_tree_like(tree: Any, *likes: Any) -> Any:
  """Casts every leaf of ``tree`` to be varying wherever a ``likes`` leaf is."""
  if not _axes.vma_checked():
    return tree

  def leaf(x, *others):
    axes = frozenset().union(*(_axes.varying_axes(o) for o in others))
    return _axes.cast_varying(x, axes)

  return jax.tree.map(leaf, tree, *likes)


def _where_float(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """``jnp.where(pred, on_true, on_false)`` on the floating-point leaves.

  Integer leaves (step counts) take ``on_true``. Under a checking shard_map a
  leaf typed invariant while ``pred`` is varying also takes ``on_true``, so
  that replicated leaves stay replicated.
  """
  pred_axes = _axes.varying_axes(pred) if _axes.vma_checked() else frozenset()

  def leaf(t, f):
    if not jnp.issubdtype(t.dtype, jnp.floating):
      return t
    if pred_axes - _axes.varying_axes(t):
      return t
    return jnp.where(pred, t, f.astype(t.dtype))

  return jax.tree.map(leaf, on_true, on_false)


def _check_local_gradients(grads: Any, params: Any, axis_name: Any,
                           transform: str) -> None:
  """Checks grads: params' tree structure, floating point, not invariant.

  Gradients typed invariant were summed by autodiff: not local gradients.
  Everything here runs at trace time, before any state is touched.
  """
  grads_def = jax.tree.structure(grads)
  params_def = jax.tree.structure(params)
  if grads_def != params_def:
    raise ValueError(
        f"{transform}: the gradient tree does not match the params tree over"
        f" axis {axis_name!r}: grads have structure {grads_def}, params have"
        f" {params_def}. Pass the gradient of the same params the state was"
        " built from (tx.init(params)).")
  checked = _axes.vma_checked()

  def leaf(path, g):
    _axes.check_float_leaf(path, g, transform, axis_name)
    if not checked:
      return
    _, invariant = _axes.split_axes(g, axis_name)
    if invariant:
      raise ValueError(
          f"{transform}: the gradient at {jax.tree_util.keystr(path) or '<root>'}"
          f" is invariant over axis {_axes.as_axis(invariant)!r}: the params were"
          " replicated (P()), so autodiff has already summed the gradient over"
          " every replica. That is the synchronous gradient, not this"
          f" replica's local gradient, and {transform} needs the local one"
          " (the replicas train apart between synchronisations). Fix: give each"
          " replica its own params, typed varying: a leading replica axis"
          f" sharded over {axis_name!r} (in_specs=P({axis_name!r})), or"
          f" params = jax.lax.pcast(params, {axis_name!r}, to='varying') before"
          " jax.grad.")

  jax.tree_util.tree_map_with_path(leaf, grads)


def _check_counter(count: Any, axis_name: Any, transform: str) -> None:
  if jnp.ndim(count) != 0:
    raise ValueError(
        f"{transform}: state.count has shape {jnp.shape(count)}, expected a"
        " scalar. Inside jax.shard_map keep the scalar counters of the state"
        " replicated (spec P()) and give only the arrays a leading replica"
        " axis; under jax.pmap, build the state with jax.pmap(tx.init).")
  if _axes.vma_checked():
    varying, _ = _axes.split_axes(count, axis_name)
    if varying:
      raise ValueError(
          f"{transform}: state.count is varying over axis"
          f" {_axes.as_axis(varying)!r}, but the step counter must be the same"
          " on every replica (it decides when all replicas synchronise). Pass"
          " the scalar counters of the state with spec P().")


def _periodic(name: str, optimizer: optax.GradientTransformation,
              global_optimizer: optax.GradientTransformation, axis_name: Any, *,
              period: int, contribution: str, reduction: str,
              axis_index_groups, comm_dtype
              ) -> optax.GradientTransformationExtraArgs:
  """The engine behind :func:`agn`, :func:`local_sgd` and :func:`diloco`.

  Args:
    name: the public transform's name, used in error messages.
    optimizer: the local optimizer, applied on every replica at every step.
    global_optimizer: the optimizer that moves the center at a sync.
    axis_name: the replica axis (or tuple of axes).
    period: local steps between two synchronisations (validated by the
      caller, which knows the argument's public name).
    contribution: ``"gradients"`` (AGN: accumulated gradients / period) or
      ``"params"`` (the pseudo-gradient ``center - local params``).
    reduction: how contributions combine across replicas.
    axis_index_groups: optional groups; each group keeps its own center.
    comm_dtype: optional floating dtype on the wire.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`AGNState`.
  """
  # The public wrappers check axis_name and their period argument first (it
  # has a different name in each); the rest is checked here, once.
  _axes.check_reduction(reduction, name, axis_name)
  _axes.check_comm_dtype(comm_dtype, name, axis_name)
  local = optax.with_extra_args_support(optimizer)
  accumulate = contribution == _GRADIENTS

  def init_fn(params):
    if accumulate:
      accumulator = jax.tree.map(
          lambda p: jnp.zeros_like(p, dtype=_accumulation_dtype(p.dtype)), params)
    else:
      accumulator = ()
    return AGNState(
        count=jnp.zeros([], jnp.int32),
        sync_count=jnp.zeros([], jnp.int32),
        accumulator=accumulator,
        center=jax.tree.map(jnp.asarray, params),
        local_state=optimizer.init(params),
        global_state=global_optimizer.init(params),
        skipped=jnp.zeros([], jnp.int32))

  def update_fn(grads, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          f"{name}: params are required; call tx.update(grads, state, params)."
          " At a sync the returned updates move params onto the center, which"
          " needs the current params.")
    size = _axes.axis_size(axis_name, name)
    groups = _axes.validate_groups(axis_index_groups, size, name, axis_name)
    _check_counter(state.count, axis_name, name)
    _check_local_gradients(grads, params, axis_name, name)
    center_def = jax.tree.structure(state.center)
    if center_def != jax.tree.structure(params):
      raise ValueError(
          f"{name}: the state does not match the params tree over axis"
          f" {axis_name!r}: state.center has structure {center_def}, params"
          f" have {jax.tree.structure(params)}. Build the state with"
          " tx.init(params) from these params.")
    if groups is not None and _axes.vma_checked():
      for c in jax.tree.leaves(state.center):
        _, invariant = _axes.split_axes(c, axis_name)
        if invariant:
          raise ValueError(
              f"{name}: with axis_index_groups each group keeps its own center,"
              f" so the center must be typed varying over {axis_name!r}, but it"
              " is invariant (it was initialised from replicated params). Build"
              " the state with tx.init(params) from params that carry a leading"
              f" replica axis sharded over {axis_name!r}, or from"
              f" jax.lax.pcast(params, {axis_name!r}, to='varying').")

    # Every step: one local step, accumulate, count.
    local_updates, local_state = local.update(
        grads, state.local_state, params, **extra_args)
    # Updates are in the params' dtype on every step (a sync step's updates
    # are center - params), so both branches of the cond agree even when the
    # gradients are narrower (bfloat16 grads for float32 params).
    local_updates = jax.tree.map(lambda u, p: u.astype(p.dtype), local_updates,
                                 params)
    if accumulate:
      accumulator = jax.tree.map(lambda a, g: a + g.astype(a.dtype),
                                 state.accumulator, grads)
    else:
      accumulator = ()
    count = state.count + 1
    is_sync = count % period == 0

    def contributions():
      if accumulate:  # AGN: a_i = (g_1 + ... + g_T) / T
        return jax.tree.map(lambda a: a / jnp.asarray(period, a.dtype),
                            accumulator)
      # Pseudo-gradient: center - (params after this step's local update).
      local_params = optax.apply_updates(params, local_updates)

      def pseudo_gradient(c, p):
        wide = _accumulation_dtype(p.dtype)
        return c.astype(wide) - p.astype(wide)

      return jax.tree.map(pseudo_gradient, state.center, local_params)

    def sync_branch():
      mine = contributions()
      # A replica whose contribution is not finite is left out of the round.
      finite = _all_finite(mine)
      masked = jax.tree.map(lambda a: jnp.where(finite, a, jnp.zeros_like(a)),
                            mine)
      total = reduce(masked, axis_name, reduction="sum",
                     axis_index_groups=groups, comm_dtype=comm_dtype,
                     _transform=name)
      flag = finite.astype(jnp.float32)
      if _axes.vma_checked():
        flag = _axes.cast_varying(flag, _axes.axis_names(axis_name))
      finite_in_group = reduce(flag, axis_name, reduction="sum",
                               axis_index_groups=groups, _transform=name)
      finite_in_axis = finite_in_group if groups is None else reduce(
          flag, axis_name, reduction="sum", _transform=name)
      if reduction == "mean":
        divisor = jnp.maximum(finite_in_group, 1.0)
        total = jax.tree.map(lambda t: t / divisor.astype(t.dtype), total)
      combined = jax.tree.map(lambda t, c: t.astype(c.dtype), total,
                              state.center)
      center_updates, global_state = global_optimizer.update(
          combined, state.global_state, state.center)
      center = optax.apply_updates(state.center, center_updates)
      # No finite replica in the group: the center and the float leaves of the
      # global state stay as they were (integer step counts advance).
      any_finite = finite_in_group > 0
      center = _where_float(any_finite, center, state.center)
      global_state = _where_float(any_finite, global_state, state.global_state)
      # A replica that was left out restarts the float leaves of its local
      # optimizer state (moments, which may hold the non-finite values) from
      # optimizer.init(center); integer leaves (step counts) are kept.
      fresh = _cast_tree_like(optimizer.init(center), local_state)
      new_local_state = _where_float(finite, local_state, fresh)
      # Pull: params + (center - params) lands on the center (exactly when
      # center/2 <= params <= 2*center, Sterbenz; see the agn docstring).
      updates = jax.tree.map(lambda c, p: c.astype(p.dtype) - p, center, params)
      skipped = state.skipped + jnp.round(size - finite_in_axis).astype(jnp.int32)
      return (updates, jax.tree.map(jnp.zeros_like, accumulator), center,
              global_state, new_local_state, state.sync_count + 1, skipped)

    def local_branch():
      return (local_updates, accumulator, state.center, state.global_state,
              local_state, state.sync_count, state.skipped)

    if _axes.vma_checked():
      # Both branches of the cond must agree on varying-ness: cast each output
      # to the union of what either branch (and the incoming state) is.
      sync_types = jax.eval_shape(sync_branch)
      local_types = local_branch()

      def typed(branch):
        return lambda: _cast_tree_like(branch(), sync_types, local_types)

      outputs = jax.lax.cond(is_sync, typed(sync_branch), typed(local_branch))
    else:
      outputs = jax.lax.cond(is_sync, sync_branch, local_branch)
    (updates, accumulator, center, global_state, local_state, sync_count,
     skipped) = outputs
    return updates, AGNState(
        count=count, sync_count=sync_count, accumulator=accumulator,
        center=center, local_state=local_state, global_state=global_state,
        skipped=skipped)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)



def _check_outer_args(transform: str, outer_learning_rate: Any,
                      outer_momentum: Any, nesterov: Any) -> None:
  if not callable(outer_learning_rate) and (
      isinstance(outer_learning_rate, (bool, np.bool_))
      or not isinstance(outer_learning_rate, (int, float, np.number))
      or not outer_learning_rate > 0):
    raise ValueError(
        f"{transform}: outer_learning_rate={outer_learning_rate!r} must be a"
        " positive number (or an optax schedule); DiLoCo uses 0.7.")
  if isinstance(outer_momentum, (bool, np.bool_)) or not isinstance(
      outer_momentum, (int, float, np.number)) or not 0 <= outer_momentum < 1:
    raise ValueError(
        f"{transform}: outer_momentum={outer_momentum!r} must be a number in"
        " [0, 1); DiLoCo uses 0.9 (0 turns momentum off).")
  if not isinstance(nesterov, (bool, np.bool_)):
    raise ValueError(f"{transform}: nesterov={nesterov!r} must be True or"
                     " False; DiLoCo uses True.")


def agn(optimizer: optax.GradientTransformation, axis_name: Any, *,
        communication_period: int = 10,
        global_optimizer: Optional[optax.GradientTransformation] = None,
        reduction: str = "mean", axis_index_groups=None, comm_dtype=None
        ) -> optax.GradientTransformationExtraArgs:
  """Accumulated Gradient Normalization (TensorFlow's ``AGNOptimizer``).

  Every step, on every replica: a local step of ``optimizer`` on this
  replica's params, ``accumulator += grads`` (in float32 for bfloat16/float16
  gradients) and ``count += 1``. Every ``communication_period`` steps (when
  ``count % communication_period == 0``) the replicas synchronise:

  1. normalize: ``a = accumulator / communication_period``;
  2. combine ``a`` across the replicas of ``axis_name`` with ``reduction``
     (within each group of ``axis_index_groups``), leaving out any replica
     whose ``a`` is not finite (the mean is then over the finite replicas; if
     none is finite, the center does not move); ``state.skipped`` counts the
     contributions left out;
  3. ``global_optimizer`` applies the combined ``a`` to ``state.center``;
  4. the returned updates are ``center - params``: they move every
     replica's params onto the new center; the accumulator is zeroed and
     ``sync_count += 1``.

  The all-reduce runs only at a sync step: it is inside the sync branch of a
  ``jax.lax.cond`` whose predicate is the replicated counter, so the other
  steps communicate nothing (parameter bytes / ``communication_period`` per
  step on average).

  TensorFlow's version is asynchronous (every worker commits to a parameter
  server on its own); this one is synchronous SPMD. ``reduction="mean"``
  (default) averages the replicas' normalized accumulators; ``"sum"`` is what
  a parameter server does when it applies each worker's commit in the same
  round.

  Under ``jax.pmap`` every value is per replica. Under ``jax.shard_map`` the
  params differ across replicas between syncs, so they must be typed
  *varying*: give them a leading replica axis sharded over ``axis_name`` (see
  the example), or ``jax.lax.pcast(params, axis_name, to="varying")`` before
  ``jax.grad``. Gradients typed invariant (replicated ``P()`` params, whose
  gradient autodiff has already summed over the axis) are not local gradients
  and raise a ``ValueError``. Keep the scalar counters of the state
  replicated (``P()``).

  ``params + (center - params)`` is not always bitwise ``center`` in floating
  point (it is when ``center/2 <= params <= 2*center``), and it cannot repair
  non-finite params. The center itself is bit-identical on every replica; to
  make the params so after a sync (and to bring back a replica whose params
  went non-finite), snap them::

    updates, new_state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    synced = new_state.sync_count > state.sync_count
    params = jax.tree.map(lambda p, c: jnp.where(synced, c, p), params,
                          new_state.center)

  A replica left out of a combination also restarts the floating-point
  leaves of its local optimizer state (the moments, which may hold the
  non-finite values) from ``optimizer.init(center)``; integer leaves (step
  counts) are kept.

  Args:
    optimizer: the local optimizer (sgd, momentum, adam, ...), applied on every
      replica at every step.
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
      ``None`` is an error: the replicas must be mapped over a named axis.
    communication_period: local steps between two synchronisations (T); an
      integer >= 1.
    global_optimizer: the optimizer that applies the combined, normalized
      accumulator to the center. ``None`` uses an independent second instance
      of ``optimizer`` (its own state, as TensorFlow's separate slots).
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` turns AGN toward DiLoCo.
    reduction: ``"mean"`` (default) or ``"sum"``; anything else raises
      ``ValueError("Unsupported reduction: ...")``.
    axis_index_groups: optional equal-size groups of replica indices that
      partition the axis; each group combines and keeps its own center.
    comm_dtype: optional floating dtype used on the wire (e.g. bfloat16).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`AGNState`. ``update`` needs ``params``. Extra keyword arguments go
    to the local optimizer.

  Example:
    The SGD oracle from TensorFlow's tests: the center moves by ``lr`` times
    the *normalized* accumulator at step 4::

      >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
      >>> tx = shardopt.agn(optax.sgd(0.1), "batch", communication_period=4)
      >>> def step(params, state):
      ...   grads = jnp.full_like(params, -1.0)
      ...   updates, state = tx.update(grads, state, params)
      ...   return optax.apply_updates(params, updates), state
      >>> step = jax.pmap(step, axis_name="batch")
      >>> params = jnp.tile(jnp.array([0.0, 0.5]), (8, 1))
      >>> state = jax.pmap(tx.init)(params)
      >>> for _ in range(4):
      ...   params, state = step(params, state)
      >>> np.asarray(state.center[0]), int(state.sync_count[0])
      (array([0.1, 0.6], dtype=float32), 1)

    Under ``jax.shard_map``: one row of params per replica (varying), scalar
    counters replicated::

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("batch",))
      >>> tx = shardopt.agn(optax.sgd(0.1), "batch", communication_period=2)
      >>> def step(w, state, x):  # w: this replica's params, shape (1, 2)
      ...   grads = jax.grad(lambda w: jnp.sum((w - x) ** 2))(w)
      ...   updates, state = tx.update(grads, state, w)
      ...   return optax.apply_updates(w, updates), state
      >>> specs = jax.tree.map(lambda v: P() if jnp.ndim(v) == 0 else P("batch"),
      ...                      tx.init(jnp.zeros((1, 2))))
      >>> init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("batch"),
      ...                              out_specs=specs))
      >>> step = jax.jit(jax.shard_map(step, mesh=mesh,
      ...     in_specs=(P("batch"), specs, P("batch")), out_specs=(P("batch"), specs)))
      >>> rows = NamedSharding(mesh, P("batch"))
      >>> w = jax.device_put(jnp.zeros((8, 2)), rows)
      >>> x = jax.device_put(jnp.arange(16.0).reshape(8, 2), rows)
      >>> state = init(w)
      >>> for _ in range(2):
      ...   w, state = step(w, state, x)
      >>> np.round(np.asarray(state.center), 4)[:2]  # 0.1 * 1.8 * mean(x)
      array([[1.26, 1.44],
             [1.26, 1.44]], dtype=float32)

  References:
    Hermans, Spanakis and Möckel, `Accumulated Gradient Normalization
    <https://arxiv.org/abs/1710.02368>`_, ACML 2017.
    TensorFlow, ``tf.contrib.opt.AGNOptimizer`` (r1.14).
  """
  name = "shardopt.agn"
  _check_axis_name(axis_name, name)
  period = _check_period(communication_period, "communication_period", name)
  if global_optimizer is None:
    global_optimizer = optimizer
  return _periodic(name, optimizer, global_optimizer, axis_name, period=period,
                   contribution=_GRADIENTS, reduction=reduction,
                   axis_index_groups=axis_index_groups, comm_dtype=comm_dtype)


def local_sgd(optimizer: optax.GradientTransformation, axis_name: Any, *,
              period: int, axis_index_groups=None, comm_dtype=None
              ) -> optax.GradientTransformationExtraArgs:
  """Periodic model averaging (local SGD): every ``period`` steps, params ← mean.

  Each replica takes ``period`` local steps of ``optimizer``; then the params
  of all replicas (of each group) are replaced by their mean. It is the
  engine of :func:`agn` with the contribution ``center - local params`` and
  a global ``optax.sgd(1.0)``: ``center - mean_i(center - local_i) =
  mean_i(local_i)``. The state's ``accumulator`` is an empty tuple (the
  contribution is read from the params at the sync step). For plain SGD it
  equals ``agn(optax.sgd(lr), ..., global_optimizer=optax.sgd(lr * period))``.

  Non-finite replicas are left out of the mean, the collectives run only at
  sync steps, and the same shard_map pattern applies: see :func:`agn`.

  Args:
    optimizer: the local optimizer.
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
    period: local steps between two averagings; an integer >= 1.
    axis_index_groups: optional equal-size groups; each group averages alone.
    comm_dtype: optional floating dtype used on the wire.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`AGNState`. ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.local_sgd(optax.sgd(1.0), "batch", period=2)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.pmap(step, axis_name="batch")
    >>> params = jnp.zeros(8)
    >>> state = jax.pmap(tx.init)(params)
    >>> grads = -jnp.arange(8.0)  # replica i moves by i per step
    >>> params, state = step(params, state, grads)
    >>> np.asarray(params)
    array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
    >>> params, state = step(params, state, grads)  # mean(2 * i) = 7
    >>> np.asarray(params)
    array([7., 7., 7., 7., 7., 7., 7., 7.], dtype=float32)

  References:
    Stich, `Local SGD Converges Fast and Communicates Little
    <https://arxiv.org/abs/1805.09767>`_, ICLR 2019.
  """
  name = "shardopt.local_sgd"
  _check_axis_name(axis_name, name)
  period = _check_period(period, "period", name)
  return _periodic(name, optimizer, optax.sgd(1.0), axis_name, period=period,
                   contribution=_PARAMS, reduction="mean",
                   axis_index_groups=axis_index_groups, comm_dtype=comm_dtype)


def diloco(optimizer: optax.GradientTransformation, axis_name: Any, *,
           sync_period: int = 500, outer_learning_rate: float = 0.7,
           outer_momentum: float = 0.9, nesterov: bool = True,
           axis_index_groups=None, comm_dtype=None
           ) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: local inner steps, then an outer Nesterov step on the mean delta.

  Each replica takes ``sync_period`` steps of the inner ``optimizer`` (AdamW
  in the paper); then the outer gradient ``center - mean_i(local params_i)``
  is applied to the center by SGD with (Nesterov) momentum, and every replica
  restarts from the new center. The inner optimizer state is kept across
  rounds, as in the paper. The same engine as :func:`agn` (contribution
  ``center - local params``, global ``optax.sgd(outer_learning_rate,
  momentum=outer_momentum, nesterov=nesterov)``); the state's ``accumulator``
  is an empty tuple.

  Args:
    optimizer: the inner optimizer (e.g. ``optax.adamw(...)``).
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
    sync_period: inner steps per outer step (H in the paper); integer >= 1.
    outer_learning_rate: the outer SGD learning rate (or an optax schedule).
    outer_momentum: the outer momentum in ``[0, 1)``.
    nesterov: whether the outer momentum is Nesterov's.
    axis_index_groups: optional equal-size groups; each group has its center.
    comm_dtype: optional floating dtype used on the wire.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`AGNState`. ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.diloco(optax.sgd(1.0), "batch", sync_period=1)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.pmap(step, axis_name="batch")
    >>> params = jnp.zeros(8)
    >>> state = jax.pmap(tx.init)(params)
    >>> params, state = step(params, state, -jnp.arange(8.0))
    >>> # outer gradient 0 - 3.5; Nesterov: 0.7 * (3.5 + 0.9 * 3.5) = 4.655
    >>> np.round(np.asarray(state.center), 4)
    array([4.655, 4.655, 4.655, 4.655, 4.655, 4.655, 4.655, 4.655], dtype=float32)

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023.
  """
  name = "shardopt.diloco"
  _check_axis_name(axis_name, name)
  period = _check_period(sync_period, "sync_period", name)
  _check_outer_args(name, outer_learning_rate, outer_momentum, nesterov)
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum or None,
                    nesterov=bool(nesterov))
  return _periodic(name, optimizer, outer, axis_name, period=period,
                   contribution=_PARAMS, reduction="mean",
                   axis_index_groups=axis_index_groups, comm_dtype=comm_dtype)
