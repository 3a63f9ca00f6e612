"""Cross-replica collectives: ``reduce``, ``broadcast``, ``replica_divergence``.

Everything in shardopt that moves gradients between replicas goes through
:func:`reduce`. It hides three differences a user should not have to think
about:

* ``pmap`` / ``shard_map(check_vma=False)`` versus a checking ``shard_map``,
  where a value can be typed *invariant* (the gradient of replicated params,
  which autodiff has already summed over the axis);
* ``axis_index_groups``, native under ``pmap`` and rebuilt under a checking
  ``shard_map`` as a grouped reduce-scatter followed by a grouped all-gather;
* ``comm_dtype``, a narrower dtype on the wire (bfloat16, float16), or a
  quantized one (int8, float8, int4 with block scales, see
  :func:`shardopt.quantized`); the transforms with error feedback also take
  a sparse one (the top k of every chunk, :func:`shardopt.topk`).

The examples below assume 8 devices, e.g. a CPU forced to show them with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before importing jax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _axes
from shardopt import wire as _wire
from shardopt.wire import feedback as _feedback

__all__ = ["broadcast", "reduce", "replica_divergence"]
# The other names without an underscore (reduce_for, reduce_with_error)
# are shardopt's own: its transforms reduce through them, on the Wire they
# canonicalised when they were built (shardopt.wire.of).

_REDUCE = "shardopt.reduce"


def _bits_dtype(dtype) -> np.dtype:
  return np.dtype(f"int{np.dtype(dtype).itemsize * 8}")


def _grouped_psum_scatter_gather(
  x: jax.Array, axis, groups: tuple
) -> jax.Array:
  """Grouped all-reduce (sum) as a grouped reduce-scatter + grouped all-gather.

  JAX rejects a grouped ``psum`` inside a checking shard_map, but accepts the
  two halves. The leaf is flattened and padded to a multiple of the group size;
  each member reduces one chunk, then every member gathers all chunks, so all
  members of a group end with the same bits. The bytes moved equal a ring
  all-reduce's.
  """
  if x.size == 0:
    return x
  members = len(groups[0])
  flat = x.reshape(-1)
  pad = (-flat.size) % members
  if pad:
    flat = jnp.pad(flat, (0, pad))
  chunk = jax.lax.psum_scatter(flat, axis, axis_index_groups=groups, tiled=True)
  full = jax.lax.all_gather(chunk, axis, axis_index_groups=groups, tiled=True)
  return full[: x.size].reshape(x.shape)


def _grouped_psum_by_slots(x: jax.Array, axis, groups: tuple) -> jax.Array:
  """Grouped all-reduce (sum) as one all-reduce over the whole axis.

  Each replica writes ``x`` into the slot of its group in a zero buffer of
  ``len(groups)`` slots; after a ``psum`` over the axis, slot ``g`` holds the
  sum of group ``g``'s members (adding zeros is exact) and every member reads
  the same bits. It moves ``len(groups)`` times the leaf's bytes, and it is
  used only inside model-parallel replicas, where XLA would replicate a
  grouped reduce-scatter's operand over the model axes (see
  ``_axes.other_axes_present``); an all-reduce keeps each device's shard.
  """
  index = _axes.axis_index(axis)
  group_of = np.zeros(sum(len(g) for g in groups), np.int32)
  for g, members in enumerate(groups):
    group_of[list(members)] = g
  mine = jnp.asarray(group_of)[index]
  spec = _axes.explicit_spec(x)
  if spec is not None:
    spec = jax.sharding.PartitionSpec(None, *spec)
  slots = jnp.zeros((len(groups),) + x.shape, x.dtype, out_sharding=spec)
  slots = jax.lax.dynamic_update_index_in_dim(slots, x, mine, axis=0)
  return jax.lax.dynamic_index_in_dim(
    jax.lax.psum(slots, axis), mine, axis=0, keepdims=False
  )


def _psum_leaf(y, varying: tuple, groups: tuple | None):
  """Sums ``y`` over the ``varying`` axes (within groups, if any)."""
  axis = _axes.as_axis(varying)
  if groups is None:
    return jax.lax.psum(y, axis)
  if _axes.vma_checked():
    if _axes.other_axes_present():
      return _grouped_psum_by_slots(y, axis, groups)
    return _grouped_psum_scatter_gather(y, axis, groups)
  try:
    return jax.lax.psum(y, axis, axis_index_groups=groups)
  except NotImplementedError as e:
    if not _axes.vmap_lacks_groups(e):
      raise
    # ``axis`` is a jax.vmap axis, whose collectives take no groups: one
    # psum over the whole axis, a slot per group (replicas on one device
    # move no bytes between them, so the slots cost memory only).
    return _grouped_psum_by_slots(y, axis, groups)


def reduce(
  tree: Any,
  axis_name: Any,
  *,
  reduction: str = "mean",
  axis_index_groups=None,
  comm_dtype=None,
) -> Any:
  """Sums or averages every leaf of ``tree`` across the replicas of an axis.

  Semantics, by where it runs and what the leaf is:

  ==========================================  ============  ===============
  where / leaf                                mean          sum
  ==========================================  ============  ===============
  ``pmap``, ``shard_map(check_vma=False)``    ``pmean``     ``psum``
  checking ``shard_map``, varying leaf        ``pmean``     ``psum``
  checking ``shard_map``, invariant leaf      ``x / n``     ``x``
  any mapping, groups, varying leaf           group mean    group sum
  any mapping, groups, invariant leaf         ValueError    ValueError
  ``axis_name=None`` (plain ``jit``)          identity      identity
  ==========================================  ============  ===============

  An *invariant* leaf under a checking ``shard_map`` is the gradient of
  replicated (``P()``) params: autodiff has already summed it over the axis,
  so the mean divides by the group size instead of calling ``pmean`` (which
  would multiply by ``n`` first). With ``axis_index_groups`` such a leaf
  cannot be split back into groups; cast the params to varying with
  ``jax.lax.pcast(params, axis, to="varying")`` before ``jax.grad``.

  Every member of a group ends with bit-identical values. ``None`` leaves and
  ``optax.MaskedNode`` pass through; a non-float leaf raises ``TypeError``
  naming its path.

  With ``comm_dtype`` (e.g. ``jnp.bfloat16``) each leaf is cast just before
  the collective and back just after. When the wire dtype is ``float16`` the
  leaf is divided by the group size before the collective so the sum cannot
  overflow (and multiplied back afterwards for ``"sum"``). A quantized
  ``comm_dtype`` (``jnp.int8``, ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``,
  ``jnp.int4`` or :func:`shardopt.quantized`) runs the two-phase reduction
  of the quantized wire (all_to_all, float32 reduction, requantize,
  all_gather) over all such leaves at once; every member of a group still
  ends with bit-identical values, within the error bound stated there. The
  sparse wire (:func:`shardopt.topk`) needs an error buffer, which a
  stateless ``reduce`` cannot keep: it raises ``ValueError`` naming the
  transforms that take it.

  Args:
    tree: a pytree of floating-point arrays (gradients, typically).
    axis_name: a ``pmap``/mesh axis name, a tuple of names, or None.
    reduction: ``"mean"`` or ``"sum"``.
    axis_index_groups: optional list of equal-size lists of replica indices
      that partition ``range(axis_size)``; each group reduces on its own.
    comm_dtype: optional wire dtype: floating (a cast) or quantized.

  Returns:
    A pytree like ``tree`` holding the reduced values.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, shardopt
    >>> f = jax.pmap(lambda g: shardopt.reduce(g, "i"), axis_name="i")
    >>> np.asarray(f(jnp.arange(8.0)))
    array([3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5], dtype=float32)
    >>> f = jax.pmap(lambda g: shardopt.reduce(
    ...     g, "i", reduction="sum", axis_index_groups=[[0, 2, 4, 6], [1, 3, 5, 7]]),
    ...     axis_name="i")
    >>> np.asarray(f(jnp.arange(8.0)))
    array([12., 16., 12., 16., 12., 16., 12., 16.], dtype=float32)
  """
  return reduce_for(
    _REDUCE,
    tree,
    axis_name,
    reduction=reduction,
    axis_index_groups=axis_index_groups,
    wire=_wire.of(comm_dtype, _REDUCE, axis_name),
  )


def reduce_for(
  transform: str,
  tree: Any,
  axis_name: Any,
  *,
  reduction: str = "mean",
  axis_index_groups=None,
  wire: _wire.Wire = _wire.dense.OWN,
) -> Any:
  """:func:`reduce` on ``wire`` (canonicalised by the caller with
  :func:`shardopt.wire.of`; by default each leaf's own dtype), whose error
  messages name ``transform`` (the shardopt transform that reduces, e.g.
  ``"shardopt.cross_shard_mean"``)."""
  reduced, _ = _reduce_tree(
    tree, None, axis_name, transform, reduction, axis_index_groups, wire
  )
  return reduced


def reduce_with_error(
  transform: str,
  tree: Any,
  error: Any,
  axis_name: Any,
  *,
  reduction: str = "mean",
  axis_index_groups=None,
  wire: _wire.Wire,
) -> tuple[Any, Any]:
  """:func:`reduce_for` with error feedback on a quantized or sparse wire.

  ``error`` is a tree like ``tree`` of float32 per-replica buffers: what the
  wire dropped from this replica's last contribution. Each leaf varying over
  every axis of ``axis_name`` sends ``x + error`` (``x + error_decay *
  error`` on the top-k wire) and keeps what the wire drops from it (the
  residuals of the quantized or top-k all-reduce); other leaves keep their
  buffer (on the top-k wire they travel dense, in float32). With
  ``axis_name=None`` nothing is sent, so nothing is dropped. See
  ``cross_shard_mean(error_feedback=True)``.

  Returns:
    ``(reduced, new_error)``, both trees like ``tree``.
  """
  return _reduce_tree(
    tree, error, axis_name, transform, reduction, axis_index_groups, wire
  )


def _reduce_tree(
  tree: Any,
  error: Any,
  axis_name: Any,
  transform: str,
  reduction: str,
  axis_index_groups,
  wire: _wire.Wire,
) -> tuple[Any, Any]:
  """:func:`reduce` of ``tree`` (plus ``error``, unless None) on ``wire``:
  ``(reduced, new_error)``, ``new_error`` None without ``error``."""
  _axes.check_reduction(reduction, transform, axis_name)
  if axis_name is None:
    if axis_index_groups is not None:
      raise ValueError(
        f"{transform}: axis_index_groups={axis_index_groups!r} needs a named"
        " axis, but axis_name=None. Pass the pmap/mesh axis name."
      )
    return tree, error  # identity: nothing is sent, nothing dropped
  size = _axes.axis_size(axis_name, transform)
  groups = _axes.validate_groups(axis_index_groups, size, transform, axis_name)
  members = _axes.group_size(groups, size)

  if error is not None and not wire.takes_error_feedback:
    raise ValueError(
      f"{transform}: error feedback needs a quantized comm_dtype (e.g."
      f" jnp.int8 or shardopt.quantized(jnp.int4)) or shardopt.topk(k), got"
      f" {wire.spec!r}."
    )
  if wire.needs_error_feedback and error is None and jax.tree.leaves(tree):
    raise ValueError(
      f"{transform}: comm_dtype={wire.spec!r} (axis {axis_name!r}) needs"
      " error feedback: the top-k wire drops most of every contribution and"
      " sends it later from a per-replica error buffer, which a stateless"
      " reduction cannot keep. Use a transform with error_feedback=True:"
      " shardopt.cross_shard_mean(axis, comm_dtype=shardopt.topk(k),"
      " error_feedback=True), cross_shard_sum, cross_shard, local_sgd,"
      " diloco or agn; or a dense comm_dtype (e.g. jnp.int8) here."
    )
  every_axis = len(_axes.axis_names(axis_name))
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  errors = (
    treedef.flatten_up_to(error)
    if error is not None
    else [None] * len(leaves_with_path)
  )
  out = [None] * len(leaves_with_path)
  new_errors = list(errors)
  queued = {}  # varying axes -> indices of the leaves wire.all_reduce takes

  for i, (path, x) in enumerate(leaves_with_path):
    _axes.check_float_leaf(path, x, transform, axis_name)
    varying, invariant = _axes.split_axes(x, axis_name)
    if invariant and groups is not None:
      raise ValueError(
        f"{transform}: the leaf at {jax.tree_util.keystr(path) or '<root>'} is"
        f" invariant over axis {_axes.as_axis(invariant)!r} (under shard_map,"
        " the gradient of replicated params is already summed over the whole"
        " axis by autodiff), so it cannot be reduced within"
        f" axis_index_groups={list(map(list, groups))!r}."
        f" Fix: cast the params with jax.lax.pcast(params, {axis_name!r},"
        " to='varying') before jax.grad, so each replica keeps its own"
        " gradient."
      )
    # A wire's own all-reduce takes the leaves it carries, all at once (the
    # top-k wire only those varying over every axis, which keep an error
    # buffer); every other leaf goes alone through XLA's all-reduce.
    if varying and wire.carries_leaf(x.size, len(varying) == every_axis):
      queued.setdefault(varying, []).append(i)
    elif varying:
      out[i] = wire.rest.reduce(
        x,
        lambda y, varying=varying: _psum_leaf(y, varying, groups),
        members,
        reduction,
      )
    # Invariant over every requested axis: already summed by autodiff.
    elif reduction == "mean":
      out[i] = x / jnp.asarray(members, x.dtype)
    else:
      out[i] = x

  for varying, indices in queued.items():
    # Only a leaf varying over every requested axis carries error feedback;
    # one invariant over some of them was summed there by autodiff already.
    feedback = error is not None and len(varying) == every_axis
    wire_axis = _axes.as_axis(varying)
    contributions = [leaves_with_path[i][1] for i in indices]
    if feedback:
      contributions = [
        _feedback.add(x, errors[i], wire)
        for i, x in zip(indices, contributions, strict=True)
      ]
    wire_members = (
      members
      if groups is not None
      else int(np.prod([_axes.axis_size(a, transform) for a in varying]))
    )
    result = wire.all_reduce(
      contributions,
      wire_axis,
      groups,
      wire_members,
      divisor=members if reduction == "mean" else 1,
      invariant_result=_axes.vma_checked() and groups is None,
      residuals=feedback,
    )
    reduced, residuals = result if feedback else (result, None)
    for k, i in enumerate(indices):
      x = leaves_with_path[i][1]
      out[i] = reduced[k].astype(x.dtype)
      if feedback:
        new_errors[i] = residuals[k]

  reduced_tree = treedef.unflatten(out)
  if error is None:
    return reduced_tree, None
  return reduced_tree, treedef.unflatten(new_errors)


def broadcast(tree: Any, axis_name: Any, *, source: int = 0) -> Any:
  """Every replica gets replica ``source``'s values, bit for bit.

  Implemented as a ``psum`` of the leaf's bit pattern (as an integer) masked
  to zero on every replica but ``source``: exactly one non-zero term, so the
  result is exact for every dtype (``-0.0`` and NaN payloads included). Leaves
  that a checking ``shard_map`` already types as invariant are returned as
  they are.

  Args:
    tree: a pytree of arrays.
    axis_name: the axis (or tuple of axes) to broadcast over.
    source: index of the replica whose values everyone receives.

  Returns:
    A pytree like ``tree`` holding ``source``'s values on every replica.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, shardopt
    >>> f = jax.pmap(lambda x: shardopt.broadcast(x, "i", source=3), axis_name="i")
    >>> np.asarray(f(jnp.arange(8.0)))
    array([3., 3., 3., 3., 3., 3., 3., 3.], dtype=float32)
  """
  name = "shardopt.broadcast"
  size = _axes.axis_size(axis_name, name)
  if (
    isinstance(source, bool)
    or not isinstance(source, (int, np.integer))
    or not (0 <= int(source) < size)
  ):
    raise ValueError(
      f"{name}: source={source!r} is not a replica index of axis"
      f" {axis_name!r} (size {size}); use 0 <= source < {size}."
    )
  is_source = _axes.axis_index(axis_name) == int(source)

  def leaf(x):
    x = jnp.asarray(x)
    varying, _ = _axes.split_axes(x, axis_name)
    if not varying:
      return x
    as_bool = x.dtype == jnp.bool_
    y = x.astype(jnp.int8) if as_bool else x
    bits = jax.lax.bitcast_convert_type(y, _bits_dtype(y.dtype))
    bits = jax.lax.psum(
      jnp.where(is_source, bits, jnp.zeros_like(bits)), axis_name
    )
    y = jax.lax.bitcast_convert_type(bits, y.dtype)
    return y.astype(jnp.bool_) if as_bool else y

  return jax.tree.map(leaf, tree)


def replica_divergence(tree: Any, axis_name: Any) -> jax.Array:
  """Largest absolute difference of any element across replicas (0.0 = in sync).

  The result is 0.0 exactly when every replica holds the same bits in every
  leaf. Elements whose bits differ but whose values compare equal (``0.0`` vs
  ``-0.0``, two different NaNs) count as the smallest positive float32; a NaN
  on some replicas and a number on others counts as ``inf``. Leaves that a
  checking ``shard_map`` types as invariant are in sync by construction.

  Args:
    tree: a pytree of arrays.
    axis_name: the axis (or tuple of axes) to compare over.

  Returns:
    A float32 scalar, the same on every replica.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, shardopt
    >>> f = jax.pmap(lambda x: shardopt.replica_divergence({"w": x}, "i"),
    ...              axis_name="i")
    >>> float(f(jnp.arange(8.0))[0])
    7.0
    >>> float(f(jnp.ones(8))[0])
    0.0
  """
  _axes.axis_size(axis_name, "shardopt.replica_divergence")
  tiny = jnp.finfo(jnp.float32).tiny
  out = jnp.zeros([], jnp.float32)
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    varying, _ = _axes.split_axes(x, axis_name)
    if not varying or x.size == 0:
      continue
    axis = _axes.as_axis(varying)
    y = x.astype(jnp.int8) if x.dtype == jnp.bool_ else x
    bits = jax.lax.bitcast_convert_type(y, _bits_dtype(y.dtype))
    same = jax.lax.pmax(bits, axis) == jax.lax.pmin(bits, axis)
    wide = y.astype(jnp.float64 if y.dtype == jnp.float64 else jnp.float32)
    diff = jnp.abs(jax.lax.pmax(wide, axis) - jax.lax.pmin(wide, axis))
    nan = jnp.isnan(wide).astype(jnp.int8)
    mixed_nan = jax.lax.pmax(nan, axis) != jax.lax.pmin(nan, axis)
    diff = jnp.where(jnp.isnan(diff) | mixed_nan, jnp.inf, diff)
    diff = jnp.where(same, 0.0, jnp.maximum(diff, tiny)).astype(jnp.float32)
    out = jnp.maximum(out, jnp.max(diff))
  return out
