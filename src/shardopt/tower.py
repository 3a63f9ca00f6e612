"""TowerOptimizer as an optax transform: reduce once, update once per slice.

TensorFlow's ``tf.contrib.estimator.TowerOptimizer`` "gathers gradients from
all towers and reduces them in the last one", so the wrapped optimizer applies
once. :func:`tower` makes "apply once" literal and cheap: each replica owns
``1/n`` of every leaf (the leaf flattened and zero-padded to a multiple of the
axis size ``n``), reduces only that slice (``psum_scatter``), runs the inner
optimizer on it with a state that holds only that slice, and all-gathers the
updates. The optimizer's work and memory are split ``n`` ways instead of
repeated ``n`` times; the bytes on the wire equal one all-reduce.

The result equals :func:`shardopt.cross_shard` for every *elementwise*
optimizer. A transform that needs a whole-tree statistic sees only the owned
slice inside :func:`tower`; :func:`clip_by_global_norm` is the sharding-aware
global-norm clip.

The examples below assume 8 devices, e.g. a CPU forced to show them with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before importing jax.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _axes
from shardopt import _shapes
from shardopt import wire

_TOWER = "shardopt.tower"
_CLIP = "shardopt.clip_by_global_norm"


# --- The owned-slice layout: one place for "which part of a leaf is mine". ---
#
# Each leaf is viewed with one extra dimension of size n (the number of
# owners) and replica i owns index i along it. The owned chunk has the shape
# ``shape[:d] + (shape[d] // n,) + shape[d + 1:]`` for the first dimension
# ``d`` whose size is a multiple of n (under an Explicit mesh, one whose model
# sharding also divides ``shape[d] // n``), and ``(ceil(size / n),)`` for any
# other leaf (a scalar, a shape with no such dimension). Which elements it
# holds is decided by :func:`_layout` alone, in one of two layouts:
#
# * Contiguous (owner-major), everywhere but in model-parallel replicas: the
#   leaf is flattened (row-major), zero-padded to a multiple of n and viewed
#   as ``(n, ceil(size / n))``; replica i owns the contiguous block i, held
#   in the chunk's shape (for ``d = 0``: rows ``i * shape[0] // n`` up to
#   ``(i + 1) * shape[0] // n``). The reduce-scatter and the all-gather then
#   move contiguous blocks along the major dimension and XLA adds no layout
#   copy (transpose) around them, as in shardopt 0.1.
# * Strided (owner-minor), in model-parallel replicas (a partial-manual
#   shard_map whose mesh has other axes left to the compiler, see
#   ``_axes.other_axes_present``, or a leaf split over Explicit mesh axes):
#   dimension ``d`` is viewed as ``(shape[d] // n, n)`` and replica i owns
#   every n-th slice along it (slices i, i + n, i + 2n, ...). The leaf keeps
#   its other dimensions and each owned slice lies inside each device's own
#   model block, so a leaf sharded over a model axis (tensor parallel, FSDP)
#   is sliced there: XLA neither gathers nor reshuffles it over the model
#   axis, and every device holds 1 / (n * model degree) of the leaf's
#   optimizer state. A leaf with no such ``d`` is flattened, zero-padded and
#   viewed as ``(ceil(size / n), n)``.
#
# The owned chunk is the view indexed at ``axis_index`` along the owners'
# dimension (reshaped to the chunk's shape): what ``psum_scatter(...,
# scatter_dimension=k)`` leaves on the replica and what ``all_gather(...,
# axis=k)`` puts back in place.


def _model_degree(x: Any, dim: int) -> int:
  """How many ways dimension ``dim`` of ``x`` is split over Explicit mesh
  axes (1 when its type says nothing, as under Auto axes or pmap)."""
  spec = _axes.explicit_spec(x)
  entry = spec[dim] if spec is not None and dim < len(spec) else None
  if entry is None:
    return 1
  mesh = jax.sharding.get_abstract_mesh()
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[name] for name in names]))


def _owned_dim(x: Any, num_owners: int) -> int | None:
  """The dimension sliced for ``x`` (see above), or None to flatten."""
  for dim, size in enumerate(np.shape(x)):
    if size >= num_owners and size % num_owners == 0:
      if (size // num_owners) % _model_degree(x, dim) == 0:
        return dim
  return None


class _Layout(NamedTuple):
  """How a leaf is split among the owners (see above)."""

  flat: bool  # the view is of the flattened, zero-padded leaf
  view: tuple  # the shape the leaf (or its flattening) is viewed as
  owners: int  # the owners' dimension in ``view``
  chunk: tuple  # the owned chunk's shape


def _layout(x: Any, num_owners: int) -> _Layout:
  """The layout of ``x``'s owned chunks: the one place that picks the
  contiguous or the strided layout (see above)."""
  shape = tuple(np.shape(x))
  dim = _owned_dim(x, num_owners)
  size = -(-math.prod(shape) // num_owners)  # elements per owner
  if dim is None:
    chunk = (size,)
  else:
    chunk = shape[:dim] + (shape[dim] // num_owners,) + shape[dim + 1 :]
  if not _axes.other_axes_present() and all(
    _model_degree(x, d) == 1 for d in range(len(shape))
  ):
    return _Layout(True, (num_owners, size), 0, chunk)
  if dim is None:
    return _Layout(True, (size, num_owners), 1, chunk)
  view = shape[:dim] + (shape[dim] // num_owners, num_owners) + shape[dim + 1 :]
  return _Layout(False, view, dim + 1, chunk)


def _owners_view(x: jax.Array, layout: _Layout) -> jax.Array:
  """``x`` viewed as ``layout.view`` (flattened and zero-padded first if the
  layout says so)."""
  if layout.flat:
    if _axes.explicit_spec(x) is not None:
      # No dimension to slice inside the model blocks: this leaf is gathered
      # over its Explicit axes (the one case tower communicates over them).
      x = jax.sharding.reshard(x, jax.sharding.PartitionSpec())
    flat = jnp.reshape(x, (-1,))
    pad = math.prod(layout.view) - flat.size
    x = jnp.pad(flat, (0, pad)) if pad else flat
  return jnp.reshape(x, layout.view)


def _owned_slice(x: jax.Array, axis_name: Any, num_owners: int) -> jax.Array:
  """This replica's chunk of ``x`` (no communication)."""
  layout = _layout(x, num_owners)
  owned = jax.lax.dynamic_index_in_dim(
    _owners_view(x, layout),
    _axes.axis_index(axis_name),
    axis=layout.owners,
    keepdims=False,
  )
  return jnp.reshape(owned, layout.chunk)


def _owned_sum(
  y: jax.Array, names: tuple, varying: tuple, sizes: tuple, num_owners: int
) -> jax.Array:
  """Sum of ``y`` over the ``varying`` axes, keeping only the owned chunk.

  Axes of ``names`` not in ``varying`` are ones ``y`` is invariant over (under
  a checking shard_map: already summed by autodiff); along them the chunk is
  selected without communication.
  """
  if _axes.other_axes_present():
    # Model-parallel replicas: an all-reduce of this device's model shard,
    # then the owned chunk, with no collective over the model axes (see
    # _axes.other_axes_present); twice a reduce-scatter's bytes.
    total = jax.lax.psum(y, _axes.as_axis(varying))
    return _owned_slice(total, _axes.as_axis(names), num_owners)
  layout = _layout(y, num_owners)
  view, dim = _owners_view(y, layout), layout.owners
  shape = view.shape
  if len(varying) == len(names):
    # tiled=True keeps the owners' dimension (size 1); the reshape drops it.
    owned = jax.lax.psum_scatter(
      view, _axes.as_axis(names), scatter_dimension=dim, tiled=True
    )
    return jnp.reshape(owned, layout.chunk)
  # Mixed: split the owners' dimension into one per axis (row-major, as
  # axis_index orders a tuple of axes) and pick this replica's index along
  # each, summing along the varying ones.
  blocks = jnp.reshape(view, shape[:dim] + sizes + shape[dim + 1 :])
  for offset, name in enumerate(names):
    if name in varying:
      blocks = jax.lax.psum_scatter(
        blocks, name, scatter_dimension=dim + offset, tiled=True
      )
    else:
      blocks = jax.lax.dynamic_slice_in_dim(
        blocks, jax.lax.axis_index(name), 1, axis=dim + offset
      )
  return jnp.reshape(blocks, layout.chunk)


def _owned_sum_on_wire(
  g: jax.Array,
  names: tuple,
  varying: tuple,
  num_owners: int,
  on_wire: wire.Wire,
  reduction: str,
) -> jax.Array:
  """The owned chunk of the sum (or mean) of ``g`` over a wire that runs its
  own collectives (:meth:`shardopt.wire.Wire.reduce_scatter`; quantized:
  each replica sends every owner its chunk in blocks with float32 scales,
  and the owner sums them in float32). The updates then travel back exact
  (all-gather)."""
  layout = _layout(g, num_owners)
  if len(varying) != len(names) or not (layout.flat and layout.owners == 0):
    raise NotImplementedError(
      f"{_TOWER}: comm_dtype={on_wire.spec!r} on axis"
      f" {_axes.as_axis(names)!r}: a quantized reduce-scatter is"
      " implemented for gradients varying over"
      " every axis of axis_name, on replicas that are not model-parallel;"
      f" here the gradient varies over {varying!r} only, or the replicas"
      " are sharded over a model axis. Use a float comm_dtype (e.g."
      " jnp.bfloat16) there, or shardopt.cross_shard(inner, axis,"
      " comm_dtype=...)."
    )
  rows = _owners_view(g, layout)
  owned = on_wire.reduce_scatter(
    rows,
    _axes.as_axis(names),
    divisor=num_owners if reduction == "mean" else 1,
  )
  return jnp.reshape(owned, layout.chunk).astype(g.dtype)


def _unshard(
  chunk: jax.Array, like: jax.Array, axis_name: Any, num_owners: int
) -> jax.Array:
  """All-gathers the owned chunks into a leaf shaped like ``like``.

  Under a checking shard_map the result is typed invariant
  (``to="invarying"``), so replicated ``P()`` params can stay ``P()``; every
  replica holds the same bits by construction.
  """
  if like.size == 0:
    return jnp.zeros(like.shape, chunk.dtype)
  layout = _layout(like, num_owners)
  gather_dim = layout.owners
  # A state stacked under shard_map (counters of shape (1,)) can broadcast
  # inner's updates to a leading 1: back to the owned chunk, in the view's
  # shape without the owners' dimension.
  chunk = jnp.reshape(
    chunk, layout.view[:gather_dim] + layout.view[gather_dim + 1 :]
  )
  if _axes.other_axes_present():
    full = _assemble_by_psum(chunk, axis_name, gather_dim, num_owners)
  else:
    full = _all_gather(chunk, axis_name, gather_dim)
  if layout.flat:
    return jnp.reshape(jnp.reshape(full, (-1,))[: like.size], like.shape)
  return jnp.reshape(full, like.shape)


def _assemble_by_psum(
  chunk: jax.Array, axis_name: Any, gather_dim: int, num_owners: int
) -> jax.Array:
  """An all-gather built from one all-reduce, exact bit for bit.

  Each replica writes its chunk's bit pattern (as integers) into its own
  slot of a zero buffer; the integer sum over the axis has one non-zero term
  per element, so every replica ends with every owner's exact bits (-0.0 and
  NaN payloads included). Used where XLA would replicate an all-gather's
  operand over the model axes (see ``_axes.other_axes_present``).
  """
  bits_dtype = np.dtype(f"int{chunk.dtype.itemsize * 8}")
  bits = jax.lax.bitcast_convert_type(chunk, bits_dtype)
  if _axes.vma_checked():
    bits = _axes.cast_varying(bits, _axes.axis_names(axis_name))
  shape = bits.shape[:gather_dim] + (num_owners,) + bits.shape[gather_dim:]
  spec = _axes.explicit_spec(bits)
  if spec is not None:  # the zero buffer is sharded like the chunk
    spec = jax.sharding.PartitionSpec(
      *spec[:gather_dim], None, *spec[gather_dim:]
    )
  slots = jax.lax.dynamic_update_index_in_dim(
    jnp.zeros(shape, bits_dtype, out_sharding=spec),
    bits,
    _axes.axis_index(axis_name),
    axis=gather_dim,
  )
  full = jax.lax.psum(slots, axis_name)
  return jax.lax.bitcast_convert_type(full, chunk.dtype)


def _all_gather(chunk: jax.Array, axis_name: Any, gather_dim: int):
  """The owners' chunks side by side along ``gather_dim`` (an all-gather)."""
  chunk = jnp.expand_dims(chunk, gather_dim)  # tiled, as in _owned_sum
  if _axes.vma_checked():
    # An inner transform may return constant (invariant) zeros; the
    # all-gather needs every owner's chunk typed varying.
    chunk = _axes.cast_varying(chunk, _axes.axis_names(axis_name))
    full = jax.lax.all_gather(
      chunk, axis_name, axis=gather_dim, tiled=True, to="invarying"
    )
  else:
    full = jax.lax.all_gather(chunk, axis_name, axis=gather_dim, tiled=True)
  return full


def tower(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  reduction: str = "mean",
  comm_dtype=None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so each replica reduces and updates only the slice it owns.

  ``TowerOptimizer(inner)`` with the optimizer's work and state split across
  the ``n`` replicas of ``axis_name`` instead of repeated on each:

  * ``init(params)`` (call it inside ``pmap``/``shard_map``) builds ``inner``'s
    state for the owned slice only: block ``axis_index`` of every leaf
    flattened and zero-padded to a multiple of ``n`` (``ceil(size / n)``
    elements, contiguous), shaped like the leaf with its first dimension
    divisible by ``n`` divided by ``n`` (1-D if there is none). Inside
    model-parallel replicas the slice is strided instead, to lie inside each
    device's model block (see ``docs/model_parallel.md``). The state *is*
    ``inner``'s state over those slices, so
    ``optax.tree_utils.tree_get(state, "mu")`` works as for ``inner``.
  * ``update(grads, state, params)`` reduce-scatters the gradients
    (``psum_scatter``; divided by ``n`` for ``"mean"``), runs ``inner.update``
    on the owned slice with the owned slice of ``params``, all-gathers the
    updates, unpads and reshapes. Every replica ends with bit-identical full
    updates; under a checking ``shard_map`` they are typed invariant, so
    replicated params can stay ``P()``.
  * Gradients that a checking ``shard_map`` types invariant (the gradient of
    ``P()`` params, already summed over the axis by autodiff) are not
    communicated again: each replica slices its chunk (and divides by ``n``
    for ``"mean"``).

  Under a checking ``shard_map`` the state's slice leaves are varying: give
  them ``P(axis_name)`` in ``out_specs``/``in_specs`` (scalar counters stay
  ``P()``).

  The result equals ``shardopt.cross_shard(inner, axis_name,
  reduction=reduction)`` for elementwise transforms: ``sgd`` (with or without
  momentum), ``adam``, ``adamw`` (its weight decay and mask act elementwise on
  the params slice), ``rmsprop``, ``adagrad``, ``lion``, ``clip``, ``scale``,
  ``scale_by_schedule``. A transform that reads a whole-tree statistic sees
  only its slice here: ``optax.clip_by_global_norm`` (use
  :func:`clip_by_global_norm` with ``axis_name``), ``lamb``/``lars`` trust
  ratios, ``adafactor``'s factored moments, ``scale_by_trust_ratio``,
  ``optax.apply_if_finite`` (each replica would test only its slice), and
  anything that depends on a leaf's shape are not safe inside ``tower``.
  ``optax.MultiSteps`` belongs inside (its accumulator is then ``1/n`` too).

  TensorFlow's loss scaling: ``TowerOptimizer`` divides the loss by the number
  of towers (unless SUM) and sums the gradients. Written literally that is
  ``shardopt.scale_loss(loss, axis, reduction=r)`` with ``tower(inner, axis,
  reduction="sum")``; the same result is an unscaled loss with
  ``tower(inner, axis, reduction=r)``. Scaling the loss *and* averaging
  divides twice.

  Args:
    inner: the optimizer applied (once) to the reduced gradients.
    axis_name: the ``pmap``/mesh axis name, or a tuple of names, whose
      replicas share the work. None is an error: ``tower`` needs a named axis.
    reduction: ``"mean"`` (default) or ``"sum"``; anything else raises
      ``ValueError("Unsupported reduction: ...")`` here.
    comm_dtype: optional floating dtype used on the wire for the gradients'
      reduce-scatter (e.g. ``jnp.bfloat16``), cast exactly as in
      :func:`shardopt.reduce`. The updates are all-gathered in their own
      dtype, so every replica applies the update ``inner`` computed. A
      quantized one (``jnp.int8``, ``jnp.float8_e4m3fn``, ``jnp.int4``,
      ``shardopt.quantized(...)``) quantizes each replica's rows in blocks
      with float32 scales and sends them by one all-to-all of bytes; each
      owner sums its rows in float32 (a quantized reduce-scatter). Not
      inside model-parallel replicas (``NotImplementedError``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s
    state over the owned slices.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.tower(optax.adam(0.1), "batch")
    >>> def step(w, g):
    ...   state = tx.init(w)
    ...   updates, state = tx.update(g, state, w)
    ...   return updates, optax.tree_utils.tree_get(state, "mu")
    >>> grads = jnp.tile(jnp.arange(8.0)[:, None], (1, 20))  # replica i: all i
    >>> updates, mu = jax.pmap(step, axis_name="batch")(jnp.zeros((8, 20)), grads)
    >>> mu.shape  # each replica keeps ceil(20 / 8) = 3 moments, not 20
    (8, 3)
    >>> np.round(np.asarray(mu[0]), 3)  # (1 - b1) * mean(0..7)
    array([0.35, 0.35, 0.35], dtype=float32)
    >>> np.round(np.asarray(updates[0, :5]), 4)  # the full update...
    array([-0.1, -0.1, -0.1, -0.1, -0.1], dtype=float32)
    >>> bool((updates == updates[0]).all())  # ...bit-identical on every replica
    True

  References:
    TensorFlow, ``tf.contrib.estimator.TowerOptimizer`` (with
    ``replicate_model_fn``).

    Rajbhandari et al., `ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models <https://arxiv.org/abs/1910.02054>`_, 2020 (stage 1:
    optimizer state partitioning).
  """
  if axis_name is None:
    raise ValueError(
      f"{_TOWER}: axis_name=None, but tower needs a named axis whose replicas"
      " split the optimizer's work. Pass the pmap/mesh axis name (e.g."
      " 'batch') and call the transform inside jax.pmap or jax.shard_map;"
      " under plain jax.jit over sharded arrays use `inner` directly."
    )
  _axes.check_reduction(reduction, _TOWER, axis_name)
  on_wire = wire.of(comm_dtype, _TOWER, axis_name)
  if on_wire.sparse:
    raise NotImplementedError(
      f"{_TOWER}: comm_dtype={on_wire.spec!r} (axis {axis_name!r}): the top-k"
      " wire needs an error buffer per replica, which tower does not keep."
      " Use a float or quantized comm_dtype (e.g. jnp.bfloat16, jnp.int8)"
      " with tower, or the top-k wire with cross_shard(inner, axis,"
      " comm_dtype=shardopt.topk(k), error_feedback=True)."
    )
  _axes.check_transform(inner, _TOWER)
  inner = optax.with_extra_args_support(inner)
  names = _axes.axis_names(axis_name)

  def owned_params(params, num_owners):
    return jax.tree.map(
      lambda p: _owned_slice(p, axis_name, num_owners), params
    )

  def init_fn(params):
    num_owners = _axes.axis_size(axis_name, _TOWER)
    return inner.init(owned_params(params, num_owners))

  def update_fn(updates, state, params=None, **extra_args):
    _shapes.check_like_params(_TOWER, updates, params, axis_name)
    num_owners = _axes.axis_size(axis_name, _TOWER)
    sizes = tuple(_axes.axis_size(name, _TOWER) for name in names)

    def owned_gradient(path, g):
      _axes.check_float_leaf(path, g, _TOWER, axis_name)
      varying, _ = _axes.split_axes(g, axis_name)
      if not varying or g.size == 0:  # already summed by autodiff (or empty)
        chunk = _owned_slice(g, axis_name, num_owners)
        return (
          chunk / jnp.asarray(num_owners, g.dtype)
          if (reduction == "mean")
          else chunk
        )
      if on_wire.runs_own_collective:
        return _owned_sum_on_wire(
          g, names, varying, num_owners, on_wire, reduction
        )
      return on_wire.reduce(
        g,
        lambda y: _owned_sum(y, names, varying, sizes, num_owners),
        num_owners,
        reduction,
      )

    owned_updates = jax.tree_util.tree_map_with_path(owned_gradient, updates)
    if params is not None:
      params = owned_params(params, num_owners)
    owned_updates, state = inner.update(
      owned_updates, state, params, **extra_args
    )
    updates = jax.tree.map(
      lambda chunk, g: _unshard(chunk, g, axis_name, num_owners),
      owned_updates,
      updates,
    )
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def clip_by_global_norm(
  max_norm, axis_name: Any = None
) -> optax.GradientTransformation:
  """Clips updates by their global norm, summed across the replicas of an axis.

  With ``axis_name=None`` this is ``optax.clip_by_global_norm(max_norm)``.
  With an axis, the tree is taken to be *partitioned* across the replicas:
  each replica computes the squared norm of its part, a ``psum`` over the axis
  adds the parts, and every part is scaled by the same factor. Inside
  :func:`tower` the owned slices are disjoint and their padding is zero, so
  this is exactly the norm of the full reduced gradient::

    shardopt.tower(optax.chain(shardopt.clip_by_global_norm(1.0, "batch"),
                               optax.adam(1e-3)), "batch")

  clips like ``optax.clip_by_global_norm(1.0)`` on the full gradient, where
  ``optax.clip_by_global_norm`` inside ``tower`` would clip each slice by its
  own norm. Under a checking ``shard_map`` a leaf typed invariant over the
  axis is the same on every replica (not partitioned) and counts once.

  Place it first in the inner chain (or after elementwise transforms only): a
  transform that writes non-zero values into the padding would change the
  norm.

  Args:
    max_norm: the largest global norm an update may have.
    axis_name: None, or the ``pmap``/mesh axis name (or tuple of names) across
      which the tree is partitioned.

  Returns:
    An ``optax.GradientTransformation`` with ``optax.EmptyState``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.tower(shardopt.clip_by_global_norm(1.0, "batch"), "batch",
    ...                     reduction="sum")
    >>> def step(g):
    ...   updates, _ = tx.update(g, tx.init(g), g)
    ...   return updates
    >>> grads = jnp.zeros((8, 2)).at[0].set(jnp.array([3.0, 4.0]))  # norm 5
    >>> np.asarray(jax.pmap(step, axis_name="batch")(grads)[0])
    array([0.6, 0.8], dtype=float32)

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2012.
  """
  if isinstance(max_norm, (numbers.Real, np.ndarray, np.generic)) and not (
    np.ndim(max_norm) == 0 and float(max_norm) > 0
  ):
    raise ValueError(
      f"{_CLIP}: max_norm={max_norm!r} must be a positive scalar, e.g. 1.0."
    )

  def update_fn(updates, state, params=None):
    _shapes.check_like_params(_CLIP, updates, params, axis_name)
    del params
    if axis_name is None:
      g_norm = optax.tree.norm(updates)
    else:
      _axes.axis_size(axis_name, _CLIP)
      # Group leaves by the axes they are partitioned over: psum each group's
      # squared norm over those axes; invariant leaves count once.
      parts = {}
      for x in jax.tree.leaves(updates):
        varying, _ = _axes.split_axes(x, axis_name)
        parts.setdefault(varying, []).append(x)
      squared = []
      for varying, leaves in parts.items():
        part = optax.tree.norm(leaves, squared=True)
        if varying:
          part = jax.lax.psum(part, _axes.as_axis(varying))
        squared.append(part)
      g_norm = jnp.sqrt(sum(squared)) if squared else jnp.zeros([])
    trigger = jnp.squeeze(g_norm < max_norm)

    def clip_fn(t):
      return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

    return jax.tree.map(clip_fn, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
