"""Gradients checked against the params: one place for "grads look like params".

Every public transform calls :func:`check_like_params` at the top of its
``update`` (at trace time, before it reduces or accumulates anything), as
optax's ``MultiSteps`` checks what its skip function returns. Without it a
gradient of the wrong shape is broadcast against the params' shape somewhere
inside (an accumulator, a center, an error buffer) and the transform returns
updates of a shape nobody asked for, silently.

The comparison is leaf by leaf on what the transform is handed: under
``jax.pmap`` the per-replica values, under ``jax.shard_map`` the local blocks
of both (a leaf sharded over a model axis is compared as that block), so the
shapes compare as they are.

``shardopt.accumulate`` does not call it: it keeps ``optax.MultiSteps``'
behaviour, whose accumulator (shaped like the params) broadcasts the
gradients it adds (see its docstring).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _axes


def _shape_and_float(x: Any) -> tuple[tuple, bool]:
  """A leaf's shape, and whether its dtype is floating point."""
  return tuple(np.shape(x)), bool(jnp.issubdtype(_dtype(x), jnp.floating))


def _dtype(x: Any):
  dtype = getattr(x, "dtype", None)
  return np.result_type(x) if dtype is None else dtype


def _who(transform: str, axis_name: _axes.AxisName) -> str:
  """``transform``, with its axis when it has one (the messages' subject)."""
  if axis_name is None:
    return transform
  return f"{transform} (axis {axis_name!r})"


def check_like_params(
  transform: str,
  updates: Any,
  params: Any,
  axis_name: _axes.AxisName = None,
) -> None:
  """Raises unless ``updates`` have the tree, shapes and float-ness of
  ``params``.

  Nothing is checked when ``params`` is None (a transform that needs the
  params raises its own error). The tree structures must be equal
  (``ValueError``), then each gradient leaf must have its param's shape
  (``ValueError``) and a floating-point dtype exactly where the param has
  one (``TypeError``); the messages name ``transform``, the leaf's path
  (``jax.tree_util.keystr``), both shapes or dtypes and the fix. Dtypes may
  differ otherwise (bfloat16 gradients of float32 params pass).

  Args:
    transform: the public transform's name, e.g. ``"shardopt.diloco"``.
    updates: the gradients (``updates``) ``update`` was given.
    params: the params ``update`` was given, or None.
    axis_name: the transform's axis (or tuple of axes), named in messages.
  """
  if params is None:
    return
  grads_def = jax.tree.structure(updates)
  params_def = jax.tree.structure(params)
  if grads_def != params_def:
    raise ValueError(
      f"{_who(transform, axis_name)}: the gradient tree does not match the"
      f" params tree: gradients have structure {grads_def}, params have"
      f" {params_def}. Pass the gradient of the params you give update,"
      " tx.update(jax.grad(loss)(params), state, params), with the tree the"
      " state was built from (tx.init(params))."
    )
  paths_and_grads = jax.tree_util.tree_flatten_with_path(updates)[0]
  for (path, g), p in zip(
    paths_and_grads, params_def.flatten_up_to(params), strict=True
  ):
    g_shape, g_float = _shape_and_float(g)
    p_shape, p_float = _shape_and_float(p)
    where = jax.tree_util.keystr(path) or "<root>"
    if g_shape != p_shape:
      raise ValueError(
        f"{_who(transform, axis_name)}: the gradient at {where} has shape"
        f" {g_shape}, but the param at {where} has shape {p_shape};"
        " gradients must have the params' shapes, leaf for leaf (nothing is"
        " broadcast). Pass the gradient of the params you give update,"
        " jax.grad(loss)(params): under jax.pmap both per replica (without"
        " the leading device axis), under jax.shard_map both the same local"
        " blocks (the same in_specs)."
      )
    if g_float != p_float:
      raise TypeError(
        f"{_who(transform, axis_name)}: the gradient at {where} has dtype"
        f" {_dtype(g)}, but the param at {where} has dtype {_dtype(p)}; a"
        " gradient has a floating-point dtype exactly where its param has"
        " one. Pass jax.grad(loss)(params) of the params you give update,"
        " and keep integer leaves (counters, indices) out of the tree the"
        " optimizer sees, or wrap the transform in optax.masked(...)."
      )
