"""Axis facts in one place: binding, sizes, varying/invariant detection, groups.

Every other module asks this one. When a JAX upgrade moves where the varying
axes of a value are recorded, only :func:`varying_axes` and :func:`vma_checked`
change (``tests/test_axes.py`` fails loudly if they stop working).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _args
from shardopt import _jax

AxisName = Hashable | tuple
Groups = Sequence[Sequence[int]] | None

REDUCTIONS = ("mean", "sum")


class AxisNotBoundError(NameError):
  """Raised when a transform needs a named axis that the current trace lacks."""


def axis_names(axis_name: AxisName) -> tuple:
  """Returns ``axis_name`` as a tuple of names (a single name becomes a 1-tuple)."""
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def check_reduction(
  reduction: Any, transform: str | None = None, axis_name: AxisName = None
) -> str:
  """Validates ``reduction``; raises ``ValueError("Unsupported reduction: ...")``.

  ``transform`` (and its ``axis_name``), when given, are named in the message.
  """
  if not isinstance(reduction, str) or reduction not in REDUCTIONS:
    where = f" in {transform} (axis {axis_name!r})" if transform else ""
    raise ValueError(
      f"Unsupported reduction: {reduction!r}{where}. Use one of {REDUCTIONS}:"
      " 'mean' averages over replicas (TF's ReductionV2.MEAN), 'sum' adds"
      " them up."
    )
  return reduction


def axis_size(axis_name: AxisName, transform: str) -> int:
  """Size of the (possibly tuple) named axis, or a clear error if unbound."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except (NameError, ValueError) as e:
    # An unbound name raises NameError; an integer, which jax reads as a
    # positional axis, "axis 3 is out of bounds" (ValueError).
    raise AxisNotBoundError(
      f"{transform}: axis name {axis_name!r} is not bound here. Call it inside"
      f" jax.pmap(..., axis_name={axis_name!r}) or inside jax.shard_map over a"
      f" mesh with an axis named {axis_name!r}; under plain jax.jit over sharded"
      " arrays pass axis_name=None (the compiler already reduces)."
    ) from e


def axis_index(axis_name: AxisName) -> jax.Array:
  """This replica's index along the (possibly tuple) named axis."""
  return jax.lax.axis_index(axis_name)


def vma_checked() -> bool:
  """True inside a ``jax.shard_map`` whose trace checks varying axes (check_vma).

  Under ``pmap`` and ``shard_map(check_vma=False)`` the value is False: there
  every value is per-replica and no type says which values are replicated.
  """
  return bool(jax.config.values.get("check_vma", False))


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes over which ``x`` is typed as varying (may be empty)."""
  # A ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape``) carries its type
  # itself; ``jax.typeof`` of one asserts in a partial-manual shard_map over
  # an Auto mesh (JAX 0.10), so read it directly.
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:  # JAX 0.10+
    return frozenset(mat.varying)
  vma = getattr(aval, "vma", None)  # JAX 0.6 - 0.9
  return frozenset(vma) if vma is not None else frozenset()


def cast_varying(x: Any, axes) -> Any:
  """Types ``x`` as varying over every axis in ``axes`` (a checking shard_map).

  Axes ``x`` already varies over are left alone, so this is the identity for
  a value that is varying everywhere already. Used where two values must
  agree on their types: the branches of a ``lax.cond``, or an all-gather that
  needs a varying operand.
  """
  missing = tuple(a for a in sorted(axes, key=str) if a not in varying_axes(x))
  if not missing:
    return x
  return jax.lax.pcast(x, as_axis(missing), to="varying")


def split_axes(x: Any, axis_name: AxisName) -> tuple[tuple, tuple]:
  """Splits the requested axes into (varying, invariant) for leaf ``x``.

  Outside a checking trace (``pmap``, ``shard_map(check_vma=False)``) every
  value is treated as a per-replica value: all axes are "varying".
  Inside a checking shard_map, an axis the leaf is invariant over is one that
  autodiff has already summed over (the gradient of replicated params).
  """
  names = axis_names(axis_name)
  if not vma_checked():
    return names, ()
  vary = varying_axes(x)
  return (
    tuple(a for a in names if a in vary),
    tuple(a for a in names if a not in vary),
  )


def other_axes_present() -> bool:
  """True inside a partial-manual ``jax.shard_map`` whose mesh has axes of
  size > 1 left to the compiler (a model axis sharding the params).

  There, XLA's SPMD partitioner (jax 0.10, CPU) replicates the operand of a
  reduce-scatter or all-gather over a manual axis across the other axes
  (all-gathers over the model axis), while an all-reduce keeps each device's
  model shard: transforms then build their collectives from all-reduces.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  return any(
    kind != jax.sharding.AxisType.Manual and size > 1
    for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
  )


def explicit_spec(x: Any):
  """``x``'s PartitionSpec over Explicit mesh axes, or None if it has none.

  Inside a partial-manual ``jax.shard_map`` over a mesh whose other axes are
  ``AxisType.Explicit``, a model-sharded leaf's type names those axes
  (``float32[16,32@model]``). Under Auto axes, ``pmap`` and full-manual
  ``shard_map`` there is nothing to read, and this returns None.
  """
  try:
    if isinstance(x, jax.ShapeDtypeStruct):
      spec = x.sharding.spec
    else:
      spec = jax.typeof(x).sharding.spec
  except (AttributeError, TypeError):
    return None
  if all(entry is None for entry in spec):
    return None
  return spec


def as_axis(names: tuple) -> AxisName:
  """Inverse of :func:`axis_names` for collectives: 1-tuples become a name."""
  return names[0] if len(names) == 1 else names


def validate_groups(
  axis_index_groups: Groups, size: int, transform: str, axis_name: AxisName
) -> tuple | None:
  """Checks ``axis_index_groups`` against an axis of ``size`` replicas.

  Groups must be a list of lists of ints that uses every index of
  ``range(size)`` exactly once (duplicates are rejected, unlike TensorFlow's
  set comparison), with all groups the same size.

  Returns:
    The groups as a tuple of tuples of ints, or None when no groups were given.
  """
  if axis_index_groups is None:
    return None
  where = (
    f"{transform}: axis_index_groups for axis {axis_name!r} of size {size}"
  )
  if (
    isinstance(axis_index_groups, (str, bytes))
    or not isinstance(axis_index_groups, (Sequence, np.ndarray))
    or len(axis_index_groups) == 0
  ):
    raise ValueError(
      f"{where} must be a non-empty list of lists of replica indices, got"
      f" {axis_index_groups!r}; e.g. [[0, 1], [2, 3]] for 4 replicas in pairs."
    )
  groups = []
  for group in axis_index_groups:
    if (
      isinstance(group, (str, bytes))
      or not isinstance(group, (Sequence, np.ndarray))
      or len(group) == 0
    ):
      raise ValueError(
        f"{where}: group {group!r} is not a non-empty list of replica indices."
      )
    members = []
    for i in group:
      if not _args.is_integer(i):
        raise ValueError(
          f"{where}: group {list(group)!r} holds {i!r}, which is"
          " not an integer replica index."
        )
      if not 0 <= int(i) < size:
        raise ValueError(
          f"{where}: group {list(group)!r} holds index {int(i)},"
          f" outside range(0, {size})."
        )
      members.append(int(i))
    groups.append(tuple(members))
  seen = {}
  for group in groups:
    for i in group:
      if i in seen:
        raise ValueError(
          f"{where}: index {i} appears more than once (in group"
          f" {list(seen[i])!r} and group {list(group)!r}); every replica must"
          " belong to exactly one group."
        )
      seen[i] = group
  missing = sorted(set(range(size)) - set(seen))
  if missing:
    raise ValueError(
      f"{where}: indices {missing} are in no group; the groups must cover"
      f" every index of range(0, {size}) exactly once."
    )
  sizes = {len(g) for g in groups}
  if len(sizes) != 1:
    odd = next(g for g in groups if len(g) != len(groups[0]))
    raise ValueError(
      f"{where}: groups have different sizes {sorted(sizes)} (group"
      f" {list(groups[0])!r} vs group {list(odd)!r}); all groups must be the"
      " same size."
    )
  return tuple(groups)


def group_size(groups: tuple | None, size: int) -> int:
  """Number of replicas a value is reduced over."""
  return len(groups[0]) if groups else size


def check_float_leaf(
  path, leaf, transform: str, axis_name: AxisName = None
) -> None:
  """Raises ``TypeError`` naming the leaf's path if it is not floating point."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    across = f" of axis {axis_name!r}" if axis_name is not None else ""
    raise TypeError(
      f"{transform}: leaf at {jax.tree_util.keystr(path) or '<root>'} has"
      f" dtype {dtype if dtype is not None else type(leaf).__name__}; only"
      f" floating-point leaves can be reduced across the replicas{across}."
      " Drop it from the gradient tree, or wrap the transform in"
      " optax.masked(...) so it only sees float leaves."
    )


def check_transform(inner: Any, transform: str, arg: str = "inner") -> None:
  """Raises ``TypeError`` unless ``inner`` is an optax transform.

  Anything with callable ``init`` and ``update`` passes
  (``optax.GradientTransformation`` and its ``ExtraArgs`` variant).
  """
  if not (
    callable(getattr(inner, "init", None))
    and callable(getattr(inner, "update", None))
  ):
    raise TypeError(
      f"{transform}: {arg}={inner!r} is not an optax transform (an object"
      " with init and update, such as optax.adam(1e-3)); pass the built"
      " transform, e.g. optax.adam(1e-3) rather than optax.adam, and"
      " optax.chain(a, b) rather than a tuple (a, b)."
    )


def accumulation_dtype(dtype) -> np.dtype:
  """float32 for low-precision floats (bf16, f16), the dtype itself otherwise.

  The dtype in which gradients are summed over steps (accumulators, error
  feedback, pseudo-gradients), so that many small terms do not vanish.
  """
  return jnp.promote_types(dtype, jnp.float32)


def explicit_axes_present() -> bool:
  """True when the current mesh has an ``AxisType.Explicit`` axis (a
  partial-manual shard_map over an Explicit mesh), where types carry
  shardings that both branches of a cond must agree on."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and any(
    kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types
  )


def cast_tree_like(tree: Any, *likes: Any) -> Any:
  """Casts each leaf of ``tree`` to be varying wherever a ``likes`` leaf is.

  ``likes`` are pytrees of the same structure as ``tree`` (arrays or
  ``jax.eval_shape`` results); a ``None`` in ``likes`` is skipped. The identity
  outside a checking shard_map. Under Explicit model axes, a leaf with no
  sharding over them (zeros built from a shape) also takes the sharding of
  a ``likes`` leaf that has one, so both branches of a cond agree.
  """
  explicit = explicit_axes_present()
  if not vma_checked() and not explicit:
    return tree
  likes = tuple(like for like in likes if like is not None)

  def leaf(x, *others):
    if explicit and explicit_spec(x) is None:
      spec = next(
        (s for s in map(explicit_spec, others) if s is not None), None
      )
      if spec is not None:
        x = jax.sharding.reshard(x, spec)
    if not vma_checked():
      return x
    axes = frozenset().union(*(varying_axes(o) for o in others))
    return cast_varying(x, axes)

  return jax.tree.map(leaf, tree, *likes)


def batched_by_vmap(x: Any) -> bool:
  """True when ``x`` is batched by an enclosing ``jax.vmap``.

  JAX turns a ``lax.cond`` whose predicate is batched into a select of both
  branches: a collective in the taken-on-sync branch would then run on
  every step. Read from the tracer's type, through
  :func:`shardopt._jax.batched_by_vmap` (a private JAX name, with a
  fallback; ``tests/test_jax_internals.py`` fails loudly if it moves).
  """
  return _jax.batched_by_vmap(x)


def vmap_lacks_groups(error: Exception) -> bool:
  """True for JAX's error on a collective with ``axis_index_groups`` over a
  ``jax.vmap`` axis (JAX 0.10: "axis_index_groups not supported in vmap
  collectives")."""
  return isinstance(error, NotImplementedError) and (
    "axis_index_groups" in str(error) and "vmap" in str(error)
  )


_SOME_GROUPS = object()  # grouped()'s default: groups somewhere inside


def grouped(collective, what: str, fix: str = "", *, groups=_SOME_GROUPS):
  """Runs ``collective()``, which holds collectives with
  ``axis_index_groups``; over a ``jax.vmap`` axis, where JAX has none,
  raises shardopt's error naming ``what`` and the fix (run the replicas
  under pmap or shard_map; ``fix`` adds another).

  ``groups`` given says ``collective()`` is one collective with those
  groups: ``None`` runs it as it is, and any NotImplementedError it raises
  is vmap's (its all_to_all says only "Please open a feature request!").
  """
  if groups is None:
    return collective()
  try:
    return collective()
  except NotImplementedError as e:
    if groups is _SOME_GROUPS and not vmap_lacks_groups(e):
      raise
    raise NotImplementedError(
      f"shardopt: {what} cannot run over a jax.vmap axis: JAX has no"
      " grouped collectives (axis_index_groups) under vmap. Run the"
      f" replicas under jax.pmap or jax.shard_map{fix}."
    ) from e


def check_replicated_predicate(pred: Any, transform: str) -> None:
  """Raises ``ValueError`` if the predicate of a communicating cond is
  batched by ``jax.vmap`` (a per-replica counter under
  ``jax.vmap(..., axis_name=...)``): the collective would run every step."""
  if batched_by_vmap(pred):
    raise ValueError(
      f"{transform}: the step counter deciding when to communicate is"
      " batched by jax.vmap (the state was vmapped over a replica axis)."
      " Under jax.vmap JAX evaluates both branches of a lax.cond with a"
      " batched predicate, so the collective would run on every step."
      " Run the step under jax.shard_map (or jax.pmap) over the axis"
      " instead; or, under jax.vmap, keep the counters unbatched"
      " (in_axes=None for the state's scalar counters)."
    )


def cond_same_types(
  pred: Any,
  true_fn,
  false_fn,
  *,
  true_types: Any = None,
  transform: str = "shardopt",
) -> Any:
  """``jax.lax.cond(pred, true_fn, false_fn)`` whose branches agree on types.

  Under a checking shard_map the branches of a ``lax.cond`` must return the
  same varying axes, but a branch that reduces returns invariant values and
  one that passes state through may return varying ones. Each output leaf of
  both branches is cast to the union of the two branches' varying axes. Pass
  ``true_types`` (``jax.eval_shape(true_fn)``) when the caller has it already.
  """
  check_replicated_predicate(pred, transform)
  if not vma_checked() and not explicit_axes_present():
    return jax.lax.cond(pred, true_fn, false_fn)
  if true_types is None:
    true_types = jax.eval_shape(true_fn)
  false_types = jax.eval_shape(false_fn)
  return jax.lax.cond(
    pred,
    lambda: cast_tree_like(true_fn(), true_types, false_types),
    lambda: cast_tree_like(false_fn(), true_types, false_types),
  )


def scalar_counter(
  count: Any, transform: str, field: str, axis_name: AxisName = None
) -> jax.Array:
  """The value of a step counter, as a scalar, however the state arrived.

  Step counters are the same on every replica by construction, so a counter
  typed varying (the whole state under ``P(axis)`` in ``jax.shard_map``) is
  as good as a replicated one; stacked under that spelling it arrives with
  shape ``(1,)``. Anything with more than one element is an error that gives
  the specs to use (naming ``axis_name`` when given).
  """
  if jnp.size(count) != 1:
    axis = repr(axis_name) if axis_name is not None else "axis"
    raise ValueError(
      f"{transform}: {field} has shape {jnp.shape(count)}, expected one step"
      " count per replica (a scalar, the same on every replica). Under"
      " jax.shard_map pass the state's scalar counters with spec P() and the"
      f" other leaves with P({axis}); or stack the whole state"
      " (jax.vmap(tx.init) over a leading replica axis) and pass every leaf"
      f" with P({axis}); under jax.pmap build the state with"
      " jax.pmap(tx.init)."
    )
  return jnp.reshape(count, ())
