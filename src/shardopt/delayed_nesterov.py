"""Delayed Nesterov: an outer optimizer for contributions that arrive one
at a time.

``shardopt.delayed_nesterov`` is the outer optimizer of asynchronous
Local-SGD (Liu et al., "Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135, its "Delayed Nesterov" (DN) update, with the
momentum activation ``c = 0``). A coordinator that moves the center each
time one island's pseudo-gradient arrives (``Island(asynchronous=True)``)
would, with DiLoCo's Nesterov step, push the momentum once per island and
round instead of once per round: stale directions compound. DN applies each
arriving outer gradient ``g_t`` at once, without momentum, and folds the
buffered gradients into the momentum only every ``momentum_period``-th update::

    b   <- b + g_t
    if t % N == 0:   m <- beta m + b / N
                     update = -lr (g_t / N + beta m),   b <- 0
    else:            update = -lr g_t / N

(``t`` counts updates from 1, ``N = momentum_period``). Over ``N`` updates the center
moves by ``-lr (mean(g) + beta m_new)``: exactly one step of
``optax.sgd(lr, momentum=beta, nesterov=True)`` on the mean of the ``N``
outer gradients, while every island still receives a center that moved with
its own contribution. ``momentum_period = 1`` is ``optax.sgd(lr, beta, nesterov=True)``.
Set ``momentum_period`` to the number of islands, so that one momentum update sees
about one contribution from each.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["DelayedNesterovState", "delayed_nesterov"]

_NAME = "shardopt.delayed_nesterov"


class DelayedNesterovState(NamedTuple):
  """State of :func:`delayed_nesterov`.

  Attributes:
    count: int32 scalar, the updates taken (``t``).
    buffer: a pytree like the params, the outer gradients since the last
      momentum update (``b``).
    momentum: a pytree like the params, ``m``.
  """

  count: jax.Array
  buffer: Any
  momentum: Any


def _check(value, arg: str, low: float, high: float, example: str) -> float:
  if (
    isinstance(value, bool)
    or not isinstance(value, numbers.Real)
    or not low <= value < high
  ):
    raise ValueError(
      f"{_NAME}: {arg}={value!r} must be a number in [{low}, {high});"
      f" e.g. {example}."
    )
  return float(value)


def delayed_nesterov(
  learning_rate: float = 0.7,
  momentum: float = 0.9,
  momentum_period: int = 4,
) -> optax.GradientTransformation:
  """Delayed Nesterov momentum, for outer steps that see one island each.

  Args:
    learning_rate: the outer learning rate ``lr`` (DiLoCo's 0.7).
    momentum: ``beta`` in ``[0, 1)`` (DiLoCo's 0.9).
    momentum_period: ``N >= 1``, updates per momentum update; the number of islands.

  Returns:
    An ``optax.GradientTransformation`` (state :class:`DelayedNesterovState`);
    pass it as ``shardopt.diloco(..., outer_optimizer=...)``.

  Example:
    >>> import jax.numpy as jnp, optax, shardopt
    >>> dn = shardopt.delayed_nesterov(learning_rate=1.0, momentum=0.5,
    ...                                momentum_period=2)
    >>> state = dn.init(jnp.zeros(1))
    >>> u1, state = dn.update(jnp.array([2.0]), state)   # -g/N
    >>> u2, state = dn.update(jnp.array([4.0]), state)   # -(g/N + beta m)
    >>> print(u1 + u2)   # one Nesterov step on the mean 3: -(3 + 0.5 * 3)
    [-4.5]

  References:
    Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato,
    "Asynchronous Local-SGD Training for Language Modeling", 2024
    (arXiv 2401.09135): the Delayed Nesterov update, with ``c = 0``.
  """
  lr = _check(learning_rate, "learning_rate", 0.0, float("inf"), "0.7")
  if lr <= 0:
    raise ValueError(
      f"{_NAME}: learning_rate={learning_rate!r} must be > 0; e.g. 0.7."
    )
  beta = _check(momentum, "momentum", 0.0, 1.0, "0.9")
  if isinstance(momentum_period, bool) or not isinstance(
    momentum_period, numbers.Integral
  ):
    raise TypeError(
      f"{_NAME}: momentum_period={momentum_period!r} must be an int >= 1, the number of"
      " islands; e.g. 4."
    )
  if momentum_period < 1:
    raise ValueError(
      f"{_NAME}: momentum_period={momentum_period} must be >= 1, the number of islands; e.g. 4."
    )
  n = int(momentum_period)

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DelayedNesterovState(
      count=jnp.zeros([], jnp.int32), buffer=zeros, momentum=zeros
    )

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    milestone = count % n == 0
    buffer = jax.tree.map(jnp.add, state.buffer, updates)
    new_momentum = jax.tree.map(
      lambda m, b: jnp.where(milestone, beta * m + b / n, m),
      state.momentum,
      buffer,
    )
    out = jax.tree.map(
      lambda g, m: -lr * (g / n + jnp.where(milestone, beta * m, 0.0)),
      updates,
      new_momentum,
    )
    buffer = jax.tree.map(
      lambda b: jnp.where(milestone, jnp.zeros_like(b), b), buffer
    )
    return out, DelayedNesterovState(count, buffer, new_momentum)

  return optax.GradientTransformation(init_fn, update_fn)
