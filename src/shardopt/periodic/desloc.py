"""DES-LOC: Local Adam whose params and moments average on periods of their
own (Iacob et al., arXiv 2505.22549).

The examples assume 8 devices (for instance a CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from shardopt.periodic import checks
from shardopt.periodic import contributions
from shardopt.periodic import engine
from shardopt.periodic import outer
from shardopt.periodic import schedules

_NAME = "shardopt.desloc"


def _check_state_periods(value: Any, sync_period: int) -> dict:
  if value is None:  # the paper's rule: K_u = 3 K_x, K_v = 6 K_x
    return {"mu": 3 * sync_period, "nu": 6 * sync_period}
  if (
    not isinstance(value, Mapping)
    or not value
    or not all(isinstance(k, str) and k != "params" for k in value)
  ):
    raise ValueError(
      f"{_NAME}: state_sync_periods={value!r} must be a non-empty dict from"
      " a field of the inner optimizer's state to its period, e.g."
      f" {{'mu': {3 * sync_period}, 'nu': {6 * sync_period}}} (the paper's"
      " K_u = 3 K_x, K_v = 6 K_x), or None for that default."
    )
  return {
    k: checks.check_period(v, f"state_sync_periods[{k!r}]", _NAME)
    for k, v in value.items()
  }


def desloc(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  sync_period: int = 16,
  state_sync_periods: dict | None = None,
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
  warmup_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """DES-LOC: local Adam, the params and each moment averaged on its own period.

  Every replica runs ``inner`` (Adam or AdamW) on its own params. After
  local step ``t`` (``t = 1, 2, ...``) the replicas average, over
  ``axis_name`` (within each group of ``axis_index_groups``): the params if
  ``t % sync_period == 0`` (``K_x``), and each state field ``name`` of
  ``state_sync_periods`` (``"mu"``, ``"nu"``: Adam's first and second
  moments, ``K_u``, ``K_v``) if ``t % state_sync_periods[name] == 0``. This
  is the paper's Algorithm 1 (eq. 1-3: ``u_{t-1}``, ``v_{t-1}`` averaged
  when ``t mod K_u = 0``, ``t mod K_v = 0``, the params ``x_t`` when ``t
  mod K_x = 0``, with ``t`` the steps done), run at the end of the step
  that completes ``t`` steps rather than at the start of the next: the same
  averages, with one difference: the next step's gradient is then taken at
  the averaged params, where the paper's step takes it at each replica's
  own params before averaging them. The paper's coordinate-wise clip
  (``optax.clip(rho)`` first in ``inner``) is not applied here. Both are in
  docs/desloc.md, "Against the paper". ``sync_period`` alone with
  ``state_sync_periods`` equal to it is Local Adam (every state averaged
  with the params).

  Whatever fires after a step averages in one collective round, inside one
  ``lax.cond``: the schedule has one sync per set of parts that fire
  together (``desloc`` in ``src/shardopt/periodic/schedules.py``), numbered as
  ``shardopt.due(tx, t)`` returns them, so ``tx.update(..., sync=due(tx,
  t))`` works as for :func:`local_sgd`. A step with a moment sync and no
  params sync all-reduces that moment alone and leaves the params and
  ``state.center`` as they are. The params average as :func:`local_sgd`'s
  do (``state.center``, ``center - mean(center - params)``); the moments
  are averaged directly (``mean(v)``), in the inner state's dtype. Adam's
  step count is not averaged (it is the same on every replica).

  The moments are found by name in ``inner``'s state: the leaves under a
  named-tuple field ``"mu"`` (``optax.scale_by_adam``'s
  ``ScaleByAdamState.mu``, inside ``optax.adam``, ``optax.adamw`` and
  chains of them). An inner optimizer whose state has no such field raises
  a ``ValueError`` at ``init`` naming the fields it has.

  Args:
    inner: the local optimizer, Adam-family (``optax.adamw(...)``).
    axis_name: the ``pmap``/mesh axis name (or tuple) of the replicas.
    sync_period: ``K_x``, local steps between two params averages; an
      integer >= 1. The paper's runs use 16 to 256 (16 here is not a
      default of the paper's).
    state_sync_periods: ``{field: period}`` for the state fields averaged
      on their own periods; None (the default) is the paper's recommendation
      ``{"mu": 3 * sync_period, "nu": 6 * sync_period}`` (periods grow with
      the moments' half-lives, ``ln 0.5 / ln beta``: 6.6 steps for beta1 =
      0.9, 693 for beta2 = 0.999). A field left out is never averaged
      (kept local, as DiLoCo keeps its inner state).
    axis_index_groups: optional equal-size groups; each averages alone.
    comm_dtype: optional wire dtype of every average, floating or quantized
      (see :func:`agn`); the moments travel on it too.
    error_feedback: not supported (the moments have no error buffers);
      True raises a ``ValueError``.
    warmup_steps: steps of synchronous training (the mean gradient) before
      the local steps start; see :func:`agn`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`PeriodicState` (``local_state`` holds each replica's moments).
    ``update`` needs ``params``.

  Example:
    Params every 2 steps, ``mu`` every 3, ``nu`` every 6: sync 1 is the
    params, 2 the first moment alone, 3 everything (step 6)::

      >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
      >>> tx = shardopt.desloc(optax.adam(0.1), "batch", sync_period=2,
      ...                      state_sync_periods={"mu": 3, "nu": 6})
      >>> [shardopt.due(tx, t) for t in range(1, 7)]
      [0, 1, 2, 1, 0, 3]
      >>> def step(params, state, grads):
      ...   updates, state = tx.update(grads, state, params)
      ...   return optax.apply_updates(params, updates), state
      >>> step = jax.pmap(step, axis_name="batch")
      >>> params = jnp.zeros(8)
      >>> state = jax.pmap(tx.init)(params)
      >>> grads = jnp.arange(8.0) - 3.5
      >>> for _ in range(3):
      ...   params, state = step(params, state, grads)
      >>> mu = state.local_state[0].mu
      >>> bool(np.all(mu == mu[0]))  # averaged after step 3
      True
      >>> bool(np.all(params == params[0]))  # not since step 2
      False

  References:
    Iacob et al., `DES-LOC: Desynced Low Communication Adaptive Optimizers
    for Training Foundation Models <https://arxiv.org/abs/2505.22549>`_,
    ICLR 2026 (Algorithm 1).
  """
  checks.check_axis_name(axis_name, _NAME)
  period = checks.check_period(sync_period, "sync_period", _NAME)
  states = _check_state_periods(state_sync_periods, period)
  if error_feedback:
    raise ValueError(
      f"{_NAME}: error_feedback={error_feedback!r} is not supported: DES-LOC"
      " averages the moments on the same wire, and they have no error"
      " buffers. Leave error_feedback=False (a quantized comm_dtype still"
      " works, without feedback), or use shardopt.local_sgd for params"
      " averaging with error feedback."
    )
  return engine.periodic(
    _NAME,
    inner,
    axis_name,
    syncs=schedules.desloc({"params": period, **states}),
    contribution=contributions.PseudoGradients(),
    outer_step=outer.mean(),
    axis_index_groups=axis_index_groups,
    comm_dtype=comm_dtype,
    warmup_steps=checks.check_warmup_steps(warmup_steps, _NAME),
  )
