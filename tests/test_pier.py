"""Pier (arXiv 2511.17849) as its authors' code runs it: ``shardopt.pier``,
and its two schedules ``shardopt.pier_momentum`` (momentum decay) and
``shardopt.pier_learning_rate`` (the outer rate's warm-up and decay), for
``shardopt.diloco``'s ``outer_momentum`` / ``outer_learning_rate``.

The references are written here in numpy from the authors' training loop
(github.com/zetsunozomi/Pier-LLM-Pretraining, megatron/training/training.py:
the "Momentum Produce" lazy start and the ``pytorch_nesterov`` outer step),
its schedules evaluated at the inner step of each sync as that loop does,
not from shardopt's outer-step formulas (float64; matched to float32
rounding).
"""

from __future__ import annotations

import math
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


def _authors_mu(step, total_steps, lazy_frac=0.1, start=0.99, end=0.9):
  """training.py: t = (iteration / T - lazy) / (1 - lazy), cosine start->end."""
  t = min(max(0.0, (step / total_steps - lazy_frac) / (1.0 - lazy_frac)), 1.0)
  return end + 0.5 * (start - end) * (1 + math.cos(math.pi * t))


def _authors_lr(step, total_steps, warm_start, peak=1.1, final=0.9):
  """training.py: linear 0 -> peak over 0.1 T steps from the lazy start's
  end, then a cosine peak -> final to the end of the run."""
  lr_warmup = 0.1 * total_steps
  warm_end = warm_start + lr_warmup
  if step < warm_end:
    return peak * (step - warm_start) / lr_warmup
  t = min((step - warm_end) / max(total_steps - warm_end, 1), 1.0)
  return final + 0.5 * (peak - final) * (1 + math.cos(math.pi * t))


@pytest.mark.parametrize(
  "total_steps, period", [(1000, 10), (120, 3), (4500, 50)]
)
def test_the_schedules_are_the_authors_at_each_sync(total_steps, period):
  """Sync j of the DiLoCo phase falls after inner step W + (j + 1) H (W:
  the synchronous 10%); the outer-step schedules give the authors' values
  of that step."""
  syncs = total_steps // period
  warm = round(0.1 * syncs)
  total = syncs - warm
  mu = shardopt.pier_momentum(total)
  lr = shardopt.pier_learning_rate(total, warmup_outer_steps=warm)
  steps = [warm * period + (j + 1) * period for j in range(total)]
  want_mu = [_authors_mu(s, total_steps) for s in steps]
  want_lr = [_authors_lr(s, total_steps, warm * period) for s in steps]
  got_mu = [float(mu(j)) for j in range(total)]
  got_lr = [float(lr(j)) for j in range(total)]
  np.testing.assert_allclose(got_mu, want_mu, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_lr, want_lr, rtol=1e-6, atol=1e-6)
  # Traced (the outer optimizer's counter is an int32 array).
  traced = jax.jit(jax.vmap(mu))(jnp.arange(total, dtype=jnp.int32))
  np.testing.assert_allclose(np.asarray(traced), want_mu, rtol=1e-6, atol=1e-6)
  # The default warm-up of the rate is K / 9 outer steps (10% of the run
  # after a synchronous 10%).
  if total % 9 == 0:
    default = shardopt.pier_learning_rate(total)
    assert [float(default(j)) for j in range(total)] == got_lr


def _reference(w0, grads, period, syncs, lrs, mus, inner_lr):
  """DiLoCo in numpy: SGD inner steps (each replica its own constant
  gradient), then the outer Nesterov step with momentum ``mus[k]`` and
  rate ``lrs[k]`` at sync ``k``: buf = mu buf + Delta; center -= lr (Delta
  + mu buf)."""
  center = np.asarray(w0, np.float64)
  buf = np.zeros_like(center)
  centers = []
  for k in range(syncs):
    local = center[None] - inner_lr * period * grads.astype(np.float64)
    delta = center - local.mean(0)
    mu, lr = mus[k], lrs[k]
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


def test_diloco_with_pier_schedules_matches_numpy_over_9_syncs():
  """The schedules follow the OUTER step count: with H = 3 inner steps per
  sync, sync k uses mu(k) and lr(k), not their values at 3k."""
  period, syncs = 3, 9
  mu = shardopt.pier_momentum(syncs)
  lr = shardopt.pier_learning_rate(syncs)  # J = 1: 1.1, then cosine to 0.9
  tx = shardopt.diloco(
    optax.sgd(0.1),
    AXIS,
    sync_period=period,
    outer_learning_rate=lr,
    outer_momentum=mu,
  )
  rng = np.random.default_rng(0)
  w0 = rng.normal(size=N).astype(np.float32)
  grads = rng.normal(size=(R, N)).astype(np.float32)
  centers, state = _run(tx, w0, grads, period * syncs)
  # A DiLoCo phase of 9 syncs after no synchronous phase: sync k falls after
  # step 3 (k + 1) of a T = 27 run with lazy fraction 0.
  mus = [_authors_mu(3 * (k + 1), 27, lazy_frac=0.0) for k in range(syncs)]
  lrs = [1.1] + [
    0.9 + 0.1 * (1 + math.cos(math.pi * k / (syncs - 1)))
    for k in range(1, syncs)
  ]
  want = _reference(w0, grads, period, syncs, lrs, mus, 0.1)
  got = [centers[period * (k + 1) - 1] for k in range(syncs)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Read at the inner step count instead, other numbers.
  inner = [
    _authors_mu(3 * (3 * k + 1), 27, lazy_frac=0.0) for k in range(syncs)
  ]
  wrong = _reference(w0, grads, period, syncs, lrs, inner, 0.1)
  assert not np.allclose(got, wrong, rtol=1e-3)
  # The outer optimizer counted its own steps: one per sync.
  assert int(np.ravel(state.global_state.count)[0]) == syncs
  center = np.asarray(state.center).reshape(R, N)
  assert np.all(center == center[0])


def _authors_loop(w0, a, b, total_steps, period, inner_lr, warm_momentum=True):
  """Pier in numpy, as the authors' training loop runs it (each replica r
  its own quadratic, gradient a_r (w - b_r), inner SGD):

  - steps 1..W (W = 0.1 T): the gradient averaged over the replicas (DDP);
    after every H of them: m = 0.9 m + (ref - w), ref = w ("Momentum
    Produce": no outer step);
  - then local steps; after every H: Delta = ref - mean_r(w_r), mu and lr
    at that step (the authors' formulas), m = mu m + Delta, ref = ref - lr
    (Delta + mu m), every replica restarts from ref.

  ``warm_momentum=False``: m reset to 0 when the DiLoCo phase starts (the
  synchronous phase's momentum thrown away). Returns ref after every sync."""
  a, b = a.astype(np.float64), b.astype(np.float64)
  warm = int(0.1 * total_steps)
  ref = np.asarray(w0, np.float64)
  m = np.zeros_like(ref)
  w = np.tile(ref, (R, 1))
  refs = []
  for step in range(1, total_steps + 1):
    if step == warm + 1 and not warm_momentum:
      m = np.zeros_like(ref)
    g = a * (w - b)
    if step <= warm:
      g = np.tile(g.mean(0), (R, 1))
    w = w - inner_lr * g
    if step % period:
      continue
    delta = ref - w.mean(0)
    if step <= warm:
      m = 0.9 * m + delta
      ref = w.mean(0)
    else:
      mu = _authors_mu(step, total_steps)
      lr = _authors_lr(step, total_steps, warm)
      m = mu * m + delta
      ref = ref - lr * (delta + mu * m)
    w = np.tile(ref, (R, 1))
    refs.append(ref.copy())
  return refs


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_pier_is_the_authors_loop_over_40_syncs(mapping):
  """shardopt.pier, 8 replicas, T = 120 steps, H = 3: 4 synchronous syncs
  (momentum warm-up), then 36 DiLoCo syncs (momentum decay, the outer
  rate's warm-up over 4 syncs and its cosine decay), against the authors'
  loop in numpy: every center after every sync to float32 rounding."""
  total_steps, period = 120, 3
  tx = shardopt.pier(
    optax.sgd(0.05), AXIS, total_steps=total_steps, sync_period=period
  )
  rng = np.random.default_rng(3)
  w0 = rng.normal(size=N).astype(np.float32)
  a = rng.uniform(0.5, 2.0, size=(R, N)).astype(np.float32)
  b = rng.normal(size=(R, N)).astype(np.float32)

  def step(w, state, a, b):
    updates, state = tx.update(a * (w - b), state, w)
    return optax.apply_updates(w, updates), state

  if mapping == "pmap":
    step = jax.pmap(step, axis_name=AXIS)
    w = jnp.tile(jnp.asarray(w0), (R, 1))
    state = jax.pmap(tx.init)(w)
    a_, b_ = jnp.asarray(a), jnp.asarray(b)
  else:
    mesh = jax.make_mesh((R,), (AXIS,))
    specs = jax.tree.map(
      lambda v: P() if jnp.ndim(v) == 0 else P(AXIS),
      tx.init(jnp.zeros((1, N))),
    )
    rows = NamedSharding(mesh, P(AXIS))
    step = jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), specs),
      )
    )
    init = jax.jit(
      jax.shard_map(tx.init, mesh=mesh, in_specs=P(AXIS), out_specs=specs)
    )
    w = jax.device_put(jnp.tile(jnp.asarray(w0), (R, 1)), rows)
    state = init(w)
    a_, b_ = jax.device_put(a, rows), jax.device_put(b, rows)
  centers = []
  for t in range(1, total_steps + 1):
    w, state = step(w, state, a_, b_)
    if t % period == 0:
      center = np.asarray(state.center).reshape(R, N)
      assert np.all(center == center[0])
      centers.append(center[0])
  want = _authors_loop(w0, a, b, total_steps, period, 0.05)
  assert len(centers) == len(want) == 40
  np.testing.assert_allclose(centers, want, rtol=2e-5, atol=2e-6)
  # The synchronous phase kept the replicas identical: after sync 4 the
  # params are the center (and were one copy all along).
  assert int(np.ravel(state.global_state.count)[0]) == 40
  # Without the synchronous phase's momentum the numbers differ (it is
  # not a no-op): zero the warm-up's accumulation in the reference.
  refs_no_m = _authors_loop(
    w0, a, b, total_steps, period, 0.05, warm_momentum=False
  )
  assert not np.allclose(centers, refs_no_m, rtol=1e-3)


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
  with pytest.raises(ValueError, match=r"start=1.0 must be a number in"):
    shardopt.pier_momentum(10, start=1.0)
  with pytest.raises(ValueError, match=r"warmup_outer_steps=11 must be"):
    shardopt.pier_learning_rate(10, warmup_outer_steps=11)
  with pytest.raises(ValueError, match=r"peak=0.0 must be > 0"):
    shardopt.pier_learning_rate(10, peak=0.0)
  with pytest.raises(ValueError, match=r"no DiLoCo phase left"):
    shardopt.pier(
      optax.sgd(0.1), AXIS, total_steps=20, sync_period=10, warmup_fraction=0.9
    )
  with pytest.raises(ValueError, match=r"warmup_fraction=1.0 must be"):
    shardopt.pier(optax.sgd(0.1), AXIS, total_steps=100, warmup_fraction=1.0)
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
  namespace = run_page("pier")
  printed = capsys.readouterr().out.strip().splitlines()
  text = (
    pathlib.Path(__file__).resolve().parents[1] / "docs" / "pier.md"
  ).read_text()
  text = " ".join(text.split())
  assert printed[0] == "[0.9898 0.945  0.9   ] [0.275 1.1   0.9  ]"
  assert "`[0.9898 0.945 0.9]`, `[0.275 1.1 0.9]`" in text
  assert printed[1] == "40 True True"
  assert "then `40 True True`" in text
  spread = namespace["spread"]
  assert max(spread[:12]) == 0.0 and max(spread[12:]) > 0.1
