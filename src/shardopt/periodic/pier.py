"""Pier's outer schedules for ``diloco`` (Fan and Zhang, arXiv 2511.17849):
momentum decay and the outer learning rate's warm-up and decay.

Read from the authors' code (github.com/zetsunozomi/Pier-LLM-Pretraining,
``megatron/training/training.py``, the ``pytorch_nesterov`` outer step and
its "lazy start"; the paper's method section could not be read here, see
``docs/pier.md``). Over a run of ``T`` inner steps with a sync every ``H``:

- **momentum warm-up** ("lazy start", "Momentum Produce"): the first 10% of
  the steps are synchronous data-parallel training (the gradient averaged
  every step) while the outer momentum buffer accumulates the
  pseudo-gradients of that synchronous trajectory, every ``H`` steps,
  ``m <- 0.9 m + (theta_ref - theta)``, ``theta_ref <- theta`` (no outer
  step is applied);
- then DiLoCo with the Nesterov outer step ``m <- mu_k m + Delta``,
  ``center <- center - lr_k (Delta + mu_k m)``, whose **momentum decays**
  (:func:`pier_momentum`, 0.99 to 0.9 on a cosine over the DiLoCo phase)
  and whose **learning rate** warms up from 0 to 1.1 and then decays to 0.9
  (:func:`pier_learning_rate`).

:func:`pier` is the whole method, a ``diloco``; the two schedules are its
parts, for ``diloco``'s ``outer_momentum=`` and ``outer_learning_rate=``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _args
from shardopt import _axes
from shardopt.collectives import reduce_for
from shardopt.periodic.transforms import diloco


def _outer_steps(value: Any, name: str) -> int:
  if not _args.is_integer(value) or value < 1:
    raise ValueError(
      f"{name}: total_outer_steps={value!r} must be an integer >= 1, the"
      " outer steps of the DiLoCo phase ((steps - warmup_steps) //"
      " sync_period)."
    )
  return int(value)


def _number(value: Any, arg: str, name: str, low: float, high: float) -> float:
  if (
    isinstance(value, (bool, np.bool_))
    or not isinstance(value, (int, float, np.number))
    or not low <= value < high
  ):
    raise ValueError(
      f"{name}: {arg}={value!r} must be a number in [{low:g}, {high:g}); e.g."
      f" the authors' {arg}={_EXAMPLES[arg]}."
    )
  return float(value)


_EXAMPLES = {
  "start": 0.99,
  "end": 0.9,
  "peak": 1.1,
  "final": 0.9,
  "warmup_momentum": 0.9,
}


def _cosine(frac, high: float, low: float):
  """From ``high`` at ``frac = 0`` to ``low`` at ``frac >= 1``."""
  frac = jnp.clip(frac, 0.0, 1.0)
  return low + 0.5 * (high - low) * (1.0 + jnp.cos(jnp.float32(math.pi) * frac))


def pier_momentum(
  total_outer_steps: int, *, start: float = 0.99, end: float = 0.9
):
  """Pier's momentum decay: the outer momentum from ``start`` to ``end`` on
  a cosine over the DiLoCo phase.

  A schedule of the outer step ``k`` (``k = 0`` at the first sync), to pass
  as ``shardopt.diloco(..., outer_momentum=pier_momentum(K))`` with ``K``
  the DiLoCo phase's outer steps (``(steps - warmup_steps) //
  sync_period``)::

    mu(k) = end + (start - end) (1 + cos(pi min((k + 1) / K, 1))) / 2

  The authors' code evaluates its cosine at the inner step of the sync,
  ``t = (step - W) / (T - W)`` with ``W`` the synchronous steps and ``T``
  the run's; at sync ``k`` of the DiLoCo phase that is ``(k + 1) / K``, so
  the first sync already uses a hair under ``start`` and the last ``end``.

  Args:
    total_outer_steps: ``K``, an integer >= 1.
    start: the momentum at the start of the DiLoCo phase, in ``[0, 1)``
      (the authors': 0.99).
    end: the momentum at its end, in ``[0, 1)`` (the authors': 0.9).

  Returns:
    A function of the outer step count (an int or a scalar array) returning
    the momentum (float32).

  Example:
    >>> import numpy as np, shardopt
    >>> schedule = shardopt.pier_momentum(4)
    >>> np.round([float(schedule(k)) for k in range(5)], 4).tolist()
    [0.9768, 0.945, 0.9132, 0.9, 0.9]
  """
  name = "shardopt.pier_momentum"
  total = _outer_steps(total_outer_steps, name)
  start = _number(start, "start", name, 0.0, 1.0)
  end = _number(end, "end", name, 0.0, 1.0)

  def schedule(count):
    k = jnp.asarray(count, jnp.float32)
    return _cosine((k + 1.0) / total, start, end).astype(jnp.float32)

  return schedule


def pier_learning_rate(
  total_outer_steps: int,
  *,
  peak: float = 1.1,
  final: float = 0.9,
  warmup_outer_steps: int | None = None,
):
  """Pier's outer learning rate: a linear warm-up from 0 to ``peak``, then a
  cosine from ``peak`` to ``final`` over the rest of the DiLoCo phase.

  A schedule of the outer step ``k`` (``k = 0`` at the first sync), to pass
  as ``shardopt.diloco(..., outer_learning_rate=pier_learning_rate(K))``
  with ``K`` the DiLoCo phase's outer steps. With ``J`` the warm-up's outer
  steps::

    lr(k) = peak (k + 1) / J                                   k + 1 < J
          = final + (peak - final) (1 + cos(pi (k + 1 - J) / (K - J))) / 2

  The authors warm up over 10% of the run's steps after a synchronous
  first 10%: ``J = K / 9`` outer steps, the default (rounded, at least 1).

  Args:
    total_outer_steps: ``K``, an integer >= 1.
    peak: the rate after the warm-up (the authors': 1.1), > 0.
    final: the rate at the end (the authors': 0.9), >= 0.
    warmup_outer_steps: ``J``, an integer in ``[1, K]``; default
      ``max(1, round(K / 9))``.

  Returns:
    A function of the outer step count returning the rate (float32).

  Example:
    >>> import numpy as np, shardopt
    >>> schedule = shardopt.pier_learning_rate(9)  # J = 1
    >>> np.round([float(schedule(k)) for k in range(9)], 4).tolist()
    [1.1, 1.0924, 1.0707, 1.0383, 1.0, 0.9617, 0.9293, 0.9076, 0.9]
  """
  name = "shardopt.pier_learning_rate"
  total = _outer_steps(total_outer_steps, name)
  peak = _number(peak, "peak", name, 0.0, math.inf)
  final = _number(final, "final", name, 0.0, math.inf)
  if peak <= 0:
    raise ValueError(f"{name}: peak={peak!r} must be > 0; e.g. 1.1.")
  if warmup_outer_steps is None:
    warm = max(1, round(total / 9))
  elif (
    not _args.is_integer(warmup_outer_steps)
    or not 1 <= warmup_outer_steps <= total
  ):
    raise ValueError(
      f"{name}: warmup_outer_steps={warmup_outer_steps!r} must be an integer"
      f" in [1, total_outer_steps={total}]; e.g. {max(1, round(total / 9))}"
      " (the authors' 10% of the run after a synchronous 10%)."
    )
  else:
    warm = int(warmup_outer_steps)
  rest = max(total - warm, 1)

  def schedule(count):
    n = jnp.asarray(count, jnp.float32) + 1.0
    up = peak * n / warm
    down = _cosine((n - warm) / rest, peak, final)
    return jnp.where(n < warm, up, down).astype(jnp.float32)

  return schedule


class PierOuterState(NamedTuple):
  """State of Pier's outer step (``state.global_state`` of :func:`pier`).

  Attributes:
    count: int32 scalar, the outer steps taken (syncs).
    momentum: a pytree like the center, the outer momentum buffer ``m``.
  """

  count: jax.Array
  momentum: Any


def _outer(warm: int, total: int, warmup_momentum: float, mu, lr):
  """Pier's outer step: ``warm`` syncs of accumulation (``m <- mu_w m +
  Delta``, the center moved onto the params: update ``-Delta``), then the
  Nesterov step ``m <- mu_j m + Delta``, update ``-lr_j (Delta + mu_j m)``
  with ``j`` the DiLoCo phase's outer step."""

  def init_fn(params):
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    return PierOuterState(jnp.zeros((), jnp.int32), zeros)

  def update_fn(updates, state, params=None):
    del params
    k = state.count
    j = k - warm
    synchronous = k < warm
    m_k = jnp.where(synchronous, jnp.float32(warmup_momentum), mu(j))
    l_k = lr(j)

    def one(delta, m):
      d = delta.astype(jnp.float32)
      m = m_k * m + d
      step = jnp.where(synchronous, -d, -l_k * (d + m_k * m))
      return step.astype(delta.dtype), m

    out = jax.tree.map(one, updates, state.momentum)
    treedef = jax.tree.structure(updates)
    leaves = treedef.flatten_up_to(out)
    new_updates = treedef.unflatten([u for u, _ in leaves])
    momentum = treedef.unflatten([m for _, m in leaves])
    return new_updates, PierOuterState(k + 1, momentum)

  del total
  return optax.GradientTransformation(init_fn, update_fn)


def _synchronous_for(steps: int, axis_name, axis_index_groups):
  """The mean gradient over the axis for the first ``steps`` local steps
  (synchronous data parallel), then each replica's own."""

  def init_fn(params):
    del params
    return jnp.zeros((), jnp.int32)

  def update_fn(updates, count, params=None):
    del params
    reduced = _axes.cond_same_types(
      count < steps,
      lambda: reduce_for(
        "shardopt.pier",
        updates,
        axis_name,
        reduction="mean",
        axis_index_groups=axis_index_groups,
      ),
      lambda: updates,
      transform="shardopt.pier",
    )
    return reduced, count + 1

  return optax.GradientTransformation(init_fn, update_fn)


def pier(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  total_steps: int,
  sync_period: int = 50,
  warmup_fraction: float = 0.1,
  warmup_momentum: float = 0.9,
  start: float = 0.99,
  end: float = 0.9,
  peak: float = 1.1,
  final: float = 0.9,
  lr_warmup_fraction: float = 0.1,
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Pier (Fan and Zhang, arXiv 2511.17849), as the authors' code runs it.

  A :func:`shardopt.diloco` of ``total_steps`` steps, ``K_all =
  total_steps // sync_period`` syncs, in two phases:

  1. **Momentum warm-up**, the first ``K_w = round(warmup_fraction *
     K_all)`` syncs (``W = K_w * sync_period`` steps): synchronous data
     parallel (``inner`` gets the mean gradient over the axis every step, so
     the replicas stay identical), and at each sync the outer momentum
     accumulates the synchronous trajectory's outer gradient, ``m <-
     warmup_momentum * m + Delta``, while the center simply moves onto the
     params (no outer step).
  2. DiLoCo's local steps, and at its sync ``j = 0, 1, ...`` (of ``K =
     K_all - K_w``) the Nesterov outer step ``m <- mu_j m + Delta``,
     ``center <- center - lr_j (Delta + mu_j m)``, with ``mu_j`` from
     :func:`pier_momentum` (``start`` to ``end``: **momentum decay**) and
     ``lr_j`` from :func:`pier_learning_rate` (0 to ``peak`` over
     ``J = max(1, round(lr_warmup_fraction * K_all))`` syncs, then to
     ``final``).

  The defaults are the authors' (``megatron/training/training.py`` of
  github.com/zetsunozomi/Pier-LLM-Pretraining: a 10% lazy start with
  momentum 0.9, then momentum 0.99 to 0.9 and outer rate 0 to 1.1 to 0.9;
  ``sync_period=50`` as in their launch scripts); ``docs/pier.md`` says
  what was read where.

  Args:
    inner: the local optimizer (AdamW in the paper).
    axis_name: the replicas' axis.
    total_steps: the run's steps ``T``; ``T // sync_period`` must exceed
      the warm-up's syncs.
    sync_period: ``H``.
    warmup_fraction: the synchronous phase's share of the syncs, in [0, 1).
    warmup_momentum: the momentum of the warm-up's accumulation, in [0, 1).
    start, end: the momentum decay's ends (:func:`pier_momentum`).
    peak, final: the outer rate's peak and end (:func:`pier_learning_rate`).
    lr_warmup_fraction: the outer rate's warm-up, a share of ``K_all``.
    axis_index_groups, comm_dtype, error_feedback: as :func:`diloco`'s
      (``comm_dtype`` is the outer gradient's wire; the synchronous phase
      averages the gradients in their own dtype).

  Returns:
    ``shardopt.diloco``'s transform (``state.global_state`` is a
    :class:`PierOuterState`).

  Example:
    >>> import jax, jax.numpy as jnp, optax, shardopt
    >>> tx = shardopt.pier(optax.sgd(0.1), "batch", total_steps=40,
    ...                    sync_period=2)  # 20 syncs: 2 synchronous
    >>> state = jax.pmap(tx.init)(jnp.zeros((8, 3)))
    >>> int(state.global_state.count[0])
    0
  """
  name = "shardopt.pier"
  period = sync_period
  if not _args.is_integer(period) or period < 1:
    raise ValueError(
      f"{name}: sync_period={period!r} must be an integer >= 1; e.g. 50"
      " (the authors' launch scripts)."
    )
  if not _args.is_integer(total_steps) or total_steps < 1:
    raise ValueError(
      f"{name}: total_steps={total_steps!r} must be an integer >= 1, the"
      " run's steps."
    )
  for arg, value in (
    ("warmup_fraction", warmup_fraction),
    ("lr_warmup_fraction", lr_warmup_fraction),
  ):
    if (
      isinstance(value, (bool, np.bool_))
      or not isinstance(value, (int, float, np.number))
      or not 0 <= value < 1
    ):
      raise ValueError(
        f"{name}: {arg}={value!r} must be a number in [0, 1), a share of the"
        " run's syncs; e.g. 0.1 (the authors')."
      )
  warmup_momentum = _number(warmup_momentum, "warmup_momentum", name, 0.0, 1.0)
  syncs = int(total_steps) // int(period)
  warm = round(float(warmup_fraction) * syncs)
  total = syncs - warm
  if total < 1:
    raise ValueError(
      f"{name}: total_steps={total_steps} with sync_period={period} makes"
      f" {syncs} syncs, {warm} of them synchronous: no DiLoCo phase left;"
      " train longer or lower warmup_fraction."
    )
  lr_warm = min(max(1, round(float(lr_warmup_fraction) * syncs)), total)
  mu = pier_momentum(total, start=start, end=end)
  lr = pier_learning_rate(
    total, peak=peak, final=final, warmup_outer_steps=lr_warm
  )
  local = (
    optax.chain(
      _synchronous_for(warm * int(period), axis_name, axis_index_groups),
      inner,
    )
    if warm
    else inner
  )
  return diloco(
    local,
    axis_name,
    sync_period=period,
    outer_optimizer=_outer(warm, total, warmup_momentum, mu, lr),
    axis_index_groups=axis_index_groups,
    comm_dtype=comm_dtype,
    error_feedback=error_feedback,
  )
