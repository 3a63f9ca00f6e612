"""diloco(..., eager=True) (Eager updates, arXiv 2502.12996) against a numpy
reference of the eager rule, its bytes in the compiled HLO (DiLoCo's
all-reduce, unchanged), and what stays identical across replicas.

The reference: 8 replicas, a quadratic per replica (its own target every
step), inner SGD, and at every H-th step, per replica ``m``, in float64::

  Delta_m(k) = center_m - theta_m
  g_m(k)     = Delta_m(k) / M + (mean(k - 1) - Delta_m(k - 1) / M)
  center_m   <- Nesterov SGD(center_m, g_m(k));  theta_m <- center_m

(``mean(0) - Delta_m(0) / M`` = 0), the outer step optax's
``sgd(lr, momentum, nesterov=True)`` written out: ``t <- mu t + g``,
``center <- center - lr (g + mu t)``. Matched to float32 rounding (rtol
1e-5, atol 1e-5 on values of order 1).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _quadratic_replicas import pmap_history as _pmap_history
from _quadratic_replicas import shard_map_history as _shard_map_history

import shardopt
from shardopt.measure import hlo

R = 8
H = 4
LR = 0.1
OUTER_LR, MU = 0.7, 0.9
RTOL, ATOL = 1e-5, 1e-5
SHAPES = {"a": (3,), "b": (2, 2)}


def _params0(seed=0):
  rng = np.random.default_rng(seed)
  return {
    k: rng.normal(size=s).astype(np.float32) for k, s in sorted(SHAPES.items())
  }


def _targets(steps, seed=1):
  rng = np.random.default_rng(seed)
  return {
    k: rng.normal(size=(steps, R) + s).astype(np.float32)
    for k, s in sorted(SHAPES.items())
  }


def _eager(**kwargs):
  return shardopt.diloco(
    optax.sgd(LR),
    "batch",
    sync_period=H,
    outer_learning_rate=OUTER_LR,
    outer_momentum=MU,
    nesterov=True,
    **kwargs,
  )


def _np_eager(params0, targets):
  keys = sorted(params0)
  theta = {k: np.stack([params0[k].astype(np.float64)] * R) for k in keys}
  center = {k: v.copy() for k, v in theta.items()}
  trace = {k: np.zeros_like(v) for k, v in theta.items()}
  others = {k: np.zeros_like(v) for k, v in theta.items()}
  hist_p, hist_c = {k: [] for k in keys}, {k: [] for k in keys}
  for t in range(1, targets[keys[0]].shape[0] + 1):
    for k in keys:
      theta[k] = theta[k] - LR * (theta[k] - targets[k][t - 1])
    if t % H == 0:
      for k in keys:
        delta = center[k] - theta[k]
        g = delta / R + others[k]
        trace[k] = MU * trace[k] + g
        center[k] = center[k] - OUTER_LR * (g + MU * trace[k])
        others[k] = delta.mean(0, keepdims=True) - delta / R
        theta[k] = center[k].copy()
    for k in keys:
      hist_p[k].append(theta[k].copy())
      hist_c[k].append(center[k].copy())
  return (
    {k: np.stack(v) for k, v in hist_p.items()},
    {k: np.stack(v) for k, v in hist_c.items()},
  )


def _check(history, reference):
  for got, want in zip(history[:2], reference, strict=True):
    for k in sorted(SHAPES):
      np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL)


def test_eager_matches_numpy_reference_under_pmap():
  params0, targets = _params0(), _targets(6 * H)  # six syncs
  _check(
    _pmap_history(_eager(eager=True), params0, targets),
    _np_eager(params0, targets),
  )


def test_eager_matches_numpy_reference_under_shard_map():
  mesh = jax.make_mesh((R,), ("batch",))
  params0, targets = _params0(), _targets(6 * H)
  _check(
    _shard_map_history(_eager(eager=True), mesh, params0, targets),
    _np_eager(params0, targets),
  )


def _sync_bytes(tx, shapes):
  """(top-level collectives, all-reduce-equivalent bytes of each outermost
  conditional branch) of one compiled step."""
  params = {k: jnp.zeros((R,) + s) for k, s in sorted(shapes.items())}
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  text = step.lower(params, jax.pmap(tx.init)(params)).compile().as_text()
  top = [op for op in hlo.compiled_collectives(text) if op.context == "top"]
  branches = [
    sorted((op.kind, op.buffer_bytes) for op in branch)
    for cond in hlo.branch_collectives(text, outermost=True)
    for branch in cond
  ]
  return top, branches


@pytest.mark.parametrize("comm_dtype", [None, jnp.int8])
def test_eager_sends_what_diloco_sends(comm_dtype):
  shapes = {"w": (64, 32), "b": (32,)}
  kw = dict(sync_period=4, comm_dtype=comm_dtype)
  eager = _sync_bytes(
    shardopt.diloco(optax.adam(1e-3), "batch", eager=True, **kw), shapes
  )
  plain = _sync_bytes(shardopt.diloco(optax.adam(1e-3), "batch", **kw), shapes)
  overlapped = _sync_bytes(
    shardopt.diloco(optax.adam(1e-3), "batch", overlap_steps=1, **kw), shapes
  )
  assert eager == plain == overlapped, (eager, plain, overlapped)
  top, branches = eager
  assert top == []
  params_bytes = 4 * (64 * 32 + 32)
  if comm_dtype is None:  # the outer gradient and the 4-byte count
    assert max(sum(b for _, b in br) for br in branches) == params_bytes + 4


def test_replicas_with_the_same_outer_gradients_stay_bit_identical():
  params0 = _params0()
  targets = _targets(5 * H)
  same = jax.tree.map(lambda v: np.repeat(v[:, :1], R, axis=1), targets)
  params, center, div = _pmap_history(_eager(eager=True), params0, same)
  assert np.all(div == 0)
  for tree in (params, center):
    for k in tree:
      for r in range(1, R):
        chex.assert_trees_all_equal(tree[k][:, r], tree[k][:, 0])


def _center_spread(center):
  """Per step, the largest difference of a center element across replicas."""
  return np.max(
    [
      (c.max(1) - c.min(1)).reshape(c.shape[0], -1).max(1)
      for c in center.values()
    ],
    axis=0,
  )


def test_replicas_with_different_data_differ_by_their_own_terms():
  """DiLoCo's centers are bit-identical after every sync; eager's differ by
  the replicas' own terms (1/M of their outer gradients, through the outer
  momentum): a spread smaller than the inner phase's spread of the params
  just before each sync."""
  params0, targets = _params0(), _targets(6 * H)
  _, center, div = _pmap_history(_eager(eager=True), params0, targets)
  _, plain_center, _ = _pmap_history(_eager(), params0, targets)
  for k in plain_center:
    for r in range(1, R):
      chex.assert_trees_all_equal(plain_center[k][:, r], plain_center[k][:, 0])
  spread = _center_spread(center)[H - 1 :: H]
  before = div[H - 2 :: H, 0]
  assert np.all(spread > 0)
  assert np.all(spread < before), (spread, before)


@pytest.mark.parametrize(
  "kwargs, arg",
  [
    (dict(num_fragments=2), "num_fragments=2"),
    (dict(overlap_steps=1), "overlap_steps=1"),
    (dict(overlap_alpha=0.5), "overlap_alpha=0.5"),
  ],
)
def test_eager_refuses_streaming_overlap(kwargs, arg):
  with pytest.raises(
    ValueError, match=r"shardopt\.diloco: eager=True with " + arg
  ):
    shardopt.diloco(optax.sgd(LR), "batch", sync_period=4, eager=True, **kwargs)


def test_eager_must_be_a_bool():
  with pytest.raises(TypeError, match=r"shardopt\.diloco: eager='yes'"):
    shardopt.diloco(optax.sgd(LR), "batch", eager="yes")


def test_island_split_refuses_eager():
  from shardopt.periodic import split

  tx = shardopt.diloco(optax.sgd(LR), "batch", eager=True)
  with pytest.raises(ValueError, match="eager=True"):
    split.engine_of(tx, "test")
