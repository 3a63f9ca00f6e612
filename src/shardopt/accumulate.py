"""Gradient accumulation that communicates once per period: ``accumulate``.

``optax.MultiSteps(inner, k)`` runs ``inner.update`` on every mini-step and
masks the result, so a ``cross_shard`` inside it all-reduces ``k`` times per
update. :func:`accumulate` computes the same numbers but runs ``inner.update``
only in the emit branch of one ``jax.lax.cond`` whose predicate is the
replicated mini-step counter: ``k - 1`` of ``k`` mini-steps add the gradient
to a local accumulator and communicate nothing. This is PyTorch DDP's
``no_sync()`` and Horovod's ``backward_passes_per_step``.

The examples below assume 8 devices, e.g. a CPU forced to show them with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from shardopt import _args
from shardopt import _axes
from shardopt import _host_schedule

_ACCUMULATE = "shardopt.accumulate"


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  Attributes:
    mini_step: int32 scalar, gradients accumulated since the last update
      (``0 .. every_k_steps - 1``); the same on every replica.
    gradient_step: int32 scalar, updates of ``inner`` so far (optax's
      ``MultiStepsState.gradient_step``).
    acc_grads: the running mean (``use_grad_mean=True``) or sum of this
      replica's gradients in the current period, float32 for bfloat16/float16
      params. After an update it still holds what ``inner`` was fed
      (``optax.MultiSteps`` zeroes it); ``mini_step == 0`` tells the next
      mini-step to start from zero, which saves a pass over it.
    inner_state: ``inner``'s state.
  """

  mini_step: chex.Array
  gradient_step: chex.Array
  acc_grads: Any
  inner_state: Any


def _check_every_k_steps(every_k_steps: Any) -> Callable[[jax.Array], Any]:
  """``every_k_steps`` as a schedule: a function of the gradient step."""
  if callable(every_k_steps):
    return every_k_steps
  if not _args.is_integer(every_k_steps) or int(every_k_steps) < 1:
    raise ValueError(
      f"{_ACCUMULATE}: every_k_steps={every_k_steps!r} must be a positive"
      " integer, the number of mini-steps whose gradients make one update"
      " (e.g. 4; 1 updates on every step), or a callable of the gradient"
      " step that returns one (optax.MultiSteps' every_k_schedule, e.g."
      " lambda step: jnp.where(step < 100, 1, 4))."
    )
  k = int(every_k_steps)
  return lambda gradient_step: k


def _mini_steps_per_update(schedule, gradient_step: jax.Array) -> jax.Array:
  """``schedule(gradient_step)`` as an int32 scalar, at least 1.

  The gradient step is the same on every replica, so the number is too (for
  a schedule that depends on nothing else): the emit decision needs no
  collective. A value below 1 (which ``optax.MultiSteps`` leaves undefined: it
  takes ``mini_step % 0``) updates on every mini-step.
  """
  k = schedule(gradient_step)
  try:
    dtype = jnp.result_type(k)
  except TypeError:  # not an array, e.g. a string or None
    dtype = None
  if (
    dtype is None
    or not jnp.issubdtype(dtype, jnp.integer)  # bool is not an integer here
    or jnp.ndim(k) != 0
  ):
    raise TypeError(
      f"{_ACCUMULATE}: every_k_steps={schedule!r} returned {k!r} for the"
      " gradient step; a schedule must return an integer scalar, the number"
      " of mini-steps of that update (e.g. lambda step: jnp.where(step < 100,"
      " 1, 4), or cast a float schedule with .astype(jnp.int32))."
    )
  return jnp.maximum(jnp.asarray(k, jnp.int32), 1)


def _accumulated(
  grads: Any, acc_grads: Any, mini_step: jax.Array, use_grad_mean: bool
) -> Any:
  """The accumulator after this mini-step's gradients (optax's arithmetic).

  The mean is Welford's running mean, ``acc + (g - acc) / (n + 1)`` with
  ``n = mini_step`` gradients already in ``acc``, exactly as
  ``optax.MultiSteps`` computes it, so both give the same bits. At
  ``mini_step == 0`` the accumulator starts from zero whatever it holds (the
  previous period's value is never read), so an update needs no separate
  pass to reset it.
  """
  fresh = mini_step == 0

  def add(g, acc):
    acc = jnp.where(fresh, jnp.zeros_like(acc), acc)
    if use_grad_mean:
      return (acc + (g - acc) / (mini_step + 1)).astype(acc.dtype)
    return (acc + g).astype(acc.dtype)

  return jax.tree.map(add, grads, acc_grads)


class _HostSchedule:
  """``accumulate``'s host schedule (``shardopt.due``): 0 on a mini-step,
  1 + the inner's value on an emit step."""

  name = _ACCUMULATE

  def __init__(self, every_k_steps: int | None, inner):
    self.every_k_steps = every_k_steps
    self.inner = _host_schedule.scheduled_in(inner)

  def programs(self) -> str:
    if self.inner:
      return f"0 (a mini-step), 1 + the inner {self.inner[0].name}'s value"
    return "0 (a mini-step) or 1 (the update)"

  def _every(self) -> int:
    if self.every_k_steps is None:
      raise ValueError(
        f"{_ACCUMULATE}: a host schedule (shardopt.due, sync=) needs an"
        " integer every_k_steps; this one was built with a schedule of the"
        " gradient step, which the state decides. Pass an int, or leave"
        " sync= out (the in-graph schedule)."
      )
    return int(self.every_k_steps)

  def due(self, t: int) -> int:
    every = self._every()
    if t % every:
      return 0
    if len(self.inner) > 1:
      raise ValueError(
        f"{_ACCUMULATE}: its inner transform holds {len(self.inner)}"
        " transforms with a schedule; one sync= cannot choose for both."
      )
    return 1 + (self.inner[0].due(t // every) if self.inner else 0)

  def check(self, sync: int) -> None:
    self._every()
    if sync < 0 or (sync > 1 and not self.inner):
      raise _host_schedule.bad_value(_ACCUMULATE, sync, self)


def _host_update(host, sync, state, emit, acc_grads, emit_branch, mini_branch):
  """The step the host chose (``sync``, from ``shardopt.due``): the emit
  branch or the mini-step alone, no ``lax.cond``; the emit decision the
  counters make is checked against it (``shardopt._host_schedule``)."""
  host.check(sync)
  emits = sync >= 1
  ok = _host_schedule.check(
    int(emits),
    emit.astype(jnp.int32),
    state.gradient_step,
    name=_ACCUMULATE,
    t_hint=(
      f"t = {host.every_k_steps} * state.gradient_step + state.mini_step + 1"
    ),
    communicates=emits,
  )
  if emits:
    # The emit branch in its cond on the counters' own decision, as the
    # in-graph schedule runs it: the same fusions, so the same bits (XLA
    # contracts multiply-adds per fusion), and the check has raised if the
    # decision disagrees with the host's.
    inner_sync = sync - 1 if host.inner else None
    updates, inner_state = _axes.cond_same_types(
      emit,
      lambda: emit_branch(inner_sync),
      mini_branch,
      transform=_ACCUMULATE,
    )
    mini_step = jnp.zeros_like(state.mini_step)
    gradient_step = optax.safe_increment(state.gradient_step)
  else:
    updates, inner_state = mini_branch()
    mini_step = state.mini_step + 1
    gradient_step = state.gradient_step
  if not emits or not _host_schedule.can_raise():
    updates = _host_schedule.poison(ok, updates)
  return updates, AccumulateState(
    mini_step=mini_step.astype(jnp.int32),
    gradient_step=_host_schedule.mark(ok, gradient_step.astype(jnp.int32)),
    acc_grads=acc_grads,
    inner_state=inner_state,
  )


def accumulate(
  inner: optax.GradientTransformation,
  every_k_steps: int | Callable[[jax.Array], Any],
  *,
  use_grad_mean: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients over ``every_k_steps`` mini-steps, updates once.

  The same numbers as ``optax.MultiSteps(inner, every_k_steps,
  use_grad_mean=use_grad_mean).gradient_transformation()``, with ``k =
  every_k_steps``, or ``k = every_k_steps(gradient_step)`` for a schedule
  (MultiSteps' ``every_k_schedule``):

  1. every mini-step adds the gradients to ``acc_grads`` (Welford's running
     mean, or the sum with ``use_grad_mean=False``; float32 for bfloat16 and
     float16 params) and counts ``mini_step``;
  2. mini-steps ``1 .. k - 1`` return zero updates and leave ``inner_state``
     as it is;
  3. the ``k``-th feeds the accumulated gradients (cast to the gradients'
     dtype) to ``inner.update``, returns its updates, keeps its new state in
     the old state's dtypes (as MultiSteps does: adam's ``mu_dtype=None``
     moments of float16 params fed float32 gradients stay float16), sets
     ``mini_step`` to zero (the next mini-step restarts ``acc_grads`` from
     zero) and counts ``gradient_step``.

  Unlike ``optax.MultiSteps``, which runs ``inner.update`` on every mini-step
  and masks the result, ``inner.update`` runs only in the emit branch of one
  ``jax.lax.cond`` whose predicate is the mini-step counter, the same on every
  replica by construction. Every collective of ``inner`` (``cross_shard``,
  ``tower``, ``clip_by_global_norm(max_norm, axis)``) therefore runs once per
  ``k`` mini-steps: the compiled ``tx.update`` has no collective outside the
  branch. The zero updates of a mini-step carry the emit branch's types, so
  under a checking ``jax.shard_map`` updates that ``inner`` types invariant
  stay invariant and replicated ``P()`` params stay ``P()``.

  One limit no optimizer can lift: with replicated ``P()`` params inside a
  checking ``shard_map``, ``jax.grad`` itself all-reduces the gradient in the
  backward pass on *every* mini-step (autodiff's ``psum``, outside the
  optimizer). To communicate once per ``k`` there, cast the params to varying
  before ``jax.grad`` (``jax.lax.pcast(params, axis, to="varying")``), so each
  replica keeps its local gradient until ``inner`` reduces it. Under ``pmap``
  the gradient is local already.

  The counters may arrive typed varying (the whole state under ``P(axis)``
  under ``shard_map``) or stacked (``jax.pmap(tx.init)``): they are equal on
  every replica by construction, so either works. So is a schedule's ``k``,
  a function of ``gradient_step`` alone: the emit decision needs no
  collective.

  Gradients are not checked against the params' shapes here, unlike every
  other shardopt transform: as in ``optax.MultiSteps``, whose behaviour this
  keeps, ``acc_grads`` has the params' shapes and a gradient that broadcasts
  to them (shape ``(1,)`` for params of shape ``(4,)``) is broadcast into it.
  The transforms of ``inner`` then see params-shaped gradients.

  To skip non-finite gradients (MultiSteps' ``should_skip_update_fn=
  optax.skip_not_finite``), guard ``inner``:
  ``accumulate(shardopt.apply_if_finite(inner, n, axis_name=axis), k)`` checks the
  accumulated gradients at the emit step, or wrap the whole transform,
  ``shardopt.apply_if_finite(accumulate(inner, k), n, axis_name=axis)``, to drop single
  mini-steps as MultiSteps does (``docs/reliability.md`` compares the two).

  Args:
    inner: the transform applied to the accumulated gradients, e.g.
      ``shardopt.cross_shard(optax.adam(1e-3), "batch")``.
    every_k_steps: mini-steps per update, a positive integer, or a function
      of the gradient step (an int32 scalar, the same on every replica) that
      returns it as an integer scalar, e.g. ``lambda step: jnp.where(step <
      1000, 1, 4)`` (values below 1 count as 1).
    use_grad_mean: average the accumulated gradients (default) or sum them.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`AccumulateState`.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.accumulate(shardopt.cross_shard(optax.sgd(1.0), "batch"), 2)
    >>> def two_steps(w, g):
    ...   state = tx.init(w)
    ...   first, state = tx.update(g, state, w)       # accumulates, no all-reduce
    ...   second, state = tx.update(2 * g, state, w)  # one all-reduce, one update
    ...   return first, second, state.gradient_step
    >>> first, second, steps = jax.pmap(two_steps, axis_name="batch")(
    ...     jnp.zeros(8), jnp.arange(8.0))
    >>> np.asarray(first)
    array([0., 0., 0., 0., 0., 0., 0., 0.], dtype=float32)
    >>> np.asarray(second)  # -(mean over replicas of (g + 2 g) / 2) = -1.5 * 3.5
    array([-5.25, -5.25, -5.25, -5.25, -5.25, -5.25, -5.25, -5.25], dtype=float32)
    >>> int(steps[0])
    1

    A schedule: one mini-step for the first update, then two.

    >>> tx = shardopt.accumulate(optax.sgd(1.0), lambda step: jnp.minimum(step + 1, 2))
    >>> state = tx.init(jnp.zeros(1))
    >>> for g in (1.0, 2.0, 4.0):
    ...   updates, state = tx.update(jnp.array([g]), state)
    ...   print(updates, int(state.gradient_step))
    [-1.] 1
    [0.] 1
    [-3.] 2

  References:
    ``optax.MultiSteps``; PyTorch, ``DistributedDataParallel.no_sync``;
    Sergeev and Del Balso, `Horovod: fast and easy distributed deep learning
    in TensorFlow <https://arxiv.org/abs/1802.05799>`_, 2018
    (``backward_passes_per_step``).
  """
  schedule = _check_every_k_steps(every_k_steps)
  _args.flag(
    use_grad_mean,
    "use_grad_mean",
    _ACCUMULATE,
    "True averages the accumulated gradients, False sums them",
  )
  _axes.check_transform(inner, _ACCUMULATE)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return AccumulateState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      acc_grads=jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), _axes.accumulation_dtype(p.dtype)),
        params,
      ),
      inner_state=inner.init(params),
    )

  host = _HostSchedule(
    every_k_steps if _args.is_integer(every_k_steps) else None, inner
  )

  def update_fn(grads, state, params=None, **extra_args):
    sync = _host_schedule.take_sync(extra_args, _ACCUMULATE, host)
    # No shardopt._shapes.check_like_params here: optax.MultiSteps broadcasts
    # a gradient into its params-shaped accumulator, and so does this (see
    # the docstring; tests/test_grads_match_params.py pins the parity).
    mini_step = _axes.scalar_counter(
      state.mini_step, _ACCUMULATE, "state.mini_step"
    )
    gradient_step = _axes.scalar_counter(
      state.gradient_step, _ACCUMULATE, "state.gradient_step"
    )
    # ``>=``, not ``==``: a period already past its length (a checkpoint
    # restored under a shorter schedule) emits now instead of never.
    emit = mini_step >= _mini_steps_per_update(schedule, gradient_step) - 1

    # Every mini-step: one pass that adds the gradients to the accumulator in
    # place (the first mini-step of a period starts from zero).
    acc_grads = _accumulated(grads, state.acc_grads, mini_step, use_grad_mean)

    def emit_branch(inner_sync=None):
      mean_or_sum = jax.tree.map(
        lambda a, g: a.astype(g.dtype), acc_grads, grads
      )
      more = {} if inner_sync is None else {"sync": inner_sync}
      updates, inner_state = inner.update(
        mean_or_sum, state.inner_state, params, **extra_args, **more
      )
      # As optax.MultiSteps: the new state in the old state's dtypes (adam's
      # mu_dtype=None promotes f16 moments fed f32 gradients to f32).
      return updates, optax.tree.cast_like(inner_state, state.inner_state)

    emit_types = jax.eval_shape(emit_branch)

    def mini_branch():
      zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), emit_types[0])
      return zeros, state.inner_state

    if sync is not None:
      return _host_update(
        host, sync, state, emit, acc_grads, emit_branch, mini_branch
      )

    # Both branches return the same types: the zeros take the emit branch's
    # varying axes (invariant where inner's updates are), each inner-state
    # leaf the union of both branches'.
    updates, inner_state = _axes.cond_same_types(
      emit,
      emit_branch,
      mini_branch,
      true_types=emit_types,
      transform=_ACCUMULATE,
    )
    return updates, AccumulateState(
      mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
      gradient_step=jnp.where(
        emit, optax.safe_increment(state.gradient_step), state.gradient_step
      ).astype(jnp.int32),
      acc_grads=acc_grads,
      inner_state=inner_state,
    )

  _host_schedule.attach(update_fn, host)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
