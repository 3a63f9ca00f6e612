"""Outer steps: how a sync moves the center with the combined contribution,
and the updates that pull the params onto it.

One small object per kind, each with ``check``, ``init`` and ``step`` (the
:class:`OuterStep` protocol, all the engine asks of one; a new outer step is
a new class here):

- :class:`Optimizer`: an optax optimizer moves the center
  (``center <- global_optimizer(center, a)``): ``agn``'s global optimizer,
  DiLoCo's outer Nesterov SGD;
- :func:`mean`: the optimizer ``optax.sgd(1.0)`` on pseudo-gradients,
  ``center - mean_i(center - local_i) = mean_i(local_i)``: ``local_sgd``;
- :class:`Replace`: the combined params are the new center, no optimizer
  state: ``hierarchical_local_sgd``.

With fragments (``num_fragments=F > 1``) the optimizer keeps one state per
fragment, over the list of its leaves (:func:`fragment_view`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from shardopt import _axes
from shardopt.periodic import _xla
from shardopt.periodic import fragments as _fragments


class OuterStep(Protocol):
  """What the engine (:mod:`.engine`) asks of an outer step."""

  def check(self, transform: str) -> None:
    """Raises a clear error (naming ``transform``) for a bad configuration."""

  def init(self, params: Any, fragments, view) -> Any:
    """The outer state for ``params`` (one per fragment with fragments);
    ``view`` turns a list of leaves into what an optimizer sees."""

  def step(
    self, combined, mine, center, global_state, any_finite, view
  ) -> tuple[list, Any]:
    """The new center leaves and outer state after a sync: ``combined`` is
    the group's combined contribution, ``mine`` this replica's, per synced
    leaf; nothing moves unless ``any_finite``."""


def fragment_view(treedef, num_fragments: int):
  """What the outer optimizer sees of a list of leaves: the whole tree, or
  (with fragments) the fragment's list."""
  return functools.partial(
    _fragment_tree, treedef=treedef, num_fragments=num_fragments
  )


def _fragment_tree(leaves: list, treedef, num_fragments: int) -> Any:
  return treedef.unflatten(leaves) if num_fragments == 1 else list(leaves)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """The center moves by ``optimizer`` with the combined contribution."""

  optimizer: optax.GradientTransformation

  def check(self, transform: str) -> None:
    _axes.check_transform(self.optimizer, transform, "global_optimizer")

  def init(self, params: Any, fragments, view) -> Any:
    """The optimizer's state: over ``params``, or one per fragment."""
    if len(fragments) == 1:
      return self.optimizer.init(params)
    leaves = jax.tree.leaves(params)
    return tuple(
      self.optimizer.init(view([_fragments.take(leaves[p.leaf], p) for p in f]))
      for f in fragments
    )

  def step(self, combined, mine, center, global_state, any_finite, view):
    """The new center and state, if any replica of the group was finite;
    otherwise they stay as they are."""
    del mine

    def step(operands):
      center, state = operands
      wire = [t.astype(c.dtype) for t, c in zip(combined, center, strict=True)]
      center_updates, state = self.optimizer.update(
        view(wire), state, view(center)
      )
      center = optax.apply_updates(view(center), center_updates)
      return jax.tree.leaves(center), state

    return _xla.cond(any_finite, step, lambda o: o, (center, global_state))


def mean() -> Optimizer:
  """Periodic model averaging on pseudo-gradients: ``optax.sgd(1.0)`` gives
  ``center - mean_i(center - local_i) = mean_i(local_i)``."""
  return Optimizer(optax.sgd(1.0))


@dataclasses.dataclass(frozen=True)
class Replace:
  """The combined params are the new center (or, if no replica of the group
  was finite, this replica's own); no optimizer state."""

  def check(self, transform: str) -> None:
    del transform

  def init(self, params: Any, fragments, view) -> Any:
    del params, fragments, view
    return ()

  def step(self, combined, mine, center, global_state, any_finite, view):
    del view
    center = [
      jnp.where(any_finite, t, m).astype(c.dtype)
      for t, m, c in zip(combined, mine, center, strict=True)
    ]
    return center, global_state


def pull(target: list, params: list) -> list:
  """Updates that move the synced leaves onto ``target``.

  ``params + (target - params)`` lands on the target exactly when
  ``target/2 <= params <= 2*target`` (Sterbenz), within one rounding otherwise.
  """
  return [t.astype(p.dtype) - p for t, p in zip(target, params, strict=True)]


def pull_after(synced: list, center: list, params: list, updates: list) -> list:
  """Updates onto the center for the leaves a sync moved (``synced``, one
  flag per leaf), the local optimizer's elsewhere.

  Outside every cond, so that on a step without a sync XLA fuses the local
  step, this select and the caller's ``apply_updates`` as it does for plain
  optax (see :mod:`._xla`).
  """
  return [
    jnp.where(f, c.astype(p.dtype) - p, u)
    for f, c, p, u in zip(synced, center, params, updates, strict=True)
  ]


@dataclasses.dataclass(frozen=True)
class Merge:
  """Streaming DiLoCo's overlap: after a fragment's sync the replicas keep
  training, and ``overlap_steps`` later (:func:`.schedules.merges`) each
  replica's fragment becomes ``alpha * params + (1 - alpha) * center``.

  A replica left out of the sync (its contribution was not finite) cannot be
  mixed: it is pulled onto the center at the sync, as without overlap.
  """

  alpha: float

  def updates(
    self,
    synced: list,
    merging: list,
    left_out: jax.Array,
    center: list,
    params: list,
    updates: list,
  ) -> list:
    """Per leaf (``synced``/``merging``: which elements a sync moved in this
    step, which rejoin the center): updates onto the mix for the merging
    elements, onto the center for a left-out replica's synced ones, the
    local optimizer's elsewhere. Outside every cond, like
    :func:`pull_after`."""
    out = []
    for s, m, c, p, u in zip(
      synced, merging, center, params, updates, strict=True
    ):
      c = c.astype(p.dtype)
      target = c
      if self.alpha:
        target = self.alpha * optax.apply_updates(p, u) + (1 - self.alpha) * c
      u = jnp.where(m, target - p, u)
      out.append(jnp.where(s & left_out, c - p, u))
    return out
