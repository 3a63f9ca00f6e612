"""The local optimizer's state fields a sync averages (DES-LOC's moments).

A field is named as the optimizer's state names it: ``"mu"`` and ``"nu"``
are ``optax.scale_by_adam``'s ``ScaleByAdamState.mu`` and ``.nu`` (inside
``optax.adam``, ``optax.adamw`` and any chain holding them). A leaf belongs
to field ``name`` when the first named-tuple field on its path through the
state is ``name``: the params' own tree below it does not count, so a
params leaf called ``"mu"`` is not a moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def _field(path) -> str | None:
  """The first named-tuple field on ``path`` (None if there is none)."""
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      return key.name
  return None


def fields(local_state: Any) -> list[str]:
  """The named-tuple fields holding floating leaves, in order."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(local_state)[0]:
    name = _field(path)
    if (
      name is not None
      and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
      and name not in found
    ):
      found.append(name)
  return found


def indices(local_state: Any, names: Sequence[str]) -> dict[str, list[int]]:
  """Per name, the indices (in ``jax.tree.leaves(local_state)``) of the
  floating leaves of that field."""
  out = {name: [] for name in names}
  flat = jax.tree_util.tree_flatten_with_path(local_state)[0]
  for i, (path, leaf) in enumerate(flat):
    name = _field(path)
    if name in out and jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      out[name].append(i)
  return out


def check(local_state: Any, names: Sequence[str], transform: str) -> None:
  """A ValueError naming the fix if a name has no floating leaf."""
  found = indices(local_state, names)
  missing = [name for name in names if not found[name]]
  if missing:
    raise ValueError(
      f"{transform}: state_sync_periods names {missing!r}, but the inner"
      " optimizer's state has no such field with floating leaves (its"
      f" fields: {fields(local_state)!r}). DES-LOC averages Adam's moments,"
      " the fields 'mu' and 'nu' of optax.scale_by_adam's state (in"
      " optax.adam and optax.adamw): pass an Adam-family inner optimizer,"
      " or name fields its state has."
    )
