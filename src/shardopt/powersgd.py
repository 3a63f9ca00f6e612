"""PowerSGD: low-rank gradient compression with error feedback.

:func:`powersgd` replaces :func:`shardopt.cross_shard_mean` in a chain. Instead
of all-reducing every gradient matrix ``M`` (``n x m`` numbers), each replica
all-reduces two thin factors, ``P = M Q`` (``n x r``) and ``M^T P``
(``m x r``), and the part of its gradient that the rank-``r`` approximation
missed is kept locally and added to the next step's gradient (error
feedback). This is the algorithm of Vogels, Karimireddy and Jaggi (NeurIPS
2019) as PyTorch's DDP ``powerSGD_hook`` runs it.

The examples below assume 8 devices, e.g. a CPU forced to show them with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before importing jax.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _args
from shardopt import _axes
from shardopt import _shapes
from shardopt import wire
from shardopt.collectives import reduce_for

_POWERSGD = "shardopt.powersgd"
# The factor matmuls run in full float32 on every backend (the default
# precision of a float32 matmul is lower on TPUs and on GPUs with TF32).
_PRECISION = jax.lax.Precision.HIGHEST


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd`.

  Attributes:
    count: int32 scalar, steps taken (warm-up steps included); the same on
      every replica.
    error: per leaf, this replica's error feedback: float32 in the leaf's shape
      for a compressed leaf (with ``error_feedback=True``), an empty float32
      placeholder of shape ``(0,)`` otherwise. Per replica: under a checking
      ``shard_map`` pass it with spec ``P(axis_name)``.
    q: per leaf, the float32 ``(m, r)`` right factor the next step starts
      from (an empty ``(0,)`` placeholder for uncompressed leaves); the same on
      every replica (spec ``P()``).
  """

  count: chex.Array
  error: Any
  q: Any


# --- Which leaves are compressed, and how (static, from shapes only). ---


def _matrix_shape(shape: tuple) -> tuple[int, int]:
  """``(n, m)`` of the matrix view ``g.reshape(g.shape[0], -1)``."""
  return int(shape[0]), int(math.prod(shape[1:]))


def _effective_rank(shape: tuple, rank: int) -> int:
  """``r = min(rank, n, m)``."""
  n, m = _matrix_shape(shape)
  return min(rank, n, m)


def _compresses(shape: tuple, rank: int, min_compression_rate: float) -> bool:
  """A leaf is compressed iff ``ndim >= 2`` and ``r (n + m) * rate < n m``."""
  if len(shape) < 2:
    return False
  n, m = _matrix_shape(shape)
  r = _effective_rank(shape, rank)
  return r * (n + m) * min_compression_rate < n * m


def _placeholder() -> jax.Array:
  """The ``error``/``q`` entry of a leaf that keeps none."""
  return jnp.zeros((0,), jnp.float32)


def _gaussian_q(seed: int, leaf_index: int, step, shape: tuple) -> jax.Array:
  """Standard normal float32 ``Q`` from ``(seed, leaf position, step)``.

  Every replica computes the same bits without communicating.
  """
  key = jax.random.fold_in(
    jax.random.fold_in(jax.random.key(seed), leaf_index), step
  )
  return jax.random.normal(key, shape, jnp.float32)


# --- The steps of one compressed update, in the order of the docstring. ---


def _with_error(
  g: jax.Array, error: jax.Array, error_feedback: bool
) -> jax.Array:
  """Step 1: ``M = g + e`` as a float32 ``(n, m)`` matrix."""
  matrix = g.astype(jnp.float32).reshape(_matrix_shape(g.shape))
  return matrix + error.reshape(matrix.shape) if error_feedback else matrix


def _factor_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` for a factor (``b`` has ``r`` columns), in float32.

  Under Explicit model axes the contraction may run over a model-sharded
  dimension; the factor then comes out sharded like ``a``'s rows (the sum
  over the model axis is a factor-sized reduction, inherent to ``M Q``).
  """
  spec = _axes.explicit_spec(a)
  if spec is None and _axes.explicit_spec(b) is None:
    return jnp.matmul(a, b, precision=_PRECISION)
  rows = spec[0] if spec is not None and len(spec) else None
  return jnp.matmul(
    a,
    b,
    precision=_PRECISION,
    out_sharding=jax.sharding.PartitionSpec(rows, None),
  )


def _project(matrix: jax.Array, q: jax.Array) -> jax.Array:
  """Step 2: ``P = M Q`` (``n x r``)."""
  return _factor_matmul(matrix, q)


def _mean(factors: list, axis_name: Any, on_wire: wire.Wire) -> list:
  """Steps 0, 3 and 6: the mean over the axis (on ``on_wire``)."""
  return reduce_for(_POWERSGD, factors, axis_name, wire=on_wire)


def _orthonormalize(p: jax.Array) -> jax.Array:
  """Step 4: an orthonormal basis of P's columns (Householder QR, float32).

  QR never divides by a column norm, so an all-zero or rank-deficient ``P``
  gives finite, orthonormal columns (the missing directions are filled with
  unit vectors). The result depends on ``P`` only through its column space.

  Inside model-parallel replicas under Explicit axes, ``P``'s rows may be
  sharded over a model axis; QR needs them whole, so ``P`` (a factor, ``n x
  r``) is gathered first (Auto axes: XLA does the same by itself).
  """
  if _axes.explicit_spec(p) is not None:
    p = jax.sharding.reshard(p, jax.sharding.PartitionSpec())
  return jnp.linalg.qr(p, mode="reduced")[0]


def _back_project(matrix: jax.Array, p: jax.Array) -> jax.Array:
  """Step 5: ``Q = M^T P`` (``m x r``)."""
  return _factor_matmul(matrix.T, p)


def _approximate(p: jax.Array, q: jax.Array) -> jax.Array:
  """Step 7: ``approx = P Q^T`` (``n x m``), the same on every replica."""
  return jnp.matmul(p, q.T, precision=_PRECISION)


def _residual(
  matrix: jax.Array, approx: jax.Array, error: jax.Array, error_feedback: bool
) -> jax.Array:
  """Step 8: ``e = M - approx``: local input minus the aggregated approximation."""
  if not error_feedback:
    return error  # the placeholder, unchanged
  return (matrix - approx).reshape(error.shape)


def _next_q(
  q: jax.Array, warm_start: bool, seed: int, leaf_index: int, count: jax.Array
) -> jax.Array:
  """Step 9: the next step's ``Q``: this step's (warm start) or a fresh one."""
  if warm_start:
    return q
  return _gaussian_q(seed, leaf_index, count, q.shape)


# --- Argument and state checks. ---


def _check_args(
  axis_name,
  rank,
  start_step,
  min_compression_rate,
  error_feedback,
  warm_start,
  seed,
  comm_dtype,
):
  """Validates every argument of :func:`powersgd` before anything is traced;
  returns the wire ``comm_dtype`` names."""
  if axis_name is None:
    raise ValueError(
      f"{_POWERSGD}: axis_name=None, but powersgd needs a named axis: it"
      " replaces the all-reduce of the gradients across the replicas of that"
      " axis. Call it inside jax.pmap(..., axis_name='batch') or"
      " jax.shard_map over a mesh axis and pass that name. Under plain"
      " jax.jit over sharded arrays the compiler reduces the gradients"
      " itself and there is nothing to compress."
    )
  if not _args.is_integer(rank) or rank < 1:
    raise ValueError(
      f"{_POWERSGD}: rank={rank!r} (axis {axis_name!r}) must be"
      " an integer >= 1, the rank of the approximation; e.g."
      " rank=2 (PyTorch's matrix_approximation_rank)."
    )
  if not _args.is_integer(start_step) or start_step < 0:
    raise ValueError(
      f"{_POWERSGD}: start_step={start_step!r} (axis"
      f" {axis_name!r}) must be an integer >= 0, the number of"
      " uncompressed warm-up steps; e.g. start_step=0."
    )
  if (
    isinstance(min_compression_rate, (bool, np.bool_))
    or not isinstance(
      min_compression_rate, (numbers.Real, np.floating, np.integer)
    )
    or not (math.isfinite(min_compression_rate) and min_compression_rate > 0)
  ):
    raise ValueError(
      f"{_POWERSGD}: min_compression_rate={min_compression_rate!r} (axis"
      f" {axis_name!r}) must be a positive finite number: a leaf is"
      " compressed only when n*m > rank*(n+m)*min_compression_rate; e.g. 2.0."
    )
  _args.flag(error_feedback, "error_feedback", _POWERSGD, f"axis {axis_name!r}")
  _args.flag(warm_start, "warm_start", _POWERSGD, f"axis {axis_name!r}")
  if not _args.is_integer(seed):
    raise ValueError(
      f"{_POWERSGD}: seed={seed!r} (axis {axis_name!r}) must be"
      " an integer, the seed of the initial Q; e.g. seed=0."
    )
  on_wire = wire.of(comm_dtype, _POWERSGD, axis_name)
  if on_wire.sparse:
    raise ValueError(
      f"{_POWERSGD}: comm_dtype={on_wire.spec!r} (axis {axis_name!r}): the"
      " top-k wire does not carry powersgd's factors (already compressed,"
      " with powersgd's own error feedback). Use a float or quantized"
      " comm_dtype (e.g. jnp.bfloat16, jnp.int8), or the top-k wire instead"
      " of powersgd: cross_shard_mean(axis, comm_dtype=shardopt.topk(k),"
      " error_feedback=True)."
    )
  return on_wire


def _check_leaf(
  path,
  g,
  error,
  q,
  *,
  compressed: bool,
  rank: int,
  axis_name: Any,
  error_feedback: bool,
) -> None:
  """One gradient leaf: floating, per replica, and matching its state."""
  where = jax.tree_util.keystr(path) or "<root>"
  _axes.check_float_leaf(path, g, _POWERSGD, axis_name)
  _, invariant = _axes.split_axes(g, axis_name)
  if invariant:
    raise ValueError(
      f"{_POWERSGD}: the gradient at {where} is invariant over axis"
      f" {_axes.as_axis(invariant)!r}: the params were replicated (P()), so"
      " autodiff has already summed the gradient over every replica and there"
      " is nothing left to compress. Fix: cast the params with"
      f" jax.lax.pcast(params, {axis_name!r}, to='varying') before jax.grad,"
      " so each replica keeps its own gradient and powersgd does the"
      " reduction."
    )
  if not compressed:
    return
  n, m = _matrix_shape(g.shape)
  r = _effective_rank(g.shape, rank)
  fix = (
    " Build the state with this transform's init from params shaped like"
    " the gradients: jax.pmap(tx.init) under pmap; under a checking"
    " shard_map, jax.shard_map(tx.init, in_specs=P(), out_specs=specs)"
    f" with specs.error = P({axis_name!r}) and P() elsewhere."
  )
  if jnp.shape(q) != (m, r):
    raise ValueError(
      f"{_POWERSGD}: state.q at {where} has shape"
      f" {jnp.shape(q)}, expected {(m, r)} for a gradient of"
      f" shape {g.shape} at rank {rank}.{fix}"
    )
  if error_feedback and jnp.shape(error) != g.shape:
    raise ValueError(
      f"{_POWERSGD}: state.error at {where} has shape"
      f" {jnp.shape(error)}, expected the gradient's shape"
      f" {g.shape} (each replica keeps its own error).{fix}"
    )


def powersgd(
  axis_name: Any,
  *,
  rank: int = 1,
  start_step: int = 0,
  min_compression_rate: float = 2.0,
  error_feedback: bool = True,
  warm_start: bool = True,
  seed: int = 0,
  comm_dtype=None,
) -> optax.GradientTransformation:
  """Averages gradients across replicas as a low-rank approximation (PowerSGD).

  A stateful replacement for :func:`shardopt.cross_shard_mean`::

    optax.chain(shardopt.powersgd("batch", rank=2), optax.sgd(0.1, momentum=0.9))

  Each gradient leaf ``g`` is viewed as a matrix ``M = g.reshape(g.shape[0],
  -1)`` (``n x m``). With ``r = min(rank, n, m)``, the leaf is *compressed*
  when ``g.ndim >= 2`` and ``r * (n + m) * min_compression_rate < n * m``;
  every other leaf is mean-reduced exactly, as ``cross_shard_mean`` would.
  While ``state.count < start_step`` every leaf is mean-reduced (warm-up).
  Otherwise one step is, for all compressed leaves together:

  0. mean-reduce the uncompressed leaves;
  1. ``M = g + e`` in float32 (``e``: this replica's error feedback);
  2. ``P = M Q``;
  3. ``P = mean of P over the axis`` (one all-reduce of ``n x r`` numbers);
  4. orthonormalize the columns of ``P`` (Householder QR in float32: an
     all-zero or rank-deficient ``P`` gives finite output);
  5. ``Q = M^T P``;
  6. ``Q = mean of Q over the axis`` (one all-reduce of ``m x r`` numbers);
  7. ``approx = P Q^T``: the update, bit-identical on every replica;
  8. ``e = M - approx``: the local input minus the *aggregated*
     approximation (skipped with ``error_feedback=False``);
  9. the next step starts from this ``Q`` (``warm_start=True``) or from a
     fresh standard normal one drawn from ``(seed, leaf position, count)``.

  The result depends on ``P`` only through ``P P^T``, so any orthonormal basis
  of its columns gives the same update. ``rank >= min(n, m)`` gives the exact
  mean (to rounding). Updates come back in the gradient's dtype (bfloat16
  and float16 gradients are compressed in float32).

  Bytes per step, the buffers of the all-reduces (a ring all-reduce moves
  ``2 (k - 1) / k`` times that per replica)::

    sum over compressed leaves of r * (n + m) * w   (w = 4, float32 factors)
    + sum over the other leaves of size * itemsize

  where ``comm_dtype``, if given, sets the itemsize of both terms (it is the
  wire dtype of every all-reduce, factors included). ``cross_shard_mean``
  moves ``n * m * itemsize`` for each matrix instead. Warm-up steps move the
  full gradient; the choice between the two is one ``lax.cond`` on the
  replicated counter (absent when ``start_step=0``), so every replica takes
  the same branch.

  State (:class:`PowerSGDState`): ``count`` and ``q`` are the same on every
  replica, ``error`` is per replica. ``tx.init(params)`` runs anywhere (no
  collective: the initial ``Q`` comes from ``seed`` and the leaf's position).
  Under ``jax.pmap``, build it with ``jax.pmap(tx.init)(params)``. Under a
  checking ``jax.shard_map``, pass ``error`` with spec ``P(axis_name)`` and
  the rest with ``P()``; the updates are typed invariant, so replicated
  ``P()`` params stay ``P()``. The gradients must be this replica's own
  (varying): a gradient that a checking ``shard_map`` types invariant (of
  replicated params, already summed by autodiff) raises a ``ValueError``:
  cast the params with ``jax.lax.pcast(params, axis_name, to="varying")``
  before ``jax.grad``.

  Composition: use it where ``cross_shard_mean`` would go, after any
  per-replica transform (clipping) and before the optimizer. Put it inside
  ``shardopt.accumulate`` / ``shardopt.apply_if_finite`` (their decisions
  are replicated, so its collectives run on every replica or on none; a
  skipped step leaves ``error`` and ``q`` untouched), not outside
  ``apply_if_finite``: a non-finite gradient would enter ``error`` and stay
  there. It does not compose with :func:`shardopt.tower`, in either order:
  ``tower`` is itself the gradient reduction (a reduce-scatter of 1-D owned
  slices, which powersgd would see as different uncompressible vectors on
  each replica), and after powersgd the updates are already the mean, which
  ``tower`` would reduce again (under a checking ``shard_map`` it would read
  the invariant mean as an autodiff sum and divide it by ``n``).

  Args:
    axis_name: the ``pmap``/mesh axis name, or a tuple of names. None is an
      error: there must be an axis to reduce over.
    rank: the rank ``r`` of the approximation (PyTorch's
      ``matrix_approximation_rank``); an integer >= 1.
    start_step: uncompressed warm-up steps (PyTorch's
      ``start_powerSGD_iter``); an integer >= 0.
    min_compression_rate: compress a leaf only if ``n * m`` exceeds
      ``r * (n + m) * min_compression_rate``; a positive number.
    error_feedback: keep the approximation's error per replica and add it to
      the next gradient (the paper's and PyTorch's default).
    warm_start: start each step's power iteration from the previous ``Q``.
    seed: seed of the random ``Q`` (initial, and every step without warm start).
    comm_dtype: optional floating dtype on the wire for every all-reduce
      (e.g. ``jnp.bfloat16``), cast as in :func:`shardopt.reduce`.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`PowerSGDState`.

  Example:
    Replica ``i``'s gradient is ``(i + 1) a b^T``: the mean is rank 1, so
    rank-1 PowerSGD returns it (to rounding) with 2 x 16 numbers on the wire
    per all-reduce pair instead of 256::

      >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
      >>> tx = shardopt.powersgd("batch", rank=1)
      >>> a, b = jnp.linspace(-1.0, 1.0, 16), jnp.linspace(0.5, 2.0, 16)
      >>> grads = jnp.arange(1.0, 9.0)[:, None, None] * jnp.outer(a, b)
      >>> def step(g, state):
      ...   return tx.update(g, state)
      >>> state = jax.pmap(tx.init)(grads)
      >>> updates, state = jax.pmap(step, axis_name="batch")(grads, state)
      >>> bool(jnp.allclose(updates[3], 4.5 * jnp.outer(a, b), atol=1e-5))
      True
      >>> bool((updates == updates[0]).all())  # bit-identical on every replica
      True
      >>> state.q.shape, state.error.shape  # (devices, m, r), (devices, n, m)
      ((8, 16, 1), (8, 16, 16))

    Under a checking ``jax.shard_map``: replicated params cast to varying
    before ``jax.grad``, ``error`` per replica, the rest replicated::

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("batch",))
      >>> tx = optax.chain(shardopt.powersgd("batch", rank=2), optax.sgd(0.1))
      >>> w = jnp.zeros((6, 5))
      >>> specs = jax.tree.map(lambda _: P(), jax.eval_shape(tx.init, w))
      >>> specs = (specs[0]._replace(error=P("batch")),) + specs[1:]
      >>> init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
      ...                              out_specs=specs))
      >>> def train_step(w, state, x):
      ...   local = jax.lax.pcast(w, "batch", to="varying")
      ...   grads = jax.grad(lambda w: jnp.sum((w - x[0]) ** 2))(local)
      ...   updates, state = tx.update(grads, state, w)
      ...   return optax.apply_updates(w, updates), state
      >>> train_step = jax.jit(jax.shard_map(train_step, mesh=mesh,
      ...     in_specs=(P(), specs, P("batch")), out_specs=(P(), specs)))
      >>> x = jax.device_put(jnp.ones((8, 6, 5)), NamedSharding(mesh, P("batch")))
      >>> state = init(w)
      >>> w, state = train_step(w, state, x)
      >>> np.round(np.asarray(w[0]), 4)  # the mean gradient 2 (w - 1) is rank 1
      array([0.2, 0.2, 0.2, 0.2, 0.2], dtype=float32)

  References:
    Vogels, Karimireddy and Jaggi, `PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization
    <https://arxiv.org/abs/1905.13727>`_, NeurIPS 2019.
    PyTorch, ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.
  """
  on_wire = _check_args(
    axis_name,
    rank,
    start_step,
    min_compression_rate,
    error_feedback,
    warm_start,
    seed,
    comm_dtype,
  )

  def compressed(x) -> bool:
    return _compresses(jnp.shape(x), rank, min_compression_rate)

  def init_fn(params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    errors, qs = [], []
    for index, p in enumerate(leaves):
      shape = jnp.shape(p)
      if compressed(p):
        _, m = _matrix_shape(shape)
        errors.append(
          jnp.zeros(shape, jnp.float32) if error_feedback else _placeholder()
        )
        qs.append(
          _gaussian_q(seed, index, 0, (m, _effective_rank(shape, rank)))
        )
      else:
        errors.append(_placeholder())
        qs.append(_placeholder())
    return PowerSGDState(
      count=jnp.zeros([], jnp.int32),
      error=treedef.unflatten(errors),
      q=treedef.unflatten(qs),
    )

  def warm_up_step(grads, errors, qs, count):
    """Every leaf mean-reduced; ``error`` and ``q`` kept."""
    del count
    return _mean(grads, axis_name, on_wire), errors, qs

  def compressed_step(grads, errors, qs, count):
    """Steps 0-9 of the docstring over every leaf of the gradient."""
    big = [i for i, g in enumerate(grads) if compressed(g)]
    small = [i for i, g in enumerate(grads) if not compressed(g)]
    updates, errors, qs = list(grads), list(errors), list(qs)
    means = _mean([grads[i] for i in small], axis_name, on_wire)  # 0
    matrices = [
      _with_error(grads[i], errors[i], error_feedback) for i in big
    ]  # 1
    p = [
      _project(mat, qs[i]) for mat, i in zip(matrices, big, strict=True)
    ]  # 2
    p = [_orthonormalize(x) for x in _mean(p, axis_name, on_wire)]  # 3, 4
    q = _mean(
      [_back_project(mat, x) for mat, x in zip(matrices, p, strict=True)],
      axis_name,
      on_wire,
    )  # 5, 6
    for i, mean in zip(small, means, strict=True):
      updates[i] = mean
    for i, mat, pi, qi in zip(big, matrices, p, q, strict=True):
      approx = _approximate(pi, qi)  # 7
      updates[i] = approx.reshape(grads[i].shape).astype(grads[i].dtype)
      errors[i] = _residual(mat, approx, errors[i], error_feedback)  # 8
      qs[i] = _next_q(qi, warm_start, seed, i, count)  # 9
    return updates, errors, qs

  def update_fn(updates, state, params=None):
    _shapes.check_like_params(_POWERSGD, updates, params, axis_name)
    del params
    _axes.axis_size(axis_name, _POWERSGD)
    # The counter is replicated by construction: a varying or stacked (1,)
    # counter (the whole state under P(axis) in shard_map) is as good.
    step = _axes.scalar_counter(state.count, _POWERSGD, "state.count")
    paths_and_grads, treedef = jax.tree_util.tree_flatten_with_path(updates)
    try:
      errors = treedef.flatten_up_to(state.error)
      qs = treedef.flatten_up_to(state.q)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{_POWERSGD}: the gradient tree does not match the state over axis"
        f" {axis_name!r}: gradients have structure {treedef}. Build the state"
        " with tx.init(params) from the params these gradients belong to."
      ) from e
    grads = [g for _, g in paths_and_grads]
    for (path, g), error, q in zip(paths_and_grads, errors, qs, strict=True):
      _check_leaf(
        path,
        g,
        error,
        q,
        compressed=compressed(g),
        rank=rank,
        axis_name=axis_name,
        error_feedback=error_feedback,
      )
    args = (grads, errors, qs, step + 1)
    if start_step == 0:
      outputs = compressed_step(*args)
    else:
      outputs = _axes.cond_same_types(
        step < start_step,
        lambda: warm_up_step(*args),
        lambda: compressed_step(*args),
        transform=_POWERSGD,
      )
    new_updates, errors, qs = (treedef.unflatten(x) for x in outputs)
    return new_updates, PowerSGDState(count=state.count + 1, error=errors, q=qs)

  return optax.GradientTransformation(init_fn, update_fn)
