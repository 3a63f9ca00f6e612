"""shardopt.noloco (NoLoCo, arXiv 2506.10911) against a numpy reference of
the paper's outer step, its bytes in the compiled HLO (a collective-permute
per sync, no all-reduce), the replicas' drift, and its refusals.

The reference: 8 replicas, a quadratic per replica (its own target every
step), inner SGD, and at every H-th step each replica's pair from the
authors' draw (``numpy.random.default_rng(seed + m).permutation(8)``, pairs
``perm[q], perm[q + 4]``), then section 3's update in float64::

  delta_i <- alpha delta_i - beta (Delta_i + Delta_j) / 2
                           - gamma (phi_i - (phi_i + phi_j) / 2)
  phi_i <- phi_i + delta_i;  theta_i <- phi_i

matched to float32 rounding (rtol 1e-5, atol 1e-5 on values of order 1).
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
from shardopt.periodic import gossip

R = 8
H = 4
LR = 0.1
RTOL, ATOL = 1e-5, 1e-5
SHAPES = {"a": (3,), "b": (2, 2)}


def _params0(seed=0):
  rng = np.random.default_rng(seed)
  return {
    k: rng.normal(size=s).astype(np.float32) for k, s in sorted(SHAPES.items())
  }


def _targets(steps, seed=1, scale=1.0):
  rng = np.random.default_rng(seed)
  return {
    k: (scale * rng.normal(size=(steps, R) + s)).astype(np.float32)
    for k, s in sorted(SHAPES.items())
  }


def _np_pairs(seed, m):
  perm = np.random.default_rng(seed + m).permutation(R)
  peer = np.empty(R, int)
  for q in range(R // 2):
    a, b = perm[q], perm[q + R // 2]
    peer[a], peer[b] = b, a
  return peer


def _np_noloco(params0, targets, alpha, beta, gamma, seed, num_matchings):
  """Params and slow weights after every step, (steps, R, ...) per leaf."""
  keys = sorted(params0)
  theta = {k: np.stack([params0[k].astype(np.float64)] * R) for k in keys}
  phi = {k: v.copy() for k, v in theta.items()}
  delta = {k: np.zeros_like(v) for k, v in theta.items()}
  steps = targets[keys[0]].shape[0]
  hist_p = {k: [] for k in keys}
  hist_c = {k: [] for k in keys}
  syncs = 0
  for t in range(1, steps + 1):
    for k in keys:
      theta[k] = theta[k] - LR * (theta[k] - targets[k][t - 1])
    if t % H == 0:
      peer = _np_pairs(seed, syncs % num_matchings)
      for k in keys:
        big_delta = phi[k] - theta[k]
        mean_delta = (big_delta + big_delta[peer]) / 2
        mean_phi = (phi[k] + phi[k][peer]) / 2
        delta[k] = (
          alpha * delta[k] - beta * mean_delta - gamma * (phi[k] - mean_phi)
        )
        phi[k] = phi[k] + delta[k]
        theta[k] = phi[k].copy()
      syncs += 1
    for k in keys:
      hist_p[k].append(theta[k].copy())
      hist_c[k].append(phi[k].copy())
  return (
    {k: np.stack(v) for k, v in hist_p.items()},
    {k: np.stack(v) for k, v in hist_c.items()},
  )


CASES = [
  # the paper's defaults (pull = beta, as in the authors' code)
  dict(alpha=0.5, beta=0.7, gamma=None, seed=0, num_matchings=3),
  # a pull unlike beta, one pairing only, another seed
  dict(alpha=0.3, beta=0.5, gamma=0.2, seed=5, num_matchings=1),
]


def _noloco(case):
  return shardopt.noloco(
    optax.sgd(LR),
    "batch",
    sync_period=H,
    outer_learning_rate=case["beta"],
    outer_momentum=case["alpha"],
    pull=case["gamma"],
    seed=case["seed"],
    num_matchings=case["num_matchings"],
  )


def _check(history, reference):
  params, center = history[0], history[1]
  ref_p, ref_c = reference
  for k in sorted(SHAPES):
    np.testing.assert_allclose(params[k], ref_p[k], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(center[k], ref_c[k], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_noloco_matches_numpy_reference_under_pmap(case):
  c = CASES[case]
  steps = 6 * H  # six syncs, the pairings cycled twice in case 0
  params0, targets = _params0(), _targets(steps)
  gamma = c["beta"] if c["gamma"] is None else c["gamma"]
  reference = _np_noloco(
    params0,
    targets,
    c["alpha"],
    c["beta"],
    gamma,
    c["seed"],
    c["num_matchings"],
  )
  _check(_pmap_history(_noloco(c), params0, targets), reference)


def test_noloco_matches_numpy_reference_under_shard_map():
  c = CASES[0]
  mesh = jax.make_mesh((R,), ("batch",))
  steps = 6 * H
  params0, targets = _params0(), _targets(steps)
  reference = _np_noloco(
    params0, targets, c["alpha"], c["beta"], c["beta"], c["seed"], 3
  )
  _check(_shard_map_history(_noloco(c), mesh, params0, targets), reference)


def test_gossip_sync_is_one_collective_permute_of_the_params_and_no_all_reduce():
  shapes = {"w": (64, 32), "b": (32,)}
  params_bytes = 4 * sum(int(np.prod(s)) for s in shapes.values())
  num_matchings = 4
  tx = shardopt.noloco(
    optax.adam(1e-3), "batch", sync_period=4, num_matchings=num_matchings
  )
  params = {k: jnp.zeros((R,) + s) for k, s in shapes.items()}
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  text = step.lower(params, jax.pmap(tx.init)(params)).compile().as_text()
  ops = hlo.compiled_collectives(text)
  kinds = {op.kind for op in ops}
  assert kinds == {"collective-permute"}, kinds  # no all-reduce at all
  assert all(op.context == "conditional" for op in ops), ops
  # One cond per matching (the schedule's syncs), each sending the params
  # once to the one peer; nothing on the untaken branches.
  conds = hlo.branch_collectives(text, outermost=True)
  assert len(conds) == num_matchings, conds
  for untaken, taken in conds:
    assert untaken == []
    assert sum(op.buffer_bytes for op in taken) == params_bytes, taken
    assert all(hlo.sent_bytes(op) == op.buffer_bytes for op in taken)
  # Per step: the params once per H steps, what one replica sends.
  schedule = hlo.Schedule(gossip.schedule(4, num_matchings))
  per_step = hlo.per_step(ops, schedule, measure=hlo.sent_bytes)
  assert per_step["warning"] == ""
  assert per_step["peak_bytes"] == params_bytes
  assert per_step["mean_bytes"] == params_bytes / 4


def test_replicas_differ_and_their_spread_stays_bounded():
  """64 syncs of noisy quadratics: the params' spread across replicas
  (replica_divergence, the largest element difference) right after each
  sync settles instead of growing (about 0.5 here, against 0.24 after the
  first sync and up to 1.05 in the first 16); without the pull (gamma = 0)
  it settles about twice as wide (about 1.04)."""
  syncs = 64
  steps = syncs * H
  params0, targets = _params0(), _targets(steps, seed=3)
  out = {}
  for gamma in (None, 0.0):
    tx = shardopt.noloco(optax.sgd(LR), "batch", sync_period=H, pull=gamma)
    div = _pmap_history(tx, params0, targets)[2][:, 0]
    out[gamma] = div[H - 1 :: H]  # right after each sync
  with_pull, without = out[None], out[0.0]
  assert np.all(with_pull > 0)  # never identical
  first, last = with_pull[:16].max(), with_pull[-16:].max()
  assert last < 2 * first, (first, last)
  assert without[-16:].mean() > 1.5 * with_pull[-16:].mean(), (
    without[-16:].mean(),
    with_pull[-16:].mean(),
  )


def test_odd_replica_count_is_refused():
  tx = shardopt.noloco(optax.sgd(LR), "batch", sync_period=1)
  params = jnp.zeros((3, 2))
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  with pytest.raises(ValueError, match=r"shardopt.noloco.*even"):
    step(params, jax.pmap(tx.init)(params))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(outer_momentum=1.0), "outer_momentum=1.0"),
    (dict(outer_learning_rate=0.0), "outer_learning_rate=0.0"),
    (dict(pull=-0.1), "pull=-0.1"),
    (dict(num_matchings=0), "num_matchings=0"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(comm_dtype=jnp.int8), "comm_dtype=.*int8.* is not offered"),
    (dict(error_feedback=True), "error_feedback=True is not offered"),
    (dict(num_fragments=2), "num_fragments=2 is not offered"),
    (dict(axis_index_groups=[[0, 1]]), "axis_index_groups=.* is not offered"),
  ],
)
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=r"shardopt\.noloco: " + match):
    shardopt.noloco(optax.sgd(LR), "batch", **kwargs)


def test_island_split_refuses_the_gossip():
  from shardopt.periodic import split

  tx = shardopt.noloco(optax.sgd(LR), "batch")
  with pytest.raises(ValueError, match="gossip"):
    split.engine_of(tx, "test")


def test_identical_replicas_stay_identical_until_pairs_differ():
  """With the same data on every replica NoLoCo is DiLoCo-like: pairs agree,
  and every replica holds the same bits after every step."""
  params0 = _params0()
  targets = _targets(4 * H)
  same = jax.tree.map(lambda v: np.repeat(v[:, :1], R, axis=1), targets)
  params, _, div = _pmap_history(_noloco(CASES[0]), params0, same)
  assert np.all(div == 0)
  for k in params:
    for r in range(1, R):
      chex.assert_trees_all_equal(params[k][:, r], params[k][:, 0])


def test_each_matching_is_the_authors_grouping_of_its_permutation():
  """The authors' code (jkolehm/noloco, src/noloco/sparse_optimizer_c.py)
  splits a random permutation of the replicas into groups of two with
  ``batched``: element ``i`` joins group ``i % (n // 2)``, written out here.
  gossip.matching's pairs are those groups, in order, for every size and
  draw (the draw itself differs: the authors seed it with the step count at
  every sync, shardopt with ``seed + m`` for a cycle of matchings;
  docs/noloco.md, "Against the paper")."""
  for n in (2, 4, 8, 16):
    for seed, m in ((0, 0), (0, 5), (7, 3), (100, 15)):
      perm = [int(x) for x in np.random.default_rng(seed + m).permutation(n)]
      groups = [[] for _ in range(n // 2)]
      for i, x in enumerate(perm):
        groups[i % (n // 2)].append(x)
      assert [tuple(g) for g in groups] == gossip.matching(n, seed, m)
