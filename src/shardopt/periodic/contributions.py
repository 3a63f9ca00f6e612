"""Contributions: what each replica brings to a sync.

One small object per kind, each with the same methods, so the engine never
asks which kind it holds:

- :class:`GradientSums` (``agn``): ``a_i = (g_1 + ... + g_T) / T``, from an
  accumulator of the gradients since the last sync (kept in the state);
- :class:`PseudoGradients` (``local_sgd``, ``diloco``):
  ``a_i = center - local params_i``;
- :class:`Params` (``hierarchical_local_sgd``): ``a_i = local params_i``.

The last two read the local params *after* this step's local update, so
their sync reads this step's updates (``reads_updates``); the first reads
only its accumulator. How the contributions combine across replicas is
:mod:`.combine`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardopt import _axes


class Contribution:
  """What every kind of contribution answers.

  Attributes:
    reads_updates: whether a sync reads this step's local updates (the
      contribution is read from the params after the local step).
  """

  reads_updates = True

  def init(self, params: Any) -> Any:
    """The state's ``accumulator`` at ``init`` (an empty tuple: none)."""
    del params
    return ()

  def accumulate(self, accumulator: Any, grads: Any) -> list:
    """The accumulator's leaves after this step's ``grads``."""
    del accumulator, grads
    return []

  def state(self, treedef, accumulator: list) -> Any:
    """The state's ``accumulator`` from the carried leaves."""
    del treedef, accumulator
    return ()

  def of(
    self, accumulator: list, center: list, params: list, updates: list
  ) -> list:
    """This replica's contribution for a sync's leaves, from their
    accumulator, center, params and this step's local ``updates`` (None:
    the sync runs a step late and reads the params as given)."""
    raise NotImplementedError


def _local_params(p: jax.Array, u: jax.Array | None) -> jax.Array:
  """This replica's params after the local update (``u`` None: the params
  as given, for a sync run a step late), in the accumulation dtype (float32
  for low-precision params)."""
  wide = _axes.accumulation_dtype(p.dtype)
  local = p if u is None else optax.apply_updates(p, u)
  return local.astype(wide)


def _each(updates: list | None, params: list) -> list:
  """The updates per leaf, None for each where there are none."""
  return [None] * len(params) if updates is None else updates


@dataclasses.dataclass(frozen=True)
class GradientSums(Contribution):
  """AGN's: ``a_i = (g_1 + ... + g_T) / T`` over the ``period`` T."""

  period: int
  reads_updates = False

  def init(self, params: Any) -> Any:
    return jax.tree.map(_zeros_accumulator, params)

  def accumulate(self, accumulator: Any, grads: Any) -> list:
    """``accumulator += grads``, in the accumulator's dtype."""
    return [
      a + g.astype(a.dtype)
      for a, g in zip(
        jax.tree.leaves(accumulator), jax.tree.leaves(grads), strict=True
      )
    ]

  def state(self, treedef, accumulator: list) -> Any:
    return treedef.unflatten(accumulator)

  def of(self, accumulator, center, params, updates) -> list:
    del center, params, updates
    return [a / jnp.asarray(self.period, a.dtype) for a in accumulator]


@dataclasses.dataclass(frozen=True)
class PseudoGradients(Contribution):
  """local_sgd's and DiLoCo's: ``a_i = center - local params_i``."""

  def of(self, accumulator, center, params, updates) -> list:
    del accumulator
    mine = []
    for p, u, c in zip(params, _each(updates, params), center, strict=True):
      local = _local_params(p, u)
      mine.append(c.astype(local.dtype) - local)
    return mine


@dataclasses.dataclass(frozen=True)
class Params(Contribution):
  """Plain averaging's: ``a_i = local params_i``."""

  def of(self, accumulator, center, params, updates) -> list:
    del accumulator, center
    return [
      _local_params(p, u)
      for p, u in zip(params, _each(updates, params), strict=True)
    ]


def _zeros_accumulator(p: jax.Array) -> jax.Array:
  """agn's accumulator for leaf ``p`` (float32 for low-precision params)."""
  return jnp.zeros_like(p, dtype=_axes.accumulation_dtype(p.dtype))
