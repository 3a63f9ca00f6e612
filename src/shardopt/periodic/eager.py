"""Eager updates (Kale, Douillard and Donchev 2025, arXiv 2502.12996): the
outer step of ``diloco(..., eager=True)``.

DiLoCo's outer step waits for the all-reduce of the outer gradients. With
the communication overlapped by one whole outer step, the average of sync
``k``'s outer gradients arrives only at sync ``k + 1``. The eager update
does not wait for it: at sync ``k`` replica ``m`` of ``M`` moves its outer
params with its *own* fresh outer gradient standing in for its share of the
average, and the others' shares from the previous sync::

  g_m(k) = Delta_m(k) / M + sum_{m' != m} Delta_m'(k - 1) / M
         = Delta_m(k) / M + (mean(k - 1) - Delta_m(k - 1) / M)

and ``center_m <- outer_optimizer(center_m, g_m(k))``. The all-reduce of
``Delta(k)`` still runs at sync ``k`` (the same one, over the same bytes,
as DiLoCo's), but nothing the step returns but the state's buffer
``others = mean(k) - Delta_m(k) / M`` reads it: the outer step and the
next inner phase have no data dependence on it. At the first sync the
buffer is zeros (the delayed average of a sync that did not happen).

The replicas' outer params differ by their own terms: ``center`` and the
outer optimizer's state are per replica; ``mean(k)`` is bit-identical on
every replica (one all-reduce), and replicas whose outer gradients agree
stay bit-identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardopt import _axes
from shardopt.finite import all_finite
from shardopt.periodic import outer


@dataclasses.dataclass(frozen=True)
class Eager:
  """The eager outer step: ``optimizer`` on ``Delta_m(k) / M + others``;
  state ``(optimizer state, others)``, both per replica."""

  optimizer: optax.GradientTransformation
  axis_name: Any
  axis_index_groups: Any = None

  def check(self, transform: str) -> None:
    outer.Optimizer(self.optimizer).check(transform)

  def init(self, params: Any, fragments, view) -> Any:
    del fragments, view
    others = jax.tree.map(
      lambda p: _axes.cast_varying(
        jnp.zeros_like(p, _axes.accumulation_dtype(p.dtype)),
        _axes.varying_axes(p),
      ),
      params,
    )
    return self.optimizer.init(params), others

  def step(self, combined, mine, center, global_state, any_finite, view):
    state, others = global_state
    treedef = jax.tree.structure(others)
    others = jax.tree.leaves(others)
    size = _axes.group_size(
      self.axis_index_groups, _axes.axis_size(self.axis_name, "shardopt.diloco")
    )
    counts = all_finite(mine)
    own = [
      jnp.where(counts, m, jnp.zeros_like(m)) / jnp.asarray(size, m.dtype)
      for m in mine
    ]
    eager = [o + d.astype(o.dtype) for o, d in zip(own, others, strict=True)]
    center, state = outer.Optimizer(self.optimizer).step(
      eager, mine, center, state, any_finite, view
    )
    others = [
      jnp.where(any_finite, c.astype(d.dtype) - o.astype(d.dtype), 0.0).astype(
        d.dtype
      )
      for c, o, d in zip(combined, own, others, strict=True)
    ]
    return center, (state, treedef.unflatten(others))
