"""Fragments: which part of the params each sync of a schedule moves.

A fragment is a tuple of :class:`Piece` records, one per leaf it touches: a
whole leaf, or (with ``layer_axes``) every ``F``-th layer of a stacked leaf.
:func:`split` builds them; :func:`take` and :func:`put` read and write a
piece of a leaf (a reshape and an index, no gather), and :func:`layer_mask` says
which elements of a leaf a piece covers, for the selects outside the conds.

Layer fragments are *strided*, as in Streaming DiLoCo (Douillard et al.
2025, section 2.2): layer ``l`` of a stack of ``L`` layers belongs to
fragment ``l % F``, so every fragment holds layers from the bottom to the top
of the network. ``L`` must be divisible by ``F``. The leaves that are not
stacks (embeddings, final norms) are split into ``F`` contiguous groups
balanced by bytes, as without ``layer_axes``; with fewer than ``F`` of them,
the ``j``-th goes to fragment ``j``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _args


class Piece(NamedTuple):
  """A fragment's part of one leaf.

  Attributes:
    leaf: index of the leaf in ``jax.tree.leaves(params)`` order.
    axis: the leaf's stacked (layer) axis, or None for the whole leaf.
    index: with ``axis``: the piece is layers ``index, index + count, ...``.
    count: with ``axis``: the number of fragments the layers are dealt to.
  """

  leaf: int
  axis: int | None = None
  index: int = 0
  count: int = 1


def leaves_of(fragment: Sequence[Piece]) -> tuple[int, ...]:
  """The leaves a fragment touches, in order."""
  return tuple(dict.fromkeys(p.leaf for p in fragment))


def _strided_view(x: jax.Array, piece: Piece) -> jax.Array:
  """``x`` with its layer axis split as ``(layers / count, count)``."""
  shape = tuple(x.shape)
  a = piece.axis
  return jnp.reshape(
    x, shape[:a] + (shape[a] // piece.count, piece.count) + shape[a + 1 :]
  )


def take(x: jax.Array, piece: Piece) -> jax.Array:
  """The piece of leaf ``x``."""
  if piece.axis is None:
    return x
  return jax.lax.index_in_dim(
    _strided_view(x, piece), piece.index, piece.axis + 1, keepdims=False
  )


def put(x: jax.Array, piece: Piece, value: jax.Array) -> jax.Array:
  """Leaf ``x`` with its piece replaced by ``value``."""
  if piece.axis is None:
    return value.astype(x.dtype)
  view = jax.lax.dynamic_update_index_in_dim(
    _strided_view(x, piece),
    value.astype(x.dtype),
    piece.index,
    piece.axis + 1,
  )
  return jnp.reshape(view, x.shape)


def layer_mask(piece: Piece, shape: Sequence[int]) -> jax.Array | bool:
  """Which elements of a leaf of ``shape`` the piece covers: ``True`` for a
  whole leaf, else a bool array along the layer axis that broadcasts against
  the leaf (layers ``index, index + count, ...``)."""
  if piece.axis is None:
    return True
  layers = shape[piece.axis]
  covered = np.arange(layers) % piece.count == piece.index
  view = [1] * len(shape)
  view[piece.axis] = layers
  return jnp.asarray(covered.reshape(view))


# --------------------------------------------------------------------------
# Building the fragments.


def split_fragments(
  leaf_bytes: Sequence[int], num_fragments: int
) -> tuple[tuple[int, ...], ...]:
  """Contiguous fragments of leaf indices, balanced by bytes.

  The ``k``-th cut goes where the cumulative bytes come closest to ``k *
  total / num_fragments`` (the first such place on a tie), keeping every
  fragment non-empty. Needs ``1 <= num_fragments <= len(leaf_bytes)``.
  """
  n = len(leaf_bytes)
  cumulative = np.cumsum(leaf_bytes)
  total = float(cumulative[-1]) if n else 0.0
  cuts = [0]
  for k in range(1, num_fragments):
    target = k * total / num_fragments
    candidates = range(cuts[-1] + 1, n - (num_fragments - k) + 1)
    cuts.append(min(candidates, key=lambda j: abs(cumulative[j - 1] - target)))
  cuts.append(n)
  return tuple(
    tuple(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)
  )


def _leaf_bytes(leaves: Sequence[Any]) -> list[int]:
  return [
    int(np.prod(np.shape(p))) * np.dtype(p.dtype).itemsize for p in leaves
  ]


def _whole_leaves(
  leaves: Sequence[Any], indices: Sequence[int], num_fragments: int
) -> list[list[int]]:
  """Leaves ``indices`` dealt to ``num_fragments`` fragments: contiguous and
  balanced by bytes, or one each (some fragments empty) if too few."""
  if len(indices) < num_fragments:
    groups = [[i] for i in indices]
    return groups + [[] for _ in range(num_fragments - len(indices))]
  split = split_fragments(
    _leaf_bytes([leaves[i] for i in indices]), num_fragments
  )
  return [[indices[j] for j in group] for group in split]


def layer_axes_of(params: Any, layer_axes: Any, transform: str) -> list:
  """Per leaf, its stacked (layer) axis (non-negative) or None."""
  if layer_axes is None:
    return [None] * len(jax.tree.leaves(params))
  try:
    axes = jax.tree.broadcast(layer_axes, params, is_leaf=lambda x: x is None)
    axes = jax.tree.leaves(axes, is_leaf=lambda x: x is None)
  except (ValueError, TypeError) as error:
    axes = _axes_by_key_path(layer_axes, params)
    if axes is not None:
      return _checked(params, axes, transform)
    raise ValueError(
      f"{transform}: layer_axes={layer_axes!r} is not a pytree prefix of the"
      " params; give, per leaf (or per subtree), the index of its stacked"
      " layer axis or None, e.g. {'blocks': 0, 'embed': None}."
    ) from error
  return _checked(params, axes, transform)


def _axes_by_key_path(layer_axes: Any, params: Any) -> list | None:
  """Per leaf, the axis a prefix made of plain dicts gives it, read along
  the leaf's key path (for params in another mapping type, such as
  ``flax.nnx.State``); None if some leaf's path is not in the prefix."""
  out = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    node = layer_axes
    for key in path:
      if not isinstance(node, dict):
        break
      name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
      if name not in node:
        return None
      node = node[name]
    if isinstance(node, dict):
      return None
    out.append(node)
  return out


def _checked(params: Any, axes: list, transform: str) -> list:
  """``axes`` (one per leaf) checked against the leaves' ranks and made
  non-negative."""
  leaves = jax.tree.leaves(params)
  out = []
  for leaf, axis in zip(leaves, axes, strict=True):
    ndim = np.ndim(leaf)
    if axis is not None and (
      not _args.is_integer(axis) or not -ndim <= int(axis) < ndim
    ):
      raise ValueError(
        f"{transform}: layer_axes gives axis {axis!r} for a leaf of shape"
        f" {tuple(np.shape(leaf))}; it must be an integer in [{-ndim},"
        f" {ndim}) (the leaf's stacked layer axis) or None."
      )
    out.append(None if axis is None else int(axis) % ndim)
  return out


def split(
  params: Any, num_fragments: int, layer_axes: Any, transform: str
) -> tuple[tuple[Piece, ...], ...]:
  """The fragments of ``params`` (see the module docstring), or a
  ValueError naming the fix."""
  leaves = jax.tree.leaves(params)
  axes = layer_axes_of(params, layer_axes, transform)
  stacked = [i for i, a in enumerate(axes) if a is not None]
  if num_fragments == 1 or not stacked:
    if num_fragments > max(len(leaves), 1):
      raise ValueError(
        f"{transform}: num_fragments={num_fragments} but the params have only"
        f" {len(leaves)} leaves; without layer_axes fragments are made of"
        f" whole leaves (contiguous in jax.tree.leaves order), so use"
        f" num_fragments <= {len(leaves)}, or give the stacked layer axes of"
        " a scanned model with layer_axes=... to split its layers."
      )
    groups = split_fragments(_leaf_bytes(leaves), num_fragments)
    return tuple(tuple(Piece(i) for i in group) for group in groups)
  for i in stacked:
    layers = np.shape(leaves[i])[axes[i]]
    if layers % num_fragments:
      raise ValueError(
        f"{transform}: a leaf of shape {tuple(np.shape(leaves[i]))} has"
        f" {layers} layers along its layer axis {axes[i]} (layer_axes), not"
        f" divisible by num_fragments={num_fragments}; layer l goes to"
        f" fragment l % num_fragments, so use a num_fragments that divides"
        f" {layers}, or layer_axes=None for that leaf."
      )
  others = _whole_leaves(
    leaves, [i for i, a in enumerate(axes) if a is None], num_fragments
  )
  return tuple(
    tuple(
      sorted(
        [Piece(i, axes[i], f, num_fragments) for i in stacked]
        + [Piece(i) for i in others[f]],
        key=lambda piece: piece.leaf,
      )
    )
    for f in range(num_fragments)
  )


# --------------------------------------------------------------------------
# What a user can print: which leaves form each fragment.


def _path_names(params: Any) -> list[str]:
  """Each leaf's key path as ``a/b/0``, in ``jax.tree.leaves`` order."""
  return [
    jax.tree_util.keystr(path, simple=True, separator="/") or "(root)"
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]


def _checked_split(params, num_fragments, layer_axes, name):
  """:func:`split` after the checks ``diloco`` makes of ``num_fragments``."""
  if (
    not _args.is_integer(num_fragments)
    or isinstance(num_fragments, bool)
    or int(num_fragments) < 1
  ):
    raise ValueError(
      f"{name}: num_fragments={num_fragments!r} must be an integer >= 1, as"
      " given to shardopt.diloco(..., num_fragments=F)."
    )
  return split(params, int(num_fragments), layer_axes, name)


def fragment_of(
  params: Any, num_fragments: int, layer_axes: Any = None
) -> dict[str, int | tuple[int, ...]]:
  """Which fragment of ``shardopt.diloco(..., num_fragments=F)`` each leaf
  of ``params`` belongs to.

  The same assignment ``diloco`` makes (it calls the same ``split``):
  whole leaves, contiguous in ``jax.tree.leaves`` order and balanced by
  bytes; with ``layer_axes``, layer ``l`` of a stacked leaf in fragment
  ``l % F``. Fragment ``f`` syncs after step ``t`` when ``t % sync_period ==
  (f * sync_period // F + sync_offset) % sync_period``; see
  ``describe_fragments`` for a printable table with those steps.

  Args:
    params: the params (or anything with their tree structure, shapes and
      dtypes, e.g. ``jax.ShapeDtypeStruct`` leaves) that ``diloco`` updates:
      one replica's, not a stack of replicas.
    num_fragments: ``F``, as given to ``diloco``.
    layer_axes: as given to ``diloco`` (None: whole leaves).

  Returns:
    ``{leaf path: fragment}`` in ``jax.tree.leaves`` order, the path as
    ``jax.tree_util.keystr(path, simple=True, separator="/")`` (e.g.
    ``"blocks/w"``). A whole leaf maps to its fragment (an int); a stacked
    leaf to the fragment of each of its layers (a tuple: ``(0, 1, 0, 1)``
    for 4 layers and ``F = 2``).

  Example:
    >>> import numpy as np
    >>> from shardopt import fragment_of
    >>> params = {"b": np.zeros(8, np.float32), "w": np.zeros((16, 8), np.float32)}
    >>> fragment_of(params, 2)
    {'b': 0, 'w': 1}
    >>> fragment_of(params, 4, layer_axes={"w": 0, "b": None})["w"][:6]
    (0, 1, 2, 3, 0, 1)
  """
  fragments = _checked_split(
    params, num_fragments, layer_axes, "shardopt.fragment_of"
  )
  leaves = jax.tree.leaves(params)
  out: list[Any] = [None] * len(leaves)
  for f, fragment in enumerate(fragments):
    for piece in fragment:
      if piece.axis is None:
        out[piece.leaf] = f
      else:
        layers = np.shape(leaves[piece.leaf])[piece.axis]
        out[piece.leaf] = tuple(layer % piece.count for layer in range(layers))
  return dict(zip(_path_names(params), out, strict=True))
