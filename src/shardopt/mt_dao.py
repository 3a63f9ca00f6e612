"""MT-DAO: an inner optimizer with slow and fast first momenta.

``shardopt.mt_dao`` is the local optimizer of MT-DAO (Iacob et al.,
"MT-DAO: Multi-timescale Distributed Adaptive Optimizers with Local
Updates", arXiv 2510.05361, ICLR 2026), the Adam form: each replica keeps
``N`` first momenta at their own timescales and one second moment, and its
step mixes the gradient with the momenta (the quasi-hyperbolic form of Ma
and Yarats, arXiv 1810.06801, with several momenta)::

    u_j <- beta_j u_j + (1 - beta_j) g          j = 1..N   (1)
    v   <- b2 v + (1 - b2) g^2                             (2)
    d   = ((1 - sum_j omega_j) g + sum_j omega_j u_j / (1 - beta_j^t))
          / (sqrt(v / (1 - b2^t)) + eps)                   (3)
    update = -learning_rate(t) (d + weight_decay p)        (4)

(``t`` counts this optimizer's updates from 1; ``bias_correction=False``
drops the ``1 - beta^t`` factors). ``N = 1`` with ``omega = 1`` is Adam;
``omega < 1`` keeps part of the raw gradient in every step (the fast
timescale) while a slow ``beta`` (0.99 to 0.999, half-lives of 69 to 693
steps) carries the direction across the long stretches between two
synchronizations of a low-communication method, which is the paper's
remedy for the "timescale mismatch" of Adam's ``beta1 = 0.9`` (half-life
6.6 steps) with sync periods of 16 to 256 steps.

It uses no collective. The paper's method averages the parameters *and*
the optimizer's states (the momenta and the second moment; every ``K =
K_x = K_1 = K_v`` steps in its experiments, as summaries of the paper
report it): ``shardopt.desloc(mt_dao(...), axis, sync_period=K,
state_sync_periods={"momenta": K, "nu": K})``. Inside
``shardopt.local_sgd`` or ``shardopt.diloco`` only the parameters are
averaged and every replica's momenta stay its own (docs/mt_dao.md).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _args

__all__ = ["MTDAOState", "mt_dao", "scale_by_mt_dao"]

_NAME = "shardopt.scale_by_mt_dao"


class MTDAOState(NamedTuple):
  """State of :func:`scale_by_mt_dao` (and :func:`mt_dao`).

  Attributes:
    count: int32 scalar, the updates taken (``t`` of the bias correction).
    momenta: a tuple of ``N`` pytrees like the params (float32), the first
      momenta ``u_j``, in the order of ``betas``.
    nu: a pytree like the params (float32), the second moment ``v``.
  """

  count: jax.Array
  momenta: tuple
  nu: Any


def _number(value) -> bool:
  return not isinstance(value, (bool, np.bool_)) and isinstance(
    value, (numbers.Real, np.floating, np.integer)
  )


def _check(betas, omegas, b2, eps, bias_correction) -> tuple:
  betas = tuple(betas) if isinstance(betas, (tuple, list)) else betas
  omegas = tuple(omegas) if isinstance(omegas, (tuple, list)) else omegas
  if (
    not isinstance(betas, tuple)
    or not betas
    or not all(_number(b) and 0.0 <= float(b) < 1.0 for b in betas)
  ):
    raise ValueError(
      f"{_NAME}: betas={betas!r} must be a non-empty tuple of numbers in"
      " [0, 1), one decay per first momentum; e.g. betas=(0.995,) (one slow"
      " momentum) or betas=(0.9, 0.999) (a fast and a slow one)."
    )
  if (
    not isinstance(omegas, tuple)
    or len(omegas) != len(betas)
    or not all(_number(w) and 0.0 <= float(w) <= 1.0 for w in omegas)
    or sum(float(w) for w in omegas) > 1.0 + 1e-12
  ):
    raise ValueError(
      f"{_NAME}: omegas={omegas!r} must be a tuple of {len(betas)} numbers"
      f" in [0, 1] (one weight per momentum of betas={betas!r}) summing to"
      " at most 1; the gradient's weight is 1 - sum(omegas). E.g."
      " omegas=(0.7,) with betas=(0.995,)."
    )
  if not _number(b2) or not 0.0 <= float(b2) < 1.0:
    raise ValueError(
      f"{_NAME}: b2={b2!r} must be a number in [0, 1), the second moment's"
      " decay; e.g. b2=0.999 (Adam's)."
    )
  if not _number(eps) or not float(eps) >= 0.0:
    raise ValueError(
      f"{_NAME}: eps={eps!r} must be a number >= 0 added to the root of the"
      " second moment; e.g. eps=1e-8 (Adam's)."
    )
  _args.flag(bias_correction, "bias_correction", _NAME, "")
  return betas, omegas


def scale_by_mt_dao(
  betas=(0.995,),
  omegas=(0.7,),
  *,
  b2: float = 0.999,
  eps: float = 1e-8,
  bias_correction: bool = True,
) -> optax.GradientTransformation:
  """MT-DAO's direction ``d`` (equations (1) to (3) on the API page's top).

  Args:
    betas: the first momenta's decays, one per momentum (a tuple).
    omegas: their weights in the step, one per momentum, summing to at
      most 1; the gradient's weight is ``1 - sum(omegas)``.
    b2: the second moment's decay.
    eps: added to the root of the (bias-corrected) second moment.
    bias_correction: divide each moment by ``1 - beta^t`` (Adam's).

  Returns:
    An ``optax.GradientTransformation`` with :class:`MTDAOState` (float32
    moments; updates in each gradient's dtype).

  Example:
    >>> import jax.numpy as jnp, optax, shardopt
    >>> tx = shardopt.scale_by_mt_dao(betas=(0.9,), omegas=(1.0,))
    >>> adam = optax.scale_by_adam(b1=0.9)
    >>> g = jnp.array([1.0, -2.0, 3.0])
    >>> mine, _ = tx.update(g, tx.init(g))
    >>> theirs, _ = adam.update(g, adam.init(g))  # omega 1: Adam
    >>> bool(jnp.allclose(mine, theirs))
    True
  """
  betas, omegas = _check(betas, omegas, b2, eps, bias_correction)
  rest = 1.0 - sum(float(w) for w in omegas)

  def init_fn(params):
    zeros = lambda: jax.tree.map(  # noqa: E731
      lambda p: jnp.zeros_like(p, jnp.float32),
      params,  # p's varying axes
    )
    return MTDAOState(
      jnp.zeros((), jnp.int32), tuple(zeros() for _ in betas), zeros()
    )

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    t = count.astype(jnp.float32)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    momenta = tuple(
      jax.tree.map(lambda u, g, b=b: b * u + (1.0 - b) * g, u, grads)
      for b, u in zip(betas, state.momenta, strict=True)
    )
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, grads)

    def correct(decay):
      return 1.0 - jnp.float32(decay) ** t if bias_correction else 1.0

    def direction(g, v, *us):
      mixed = rest * g
      for w, b, u in zip(omegas, betas, us, strict=True):
        mixed = mixed + w * (u / correct(b))
      return mixed / (jnp.sqrt(v / correct(b2)) + eps)

    out = jax.tree.map(direction, grads, nu, *momenta)
    out = jax.tree.map(lambda d, g: d.astype(g.dtype), out, updates)
    return out, MTDAOState(count, momenta, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def mt_dao(
  learning_rate,
  betas=(0.995,),
  omegas=(0.7,),
  *,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  bias_correction: bool = True,
) -> optax.GradientTransformation:
  """MT-DAO's local optimizer: slow and fast momenta, Adam's denominator.

  ``chain(scale_by_mt_dao(betas, omegas, ...), add_decayed_weights(
  weight_decay), scale_by_learning_rate(learning_rate))``, as
  ``optax.adamw`` chains ``scale_by_adam``: equations (1) to (4) on the API
  page's top. It uses no collective; run it as the ``inner`` optimizer of
  :func:`shardopt.desloc` with ``state_sync_periods={"momenta": K, "nu":
  K}`` (the paper's sync: the params and the states averaged every ``K``
  steps), or of :func:`shardopt.local_sgd` / :func:`shardopt.diloco` (the
  params averaged, the states each replica's own).

  Defaults: one slow momentum (``betas=(0.995,)``, half-life 138 steps)
  weighted 0.7 against the gradient's 0.3, QHAdam's recommended values (Ma
  and Yarats), which MT-DAO's Adam form generalizes; ``b2``, ``eps`` as
  Adam's. They are not the paper's (its table was not read: see
  docs/mt_dao.md); the knob it studies is the slow momentum's timescale
  against the sync period (``betas``).

  Args:
    learning_rate: a float or an optax schedule.
    betas: the first momenta's decays (a tuple, one per momentum).
    omegas: their weights (summing to at most 1; the gradient has the rest).
    b2: the second moment's decay.
    eps: added to the root of the second moment.
    weight_decay: decoupled weight decay (AdamW's), times the learning rate.
    bias_correction: Adam's ``1 - beta^t`` corrections.

  Returns:
    An ``optax.GradientTransformation`` (state: ``(MTDAOState, ...)``).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.local_sgd(shardopt.mt_dao(0.1), "i", sync_period=2)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.pmap(step, axis_name="i")
    >>> params = jnp.zeros((8, 2))
    >>> state = jax.pmap(tx.init)(params)
    >>> grads = jnp.stack([jnp.array([1.0, -1.0])] * 4 + [-jnp.ones(2)] * 4)
    >>> params, state = step(params, state, grads)  # local: -0.1 sign(g)
    >>> np.asarray(params)[[0, 7]].round(3)
    array([[-0.1,  0.1],
           [ 0.1,  0.1]], dtype=float32)
    >>> params, state = step(params, state, grads)  # averaged at the sync
    >>> bool((params == params[0]).all())
    True

  References:
    Iacob, Jovanovic, Safaryan, Kurmanji, Sani, Horvath, Shen, Qiu and
    Lane, MT-DAO: Multi-timescale Distributed Adaptive Optimizers with
    Local Updates, arXiv 2510.05361, ICLR 2026.
  """
  if not _number(weight_decay) or not float(weight_decay) >= 0.0:
    raise ValueError(
      f"shardopt.mt_dao: weight_decay={weight_decay!r} must be a number >="
      " 0 (AdamW's decoupled weight decay); e.g. weight_decay=0.1."
    )
  return optax.chain(
    scale_by_mt_dao(
      betas, omegas, b2=b2, eps=eps, bias_correction=bias_correction
    ),
    optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(learning_rate),
  )
