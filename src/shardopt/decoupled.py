"""DeMo: a decoupled momentum whose fast components alone cross the wire.

``shardopt.decoupled_momentum`` is Algorithm 1 of Peng, Quesnelle and
Kingma (arXiv 2411.19870) on the sparse wire (``shardopt.topk``'s). Each
replica keeps its own momentum ``m`` (float32, never synchronized) and, on
every step, for every gradient leaf ``g``:

1. **accumulates**: ``m <- decay * m + g``;
2. **extracts the fast components**: cuts ``m`` into tiles, takes each
   tile's orthonormal type-II DCT and keeps its ``k`` coefficients of
   largest magnitude, ``q``;
3. **removes them from the momentum**: ``m <- m - IDCT(q)``;
4. **synchronizes**: one ``all_gather`` of every replica's ``q`` (in-tile
   indices and values, float32 by default), summed in replica order and
   divided by the group size: ``Q = IDCT(mean_j q_j)``, the same bits on
   every replica (``mean="senders"``: each coefficient's sum divided by the
   number of replicas that sent it, the reference code's rule);
5. returns ``sign(Q)`` (the paper's sign step; ``sign=False``: ``Q``).

The tiles are those of the paper's code: a leaf is viewed as a matrix
(a vector as one row, a leaf of three or more axes as ``(prod(shape[:-1]),
shape[-1])``); along each of its two axes the tile side is the largest
divisor of that axis's length that is at most ``chunk_size`` (64: a
``768 x 3072`` kernel is cut into 64 x 64 tiles, a vector of 768 into runs
of 64, an axis of prime length above ``chunk_size`` into sides of 1). A
tile's DCT is the separable 2-D one, ``C_rows @ tile @ C_cols^T``, with
``C`` the orthonormal DCT-II matrix (``C[u, a] = w_u cos(pi (2 a + 1) u /
(2 s))``, ``w_0 = sqrt(1 / s)``, ``w_u = sqrt(2 / s)``), computed in numpy
at trace time, applied as float32 matrix products at
``jax.lax.Precision.HIGHEST`` (no TF32 on a GPU); ``C^T`` inverts it.

Steps 1 to 4 are the sparse wire's error feedback in the DCT domain, which
the momentum lives in. The state holds ``e = DCT(m)`` (tile by tile), and
the DCT is linear and orthonormal, so with ``error_decay = decay``::

    contribution  c = DCT(g) + decay * e   = DCT(decay * m + g)     (1)
    sent          q = top-k of c per tile                           (2)
    new error     e' = c - q               = DCT(m - IDCT(q))       (3)
    mean          (sum_j q_j) / n          = DCT(mean_j IDCT(q_j))  (4)

so the wire's contribution, residual and mean are the paper's momentum,
its updated momentum and its synchronized update, each in the DCT domain
(the tests check this against a numpy run of the paper's steps in
parameter space). At ``value_bits=32`` the values travel as float32, so
``e'`` is exactly zero where a coefficient was sent.

Where it differs from the paper's reference code (github bloc97/DeMo):
the momentum adds ``g``, not ``lr * g`` (Algorithm 1; the same steps with
a constant learning rate, since the sign step ignores scale); the mean
divides by the group size by default, as every shardopt mean does, where
the code averages each coefficient over the replicas that sent it
(``mean="senders"`` does that; the sign of ``Q`` then differs where
replicas chose different coefficients: on 2.7% of the elements with 4
replicas and 4.4% with 8 in issue 51's run against the authors' demo.py);
the indices travel packed at ``ceil(log2(tile))`` bits instead of int64; leaves
of three or more axes are tiled as matrices.

Bytes: per tile of ``t`` coefficients that keeps ``k' = min(k, t)``,
``ceil(k' * ceil(log2 t) / 8) + k' * value_bits / 8`` bytes (plus a 4-byte
scale at ``value_bits`` <= 8). At the defaults (64 x 64 tiles, ``k = 32``,
float32) that is 48 + 128 = 176 bytes per 4,096 parameters, 93x fewer than
their float32 bytes; in a ring all-gather each replica sends ``n - 1``
payloads where a float32 all-reduce sends ``2 (n - 1) / n`` of the leaf,
so 186 / n times fewer bytes (23x at ``n = 8``).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _args
from shardopt import _axes
from shardopt import _shapes
from shardopt import wire
from shardopt.wire import feedback
from shardopt.wire import sparse

__all__ = ["DecoupledMomentumState", "decoupled_momentum"]

_NAME = "shardopt.decoupled_momentum"
_HIGHEST = jax.lax.Precision.HIGHEST


class DecoupledMomentumState(NamedTuple):
  """State of :func:`decoupled_momentum`.

  Attributes:
    momentum: float32, per replica (never synchronized; spec ``P(axis)``
      under ``jax.shard_map``): for each gradient leaf, its decoupled
      momentum as DCT coefficients, one row per tile, ``(tiles, tile_rows *
      tile_cols)``, row-major in the tile grid and within a tile (the
      tiles: :func:`decoupled_momentum`'s API page). What was sent has been
      removed from it.
  """

  momentum: Any


# --------------------------------------------------------------------------
# Tiles and their DCT.


class _Tiling(NamedTuple):
  """A leaf viewed as a ``rows x cols`` matrix cut into ``tile_rows x
  tile_cols`` tiles."""

  rows: int
  cols: int
  tile_rows: int
  tile_cols: int

  @property
  def grid(self) -> tuple[int, int]:
    return self.rows // self.tile_rows, self.cols // self.tile_cols

  @property
  def tiles(self) -> int:
    return self.grid[0] * self.grid[1]

  @property
  def tile_size(self) -> int:
    return self.tile_rows * self.tile_cols


def _side(length: int, chunk_size: int) -> int:
  """The largest divisor of ``length`` that is at most ``chunk_size`` (the
  reference code's ``_get_smaller_split``); 1 for an empty axis."""
  for side in range(min(length, chunk_size), 0, -1):
    if length % side == 0:
      return side
  return 1


def _tiling(shape: tuple, chunk_size: int) -> _Tiling:
  """How a leaf of ``shape`` is tiled (see the module docstring)."""
  if len(shape) < 2:
    rows, cols = 1, (shape[0] if shape else 1)
  else:
    rows, cols = math.prod(shape[:-1]), shape[-1]
  return _Tiling(rows, cols, _side(rows, chunk_size), _side(cols, chunk_size))


@functools.cache
def _basis(size: int) -> np.ndarray:
  """The orthonormal DCT-II matrix ``C`` (``size x size``, float32):
  ``C[u, a] = w_u cos(pi (2 a + 1) u / (2 size))``; ``C^T`` inverts it."""
  a = np.arange(size)
  c = np.cos(np.pi * (2 * a + 1) * a[:, None] / (2 * size)) * np.sqrt(
    2.0 / size
  )
  c[0] /= np.sqrt(2.0)
  return c.astype(np.float32)


def _dct(x: jax.Array, tiling: _Tiling) -> jax.Array:
  """A leaf -> its tiles' DCT coefficients, ``(tiles, tile_size)`` float32."""
  rows, cols = tiling.grid
  blocks = jnp.reshape(
    x.astype(jnp.float32), (rows, tiling.tile_rows, cols, tiling.tile_cols)
  )
  coefficients = jnp.einsum(
    "iajb,ua,vb->ijuv",
    blocks,
    _basis(tiling.tile_rows),
    _basis(tiling.tile_cols),
    precision=_HIGHEST,
  )
  return coefficients.reshape(tiling.tiles, tiling.tile_size)


def _idct(coefficients: jax.Array, tiling: _Tiling, shape: tuple):
  """Inverse of :func:`_dct`: ``(tiles, tile_size)`` -> a leaf of ``shape``."""
  rows, cols = tiling.grid
  coefficients = coefficients.reshape(
    rows, cols, tiling.tile_rows, tiling.tile_cols
  )
  blocks = jnp.einsum(
    "ijuv,ua,vb->iajb",
    coefficients,
    _basis(tiling.tile_rows),
    _basis(tiling.tile_cols),
    precision=_HIGHEST,
  )
  return blocks.reshape(shape)


# --------------------------------------------------------------------------
# Checks.


MEANS = ("replicas", "senders")


def _check_arguments(axis_name, k, chunk_size, decay, value_bits, sign, mean):
  on = f" (axis {axis_name!r})"
  if not isinstance(mean, str) or mean not in MEANS:
    raise ValueError(
      f"{_NAME}: mean={mean!r}{on} is not supported; use mean='replicas'"
      " (the default: each coefficient's sum divided by the group size) or"
      " mean='senders' (divided by the replicas that sent it, the DeMo"
      " authors' code)."
    )
  if axis_name is None:
    raise ValueError(
      f"{_NAME}: axis_name=None, but DeMo needs a named axis: each replica"
      " sends its momentum's fast components to the others over it. Call it"
      " inside jax.pmap(..., axis_name='batch'), jax.shard_map over a mesh"
      " axis or jax.vmap(..., axis_name='batch') and pass that name (an axis"
      " of size 1 runs DeMo on one replica)."
    )
  if not _args.is_integer(chunk_size) or chunk_size < 1:
    raise ValueError(
      f"{_NAME}: chunk_size={chunk_size!r}{on} must be an integer >= 1, the"
      " largest tile side (tiles of up to chunk_size x chunk_size); e.g."
      " chunk_size=64 (the paper's)."
    )
  if not _args.is_integer(k) or k < 1:
    raise ValueError(
      f"{_NAME}: k={k!r}{on} must be an integer >= 1, the DCT coefficients"
      " each tile sends (a tile with fewer sends all of them); e.g. k=32"
      " (the paper's, of 64 x 64 = 4096)."
    )
  if (
    isinstance(decay, (bool, np.bool_))
    or not isinstance(decay, (numbers.Real, np.floating, np.integer))
    or not (0.0 <= float(decay) < 1.0)
  ):
    raise ValueError(
      f"{_NAME}: decay={decay!r}{on} must be a number with 0 <= decay < 1,"
      " the momentum's decay (m <- decay * m + g); e.g. decay=0.999 (the"
      " paper's)."
    )
  if not _args.is_integer(value_bits) or value_bits not in sparse.VALUE_BITS:
    raise ValueError(
      f"{_NAME}: value_bits={value_bits!r}{on} is not supported; use one of"
      f" {sparse.VALUE_BITS} (bits per sent coefficient; 32, float32 as the"
      " paper sends them, or 16, bfloat16)."
    )
  _args.flag(sign, "sign", _NAME, f"axis {axis_name!r}")


def _check_leaf(path, g, momentum, tiling: _Tiling, axis_name) -> None:
  """A float gradient, per replica over every axis, with a momentum of its
  tiles' shape."""
  _axes.check_float_leaf(path, g, _NAME, axis_name)
  where = jax.tree_util.keystr(path) or "<root>"
  _, invariant = _axes.split_axes(g, axis_name)
  if invariant:
    raise ValueError(
      f"{_NAME}: the gradient at {where} is invariant over axis"
      f" {_axes.as_axis(invariant)!r}: the params were replicated (P()), so"
      " autodiff has already summed it over every replica, and DeMo needs"
      " each replica's own gradient for its own momentum. Fix: cast the"
      f" params with jax.lax.pcast(params, {axis_name!r}, to='varying')"
      " before jax.grad."
    )
  want = (tiling.tiles, tiling.tile_size)
  if tuple(jnp.shape(momentum)) != want:
    raise ValueError(
      f"{_NAME}: state.momentum at {where} has shape"
      f" {tuple(jnp.shape(momentum))}, expected {want} (the DCT tiles of a"
      f" gradient of shape {tuple(jnp.shape(g))}). Build the state with this"
      " transform's init from the params."
    )


# --------------------------------------------------------------------------
# The transform.


def decoupled_momentum(
  axis_name: Any,
  *,
  k: int = 32,
  chunk_size: int = 64,
  decay: float = 0.999,
  value_bits: int = 32,
  sign: bool = True,
  axis_index_groups=None,
  mean: str = "replicas",
) -> optax.GradientTransformation:
  """DeMo: a per-replica momentum, only its fast components exchanged.

  Use it *instead of* ``cross_shard_mean`` (it is the reduction: no other
  all-reduce of the gradients), with a learning rate after it; the paper's
  optimizer, with the reference code's weight decay ``wd``, is::

    optax.chain(shardopt.decoupled_momentum("batch"),
                optax.add_decayed_weights(wd),   # optional
                optax.scale_by_learning_rate(lr))

  Each replica adds its gradient to its own momentum (``m <- decay * m +
  g``), sends per tile of the momentum the ``k`` DCT coefficients of
  largest magnitude (one ``all_gather`` of their indices and values),
  removes them from ``m``, and returns ``sign(Q)``, ``Q`` the inverse DCT
  of the mean of what every replica sent: the same bits on every replica.
  The tiles, the algebra and the bytes are on the API page's top; the
  exchange is the sparse wire's (:func:`shardopt.topk`'s, at
  ``value_bits``).

  Args:
    axis_name: the ``pmap``/mesh/``vmap`` axis name (or tuple of names) of
      the replicas; each gradient must be per replica over it (under a
      checking ``shard_map``: params cast with ``jax.lax.pcast(...,
      to="varying")`` before ``jax.grad``).
    k: DCT coefficients sent per tile (``min(k, tile)``); the paper: 32.
    chunk_size: the largest tile side (tiles up to ``chunk_size`` squared
      for matrices, runs of up to ``chunk_size`` for vectors); the paper: 64.
    decay: the momentum's decay, ``0 <= decay < 1``; the paper: 0.999.
    value_bits: bits per sent coefficient: 32 (float32, exact, the
      paper's), 16 (bfloat16; what rounding drops stays in the momentum),
      or the quantized 1, 2, 4, 8 of :func:`shardopt.topk`.
    sign: return ``sign(Q)`` (the paper's step); False returns ``Q``, to
      chain another step after it.
    axis_index_groups: optional equal-size groups of replica indices; each
      group exchanges on its own.
    mean: how the gathered coefficients are averaged: ``"replicas"`` (the
      default) divides each coefficient's sum by the group size, as every
      shardopt mean does (a coefficient one replica sent counts ``1/n`` of
      it); ``"senders"`` divides it by the number of replicas that sent it
      (0 where none did), as the authors' code does
      (``scatter_reduce(..., "mean", include_self=False)``). Same
      collective, same bytes: the count comes from the gathered indices.

  Returns:
    An ``optax.GradientTransformation`` with
    :class:`DecoupledMomentumState`; updates in each gradient's dtype.

  Example:
    >>> import jax, numpy as np, optax, shardopt
    >>> tx = optax.chain(
    ...     shardopt.decoupled_momentum("i", k=1, chunk_size=4),
    ...     optax.scale_by_learning_rate(0.1))
    >>> r = np.arange(1.0, 9.0, dtype=np.float32)[:, None]
    >>> g = r + np.float32([0.5, -0.5, 0.5, -0.5])  # 8 replicas' gradients
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name="i")
    >>> updates, state = step(g)
    >>> updates[0]  # -0.1 * sign(Q), Q the mean of the constant parts
    Array([-0.1, -0.1, -0.1, -0.1], dtype=float32)
    >>> bool((updates == updates[0]).all())  # bit-identical on every replica
    True
    >>> np.round(np.asarray(state[0].momentum[0]), 3)  # DCT(m): what stayed
    array([[0.   , 0.383, 0.   , 0.924]], dtype=float32)

  References:
    Peng, Quesnelle and Kingma, DeMo: Decoupled Momentum Optimization,
    arXiv 2411.19870, 2024 (code: github.com/bloc97/DeMo).
  """
  _check_arguments(axis_name, k, chunk_size, decay, value_bits, sign, mean)
  on_wire = wire.of(
    sparse.TopKSpec(
      int(k), int(chunk_size), int(value_bits), error_decay=float(decay)
    )
  )

  def init_fn(params):
    def zeros(p):
      tiling = _tiling(jnp.shape(p), chunk_size)
      return jnp.zeros((tiling.tiles, tiling.tile_size), jnp.float32)

    return DecoupledMomentumState(jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    _shapes.check_like_params(_NAME, updates, params, axis_name)
    del params
    size = _axes.axis_size(axis_name, _NAME)
    groups = _axes.validate_groups(axis_index_groups, size, _NAME, axis_name)
    members = _axes.group_size(groups, size)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(updates)
    momenta = treedef.flatten_up_to(state.momentum)
    tilings = [_tiling(jnp.shape(g), chunk_size) for _, g in with_path]
    for (path, g), m, tiling in zip(with_path, momenta, tilings, strict=True):
      _check_leaf(path, g, m, tiling, axis_name)
    live = [i for i, (_, g) in enumerate(with_path) if jnp.size(g)]
    # Steps 1-2: the momentum, in the DCT domain, is the wire's error buffer.
    contributions = [
      feedback.add(_dct(with_path[i][1], tilings[i]), momenta[i], on_wire)
      for i in live
    ]
    # Steps 3-4: one all_gather; the residual is the new momentum.
    means, residuals = (
      on_wire.all_reduce(
        contributions,
        _axes.as_axis(_axes.axis_names(axis_name)),
        groups,
        members,
        divisor=members,
        invariant_result=_axes.vma_checked() and groups is None,
        residuals=True,
        chunks=tuple(tilings[i].tile_size for i in live),
        mean_over_senders=mean == "senders",
      )
      if live
      else ([], [])
    )
    out = [jnp.zeros_like(g) for _, g in with_path]
    new_momenta = list(momenta)
    for i, averaged, residual in zip(live, means, residuals, strict=True):
      g = with_path[i][1]
      q = _idct(averaged, tilings[i], jnp.shape(g))  # step 5
      out[i] = (jnp.sign(q) if sign else q).astype(g.dtype)
      new_momenta[i] = residual
    return treedef.unflatten(out), DecoupledMomentumState(
      treedef.unflatten(new_momenta)
    )

  return optax.GradientTransformation(init_fn, update_fn)
