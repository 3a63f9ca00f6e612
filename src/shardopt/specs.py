"""``state_specs``, ``vmap_axes``: which leaves of a state are per replica.

Under ``jax.shard_map`` every leaf of an optimizer state needs a
``PartitionSpec`` over the manual axes: ``P()`` for a leaf that is the same on
every replica (step counters, the state of an optimizer that sees reduced
gradients, DiLoCo's center) and ``P(axis)`` for one that each replica holds
for itself (a local optimizer's moments, PowerSGD's error feedback, the slice
``tower`` owns). :func:`state_specs` reads that from JAX's own type system
instead of a hand-written recipe per transform: it traces ``init`` and
``update`` abstractly inside a checking ``shard_map`` (nothing is computed, no
device memory is touched) and marks every state leaf that comes out typed
*varying* over the axis.

:func:`vmap_axes` is the same fact for ``jax.vmap`` (the route of MaxText
and drjax: replicas stacked on a leading axis, no ``shard_map``): ``0`` for a
per-replica leaf, ``None`` for a replicated one, as ``in_axes``/``out_axes``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardopt import _axes

_STATE_SPECS = "shardopt.state_specs"
_VMAP_AXES = "shardopt.vmap_axes"


def _mesh_for(
  fn: str, mesh: Any, params: Any, names: tuple, fallback: Any = None
) -> Any:
  """The mesh to trace on: ``mesh``, else the params', else the current one,
  else ``fallback``."""
  if mesh is None:
    for leaf in jax.tree.leaves(params):
      sharding = getattr(leaf, "sharding", None)
      if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        break
  if mesh is None:
    current = jax.sharding.get_abstract_mesh()
    if not current.empty:
      mesh = current
  if mesh is None:
    mesh = fallback
  if mesh is None:
    raise ValueError(
      f"{fn}: no mesh to trace on for axis {_axes.as_axis(names)!r}."
      " Pass mesh=jax.make_mesh(...), call it under `with jax.set_mesh(mesh):`,"
      " or pass params placed on the mesh (jax.device_put with a"
      " NamedSharding)."
    )
  missing = [n for n in names if n not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"{fn}: axis {_axes.as_axis(names)!r} is not an axis of the"
      f" mesh {dict(mesh.shape)!r} (missing {missing!r}); pass the name(s) of"
      " the axes the transform communicates over (the shard_map's manual axes,"
      " the vmap's axis_name)."
    )
  return mesh


def _local_struct(x: Any) -> jax.ShapeDtypeStruct:
  """``x`` as a ShapeDtypeStruct, keeping a NamedSharding over other axes."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    sharding = None
  return jax.ShapeDtypeStruct(
    jnp.shape(x), jnp.result_type(x), sharding=sharding
  )


def state_specs(
  tx: Any,
  params: Any,
  axis_name: Any,
  *,
  mesh: Any = None,
  params_axes: Any = None,
) -> Any:
  """The ``PartitionSpec`` of every leaf of ``tx``'s state over ``axis_name``.

  Use it for ``out_specs`` of a ``jax.shard_map`` over ``tx.init`` and for
  the state's ``in_specs``/``out_specs`` of the training step. A leaf is
  ``P(axis_name)`` when it is *per replica* (typed varying over the axis after
  ``init`` and ``update`` with per-replica gradients) and ``P()`` when it is
  the same on every replica. With a tuple of axes (``("island", "data")``) a
  leaf gets the subset of axes it varies over (``P("island")`` for the
  local state of ``diloco(cross_shard(adam, "data"), "island")``).

  Per-replica leaves are laid out the way ``jax.shard_map`` concatenates
  ``P(axis)`` blocks: the global array of a leaf whose per-replica shape is
  ``(d0, ...)`` has shape ``(n * d0, ...)``. That layout keeps donated
  buffers copy-free (a leading replica axis of size ``n`` squeezed inside
  makes XLA copy every donated buffer). Other mesh axes (a "model" axis in a
  partial-manual ``shard_map``) are not named in the specs: the arrays keep
  their shardings over them.

  It works for every shardopt transform and any ``optax.chain`` of them and
  of optax's transforms: nothing is special-cased, the specs come from JAX's
  varying-axis types (a checking ``shard_map``, ``check_vma=True``). The
  trace is abstract: ``params`` may be arrays or ``jax.ShapeDtypeStruct``\\ s.

  Args:
    tx: an optax transform whose ``init``/``update`` run over ``axis_name``.
    params: the params as one replica sees them inside the ``shard_map``
      (arrays or ``jax.ShapeDtypeStruct``; the per-replica block, not the
      stacked global array).
    axis_name: the manual axis name (or tuple of names) the transform
      communicates over.
    mesh: the mesh of the ``shard_map``; by default the mesh of ``params``
      (if they are placed on one), else the current ``jax.set_mesh`` mesh.
    params_axes: the axes (a subset of ``axis_name``) the params passed to
      ``update`` vary over; by default all of ``axis_name``. Give
      ``"island"`` for DiLoCo across islands whose params are ``P("island")``
      (replicated over ``"data"``). Gradients are always taken per replica.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``tx.init(params)``.

  Raises:
    ValueError: no mesh is given or found, ``axis_name`` is not one of its
      axes, or a scalar state leaf is per replica (it cannot be concatenated;
      give it shape ``(1,)``).

  Example:
    >>> import jax, optax, shardopt
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> params = {"w": jax.ShapeDtypeStruct((4, 3), "float32")}
    >>> specs = shardopt.state_specs(
    ...     shardopt.local_sgd(
    ...         optax.sgd(0.1, momentum=0.9), "data", sync_period=4),
    ...     params, "data", mesh=mesh)
    >>> specs.center, specs.local_state[0].trace, specs.count
    ({'w': P()}, {'w': P('data',)}, P())
    >>> shardopt.state_specs(shardopt.cross_shard(optax.adam(1e-3), "data"),
    ...                      params, "data", mesh=mesh)[0].mu
    {'w': P()}
  """
  names = _axes.axis_names(axis_name)
  state, axes = _varying_axes(
    _STATE_SPECS, tx, params, axis_name, mesh, params_axes
  )

  def spec(path, x, a):
    if not a:
      return P()
    if not jnp.ndim(x):
      raise ValueError(
        f"{_STATE_SPECS}: the state leaf at {jax.tree_util.keystr(path)} is a"
        f" scalar that differs per replica of axis {_axes.as_axis(names)!r};"
        " it cannot be laid out as concatenated P(axis) blocks. If the params"
        " are replicated over some of these axes, say so with params_axes;"
        " otherwise give the leaf shape (1,)."
      )
    ordered = tuple(n for n in names if n in a)
    return P(_axes.as_axis(ordered))

  return jax.tree_util.tree_map_with_path(spec, state, axes)


def vmap_axes(
  tx: Any,
  params: Any,
  axis_name: Any,
  *,
  axis_size: int | None = None,
  mesh: Any = None,
) -> Any:
  """The ``in_axes``/``out_axes`` of ``tx``'s state for ``jax.vmap``.

  The route of MaxText and drjax: the replicas are stacked on a leading axis
  and the step runs under ``jax.vmap(step, axis_name=axis_name,
  spmd_axis_name=...)`` inside ``jax.jit``, without ``jax.shard_map``. The
  state then needs one entry per leaf in the vmap's ``in_axes`` and
  ``out_axes``:

  - ``0``: the leaf is **per replica** (a local optimizer's moments, PowerSGD's
    error feedback, the slice ``tower`` owns). It is stacked: one row per
    replica on a leading axis of size ``axis_size``, mapped along axis 0.
  - ``None``: the leaf is **the same on every replica** (step counters,
    DiLoCo's center, the moments of an optimizer that sees reduced
    gradients). It is passed once, unbatched, and every replica reads it.

  The step counters must be ``None``. A counter decides the ``lax.cond`` that
  runs a sync (or not); under ``jax.vmap`` a ``lax.cond`` whose predicate is
  batched becomes a select that evaluates both branches, so the sync's
  collective would run on every step. shardopt raises a ``ValueError``
  instead when it sees a batched counter (the whole state vmapped with
  ``in_axes=0``); with these axes the predicate is unbatched, the cond stays a
  cond, and the collective runs only inside its branch, as under
  ``jax.shard_map``.

  It is :func:`state_specs` read for ``jax.vmap``: a leaf is ``0`` exactly
  where ``state_specs`` gives ``P(axis_name)`` and ``None`` where it gives
  ``P()``, from the same trace of JAX's varying-axis types (nothing is
  special-cased; any ``optax.chain`` works). A per-replica scalar is fine
  here (it is stacked to shape ``(axis_size,)``).

  Args:
    tx: an optax transform whose ``init``/``update`` run over ``axis_name``.
    params: the params as one replica sees them (arrays or
      ``jax.ShapeDtypeStruct``; one row of the stacked params, with their
      model shardings when each replica is sharded).
    axis_name: the vmap's ``axis_name``, a single name (``jax.vmap`` maps one
      axis).
    axis_size: the number of replicas; only needed when no mesh has
      ``axis_name`` (a plain ``jax.vmap`` without ``spmd_axis_name``). It
      traces on an abstract one-axis mesh of that size.
    mesh: the mesh whose ``axis_name`` axis the vmap's ``spmd_axis_name``
      maps to; by default the mesh of ``params``, else the current
      ``jax.set_mesh`` mesh.

  Returns:
    A pytree with the structure of ``tx.init(params)`` whose leaves are ``0``
    or ``None`` (a tree prefix ``jax.vmap`` accepts as ``in_axes`` and
    ``out_axes``).

  Raises:
    ValueError: ``axis_name`` is None or a tuple, or there is no mesh with
      ``axis_name`` and no ``axis_size``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, shardopt
    >>> tx = shardopt.local_sgd(optax.sgd(1.0, momentum=0.5), "data",
    ...                         sync_period=2)
    >>> params = {"w": jnp.zeros(1)}
    >>> axes = shardopt.vmap_axes(tx, params, "data", axis_size=4)
    >>> axes.count, axes.center, axes.local_state[0].trace
    (None, {'w': None}, {'w': 0})
    >>> state = jax.vmap(tx.init, in_axes=None, out_axes=axes,
    ...                  axis_name="data", axis_size=4)(params)
    >>> def step(p, s, g):
    ...   updates, s = tx.update(g, s, p)
    ...   return optax.apply_updates(p, updates), s
    >>> step = jax.jit(jax.vmap(step, in_axes=(0, axes, 0),
    ...                         out_axes=(0, axes), axis_name="data"))
    >>> p = {"w": jnp.zeros((4, 1))}
    >>> g = {"w": jnp.array([[0.0], [2.0], [4.0], [6.0]])}
    >>> for _ in range(2):  # two local steps, then the sync averages
    ...   p, state = step(p, state, g)
    >>> p["w"].ravel()  # -(1 + 1.5) * mean(g) on every replica
    Array([-7.5, -7.5, -7.5, -7.5], dtype=float32)

    With the whole state batched (``in_axes=0``) the counter is batched and
    the step raises the ``ValueError`` above.
  """
  if axis_name is None or isinstance(axis_name, (tuple, list)):
    raise ValueError(
      f"{_VMAP_AXES}: axis_name={axis_name!r}; jax.vmap maps one named axis:"
      " pass the single name given to jax.vmap(..., axis_name=...)."
    )
  fallback = None
  if axis_size is not None:
    fallback = jax.sharding.AbstractMesh((int(axis_size),), (axis_name,))
  _, axes = _varying_axes(
    _VMAP_AXES, tx, params, axis_name, mesh, None, fallback
  )
  return jax.tree.map(lambda a: 0 if a else None, axes)


def _varying_axes(
  fn: str,
  tx: Any,
  params: Any,
  axis_name: Any,
  mesh: Any,
  params_axes: Any,
  fallback: Any = None,
) -> tuple[Any, Any]:
  """The state's abstract structure, and the manual axes each leaf varies over.

  Returns ``(state, axes)``: ``state`` the ``ShapeDtypeStruct`` of every leaf
  of ``tx.init(params)``, ``axes`` a ``frozenset`` of names of ``axis_name``
  per leaf (empty for a leaf the same on every replica). ``fn`` is the public
  function to name in errors; ``fallback`` the mesh to trace on when none is
  given or found. :func:`state_specs` and :func:`vmap_axes` are two views of
  this one derivation, in three steps:

  1. the axes: ``axis_name`` (the manual axes) and ``params_axes`` (those
     the params vary over, a subset);
  2. :func:`_abstract_state`: ``tx.init`` traced abstractly on the mesh;
  3. :func:`_update_axes`: ``tx.update`` traced until the axes each state
     leaf varies over stop growing.
  """
  if axis_name is None:
    raise ValueError(
      f"{fn}: axis_name=None: without a manual axis every state leaf"
      " is replicated; no specs are needed (use P() or the params' shardings)."
    )
  names = _axes.axis_names(axis_name)
  over = names if params_axes is None else _axes.axis_names(params_axes)
  if not set(over) <= set(names):
    raise ValueError(
      f"{fn}: params_axes={params_axes!r} must be a subset of"
      f" axis_name={axis_name!r}."
    )
  mesh = _mesh_for(fn, mesh, params, names, fallback)
  params = jax.tree.map(_local_struct, params)
  state = _abstract_state(tx, params, mesh, set(names))
  return state, _update_axes(tx, params, state, names, over, mesh)


def _trace(mesh: Any, manual: set, fn, *args) -> Any:
  """Runs ``fn`` once, abstractly, inside a checking partial-manual
  shard_map over ``manual`` whose inputs are all ``P()``; returns what
  ``fn`` returned (any pytree, not only arrays)."""
  record = []

  def body(*inputs):
    record.append(fn(*inputs))
    return jnp.zeros(())

  jax.eval_shape(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=tuple(P() for _ in args),
      out_specs=P(),
      axis_names=manual,
      check_vma=True,
    ),
    *args,
  )
  return record[0]


def _abstract_state(tx: Any, params: Any, mesh: Any, manual: set) -> Any:
  """``tx.init(params)`` as ``ShapeDtypeStruct`` leaves, sharded over the
  mesh's other (Auto) axes as ``init`` left them."""

  def structure(tree):
    return jax.tree.map(
      lambda x: _Leaf(x.shape, x.dtype, jax.typeof(x).sharding.spec), tree
    )

  return jax.tree.map(
    lambda t: jax.ShapeDtypeStruct(
      t.shape,
      t.dtype,
      sharding=jax.sharding.NamedSharding(mesh, _auto_only(t.spec, manual)),
    ),
    _trace(mesh, manual, lambda p: structure(tx.init(p)), params),
    is_leaf=lambda t: isinstance(t, _Leaf),
  )


def _update_axes(
  tx: Any, params: Any, state: Any, names: tuple, over: tuple, mesh: Any
) -> Any:
  """Per state leaf, the manual axes ``tx.update`` makes it vary over.

  The least fixed point: feed the state in with every leaf invariant, mark
  what update makes varying, feed those in varying, and so on until nothing
  changes (a leaf only ever gains axes). init's own types say nothing: it
  may copy per-replica params into a leaf that update keeps replicated.
  The gradients vary over every manual axis, the params over ``over``.
  """
  manual = set(names)

  def per_replica(p, axes=names):
    return jax.lax.pcast(p, _axes.as_axis(axes), to="varying") if axes else p

  def varying(tree):
    return jax.tree.map(lambda x: _axes.varying_axes(x) & manual, tree)

  axes = jax.tree.map(lambda _: frozenset(), state)
  for _ in range(len(jax.tree.leaves(state)) + 2):

    def step(p, s, axes=axes):
      s = jax.tree.map(
        lambda x, a: _axes.cast_varying(x, a) if a else x, s, axes
      )
      _, new_state = tx.update(per_replica(p), s, per_replica(p, over))
      return varying(new_state)

    merged = jax.tree.map(
      lambda a, b: a | b, axes, _trace(mesh, manual, step, params, state)
    )
    if merged == axes:
      break
    axes = merged
  return axes


class _Leaf(NamedTuple):
  shape: tuple
  dtype: Any
  spec: Any


def _auto_only(spec: P, manual: set) -> P:
  """``spec`` without the manual axes (they are not named in a P() input)."""

  def keep(entry):
    if entry is None:
      return None
    entries = entry if isinstance(entry, tuple) else (entry,)
    left = tuple(e for e in entries if e not in manual)
    if not left:
      return None
    return left[0] if len(left) == 1 else left

  return P(*(keep(e) for e in spec))
