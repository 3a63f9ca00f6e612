"""Pier (arXiv 2511.17849): DiLoCo whose outer momentum warms up and decays
(``shardopt.pier_momentum`` as ``shardopt.diloco``'s ``outer_momentum``).

The references are written here in numpy: the schedule's piecewise-linear
formula, and DiLoCo with a Nesterov outer step whose momentum ``mu_k``
follows it, ``k`` the outer step (0 at the first sync), over 8 syncs of 8
replicas (float64; matched to float32 rounding, ``rtol=1e-5,
atol=1e-6``).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _docs_pages import run_page
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

AXIS = "batch"
R = 8
N = 4


def _formula(k, total, peak, warm_frac, decay_frac, final):
  """The schedule, written out: ramps of round(fraction * total) steps."""
  w = round(warm_frac * total)
  d = round(decay_frac * total)
  if k < w:
    return peak * k / w
  if k < total - d or d == 0:  # no decay: the peak to the end
    return peak
  if k >= total:
    return final
  return peak + (final - peak) * (k - (total - d)) / d


@pytest.mark.parametrize(
  "total, peak, warm, decay, final",
  [
    (96, 0.9, 0.1, 0.1, 0.0),
    (10, 0.9, 0.2, 0.2, 0.0),
    (7, 0.5, 0.0, 0.3, 0.2),
    (12, 0.95, 0.25, 0.0, 0.0),
    (5, 0.9, 0.6, 0.4, 0.1),
  ],
)
def test_the_schedule_is_the_formula(total, peak, warm, decay, final):
  schedule = shardopt.pier_momentum(
    total,
    peak=peak,
    warmup_fraction=warm,
    decay_fraction=decay,
    final=final,
  )
  got = np.asarray([float(schedule(k)) for k in range(total + 3)])
  want = [
    _formula(k, total, peak, warm, decay, final) for k in range(total + 3)
  ]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  # Traced (the outer optimizer's counter is an int32 array).
  traced = jax.jit(jax.vmap(schedule))(jnp.arange(total + 3, dtype=jnp.int32))
  np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-6, atol=1e-7)


def _reference(w0, grads, period, syncs, lr, mus, inner_lr):
  """DiLoCo in numpy: SGD inner steps (each replica its own constant
  gradient), then the outer Nesterov step with momentum ``mus[k]`` at sync
  ``k``: buf = mu buf + Delta; center -= lr (Delta + mu buf)."""
  center = np.asarray(w0, np.float64)
  buf = np.zeros_like(center)
  centers = []
  for k in range(syncs):
    local = center[None] - inner_lr * period * grads.astype(np.float64)
    delta = center - local.mean(0)
    mu = mus[k]
    buf = mu * buf + delta
    center = center - lr * (delta + mu * buf)
    centers.append(center.copy())
  return centers


def _run(tx, w0, grads, steps):
  mesh = jax.make_mesh((R,), (AXIS,))
  specs = jax.tree.map(
    lambda v: P() if jnp.ndim(v) == 0 else P(AXIS), tx.init(jnp.zeros((1, N)))
  )

  def step(w, state, g):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(AXIS), out_specs=specs)
  )
  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(AXIS), specs, P(AXIS)),
      out_specs=(P(AXIS), specs),
    )
  )
  rows = NamedSharding(mesh, P(AXIS))
  w = jax.device_put(jnp.tile(jnp.asarray(w0), (R, 1)), rows)
  g = jax.device_put(jnp.asarray(grads), rows)
  state = init(w)
  centers = []
  for t in range(1, steps + 1):
    w, state = step(w, state, g)
    centers.append(np.asarray(state.center).reshape(R, N)[0])
  return centers, state


def test_diloco_with_pier_momentum_matches_numpy_over_8_syncs():
  """The outer momentum follows the OUTER step count: with H = 3 inner steps
  per sync, sync k uses mu(k), not mu(3k) (the numbers would differ)."""
  period, syncs, total = 3, 8, 8
  schedule = shardopt.pier_momentum(
    total, peak=0.9, warmup_fraction=0.25, decay_fraction=0.25
  )
  tx = shardopt.diloco(
    optax.sgd(0.1),
    AXIS,
    sync_period=period,
    outer_learning_rate=0.7,
    outer_momentum=schedule,
  )
  rng = np.random.default_rng(0)
  w0 = rng.normal(size=N).astype(np.float32)
  grads = rng.normal(size=(R, N)).astype(np.float32)
  centers, state = _run(tx, w0, grads, period * syncs)
  mus = [_formula(k, total, 0.9, 0.25, 0.25, 0.0) for k in range(syncs)]
  assert mus == [0.0, 0.45, 0.9, 0.9, 0.9, 0.9, 0.9, 0.45]
  want = _reference(w0, grads, period, syncs, 0.7, mus, 0.1)
  got = [centers[period * (k + 1) - 1] for k in range(syncs)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The schedule read at the inner step count instead gives other numbers.
  inner = [
    _formula(period * k, total, 0.9, 0.25, 0.25, 0.0) for k in range(syncs)
  ]
  wrong = _reference(w0, grads, period, syncs, 0.7, inner, 0.1)
  assert not np.allclose(got, wrong, rtol=1e-3)
  # The outer optimizer counted its own steps: one per sync.
  assert int(np.ravel(state.global_state.count)[0]) == syncs
  # The center is bit-identical on every replica.
  center = np.asarray(state.center).reshape(R, N)
  assert np.all(center == center[0])


def test_a_constant_schedule_is_plain_diloco():
  """outer_momentum=lambda k: 0.9 gives diloco(outer_momentum=0.9)'s centers
  to float32 rounding (inject_hyperparams vs the plain optax.sgd)."""
  rng = np.random.default_rng(1)
  w0 = rng.normal(size=N).astype(np.float32)
  grads = rng.normal(size=(R, N)).astype(np.float32)
  kw = dict(sync_period=2, outer_learning_rate=0.7)
  scheduled = shardopt.diloco(
    optax.sgd(0.1), AXIS, outer_momentum=lambda k: 0.9, **kw
  )
  plain = shardopt.diloco(optax.sgd(0.1), AXIS, outer_momentum=0.9, **kw)
  a, _ = _run(scheduled, w0, grads, 10)
  b, _ = _run(plain, w0, grads, 10)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_due_is_diloco_s():
  tx = shardopt.diloco(
    optax.adamw(1e-3),
    AXIS,
    sync_period=4,
    outer_momentum=shardopt.pier_momentum(10),
  )
  assert [shardopt.due(tx, t) for t in range(1, 9)] == [0, 0, 0, 1] * 2


def test_refusals_name_the_argument_and_the_fix():
  with pytest.raises(ValueError, match=r"pier_momentum: total_outer_steps=0"):
    shardopt.pier_momentum(0)
  with pytest.raises(ValueError, match=r"peak=1.0 must be a momentum in"):
    shardopt.pier_momentum(10, peak=1.0)
  with pytest.raises(ValueError, match=r"warmup_fraction=1.5 must be"):
    shardopt.pier_momentum(10, warmup_fraction=1.5)
  with pytest.raises(ValueError, match=r"their sum must be <= 1"):
    shardopt.pier_momentum(10, warmup_fraction=0.6, decay_fraction=0.6)
  with pytest.raises(ValueError, match=r"outer_optimizer replaces"):
    shardopt.diloco(
      optax.adam(1e-3),
      AXIS,
      outer_momentum=shardopt.pier_momentum(10),
      outer_optimizer=optax.sgd(0.7),
    )


def test_the_docs_page_runs_and_prints_what_it_says(capsys):
  """docs/pier.md's python blocks, run in order in one namespace (as
  tests/test_guides.py runs the guides), print what the page says."""
  run_page("pier")
  printed = capsys.readouterr().out
  text = (
    pathlib.Path(__file__).resolve().parents[1] / "docs" / "pier.md"
  ).read_text()
  lines = printed.strip().splitlines()
  count, mu = lines[1].split()
  assert int(count) == 24 and abs(float(mu) - 0.15) < 1e-6
  assert "24 outer steps" in text and "momentum 0.15" in text
  schedule = [float(x) for x in lines[0].strip("[]").split(", ")]
  want = [_formula(k, 24, 0.9, 0.25, 0.25, 0.0) for k in range(24)]
  np.testing.assert_allclose(schedule, want, atol=1e-3)
  assert schedule[:7] == [0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9]
