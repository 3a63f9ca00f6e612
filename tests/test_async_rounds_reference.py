"""The numpy reference of asynchronous rounds (tests/_async_rounds_reference.py)
against hand-computed cases, and which staleness rule does best on its toy
quadratic (printed; asserted only where a hand computation backs it)."""

import numpy as np
import pytest

from tests import _async_rounds_reference as ref

# One dimension, two islands pulling opposite ways; inner lr 0.5 and one inner
# step per round, so an island started at c ends at c + 0.5 (target - c) and
# contributes delta = c - that = 0.5 (c - target).
TWO = dict(targets=[[1.0], [-1.0]], x0=[0.0], sync_period=1, inner_lr=0.5)


def run(**kw):
  args = dict(TWO, outer_lr=1.0, outer_momentum=0.0)
  args.update(kw)
  return ref.simulate(**args)


def test_equal_speeds_quorum_two_is_one_synchronous_round():
  # Both start at 0 and arrive at t=1: g = mean(0.5*(0-1), 0.5*(0+1)) = 0.
  (v1, *_) = run(speeds=[1.0, 1.0], quorum=2, until=1.0)
  assert (v1.version, v1.time, v1.contributors, v1.weights, v1.staleness) == (
    1,
    1.0,
    [0, 1],
    [1.0, 1.0],
    [0, 0],
  )
  np.testing.assert_allclose(v1.center, [0.0])


def test_quorum_one_with_a_stale_contribution():
  # Island 1 (speed 2.5) arrives at 0.4, 0.8 and 1.2; island 0 at 1.0.
  # 0.4: island 1 from c0=0: delta 0.5 -> c1 = -0.5.
  # 0.8: island 1 from c1=-0.5: ends at -0.75, delta 0.25 -> c2 = -0.75.
  # 1.0: island 0 from c0=0 (stale by 2): delta -0.5 -> c3 = -0.75 + 0.5 f(2).
  for rule, c3 in (("none", -0.25), ("inverse", -0.75 + 0.5 / 3)):
    vs = run(speeds=[1.0, 2.5], quorum=1, rule=rule, until=1.0)
    assert [v.time for v in vs] == [0.4, 0.8, 1.0]
    assert [v.contributors for v in vs] == [[1], [1], [0]]
    assert [v.staleness for v in vs] == [[0], [0], [2]]
    np.testing.assert_allclose([v.center[0] for v in vs], [-0.5, -0.75, c3])


def test_quorum_two_and_grace():
  # Quorum 2: 0.8: island 1's two contributions from c0 (0.5 each) -> c1 = -0.5.
  # 1.2: island 0 from c0 (stale 1, delta -0.5) and island 1 from c1 (delta 0.25).
  vs = run(speeds=[1.0, 2.5], quorum=2, until=1.25)
  assert [(v.contributors, v.staleness) for v in vs] == [
    ([1, 1], [0, 0]),
    ([0, 1], [1, 0]),
  ]
  np.testing.assert_allclose([v.time for v in vs], [0.8, 1.2])
  np.testing.assert_allclose([v.center[0] for v in vs], [-0.5, -0.5 + 0.125])
  vs = run(speeds=[1.0, 2.5], quorum=2, rule="inverse", until=1.25)
  np.testing.assert_allclose(vs[1].center, [-0.5 - (-0.5 / 2 + 0.25) / 2])
  # Grace 0.1: island 1's first contribution alone at 0.4 + 0.1.
  vs = run(speeds=[1.0, 2.5], quorum=2, grace=0.1, until=0.5)
  assert [(v.time, v.contributors) for v in vs] == [(0.5, [1])]
  np.testing.assert_allclose(vs[0].center, [-0.5])


def test_nesterov_outer_step():
  # One contribution g = 0.5 (island 1 alone, quorum 1), lr 0.7, beta 0.9:
  # m = g, x = 0 - 0.7 (g + 0.9 m).
  (v1, *_) = run(
    speeds=[0.1, 2.5], quorum=1, outer_lr=0.7, outer_momentum=0.9, until=0.4
  )
  np.testing.assert_allclose(v1.center, [-0.7 * (0.5 + 0.9 * 0.5)])


def test_delayed_nesterov_with_c_zero_is_one_synchronous_step_per_period():
  # Two outer steps of one contribution each (island 1 at 0.4 from c0, then
  # at 0.8 from c1), DN period 2, c = 0: g1/2 applied, then g2/2 and beta*m
  # with m = (g1 + g2)/2: one Nesterov step on the mean of g1 and g2.
  lr, beta = 0.7, 0.9
  vs = run(
    speeds=[0.1, 2.5],
    quorum=1,
    outer_lr=lr,
    outer_momentum=beta,
    rule="delayed_nesterov",
    dn_period=2,
    until=0.8,
  )
  g1 = 0.5 * (0.0 + 1.0)
  c1 = -lr * g1 / 2
  g2 = 0.5 * (c1 + 1.0)
  np.testing.assert_allclose(vs[0].center, [c1])
  np.testing.assert_allclose(
    vs[1].center, [-lr * ((g1 + g2) / 2 + beta * (g1 + g2) / 2)]
  )


def test_rules_are_checked():
  with pytest.raises(ValueError, match="rule"):
    run(speeds=[1.0, 1.0], rule="nope", until=1.0)


def compare(speeds, until=60.0, seeds=3):
  """Final global loss per rule on a 16-dim quadratic with one target per
  island, the same wall time for every rule; mean over seeds."""
  out = {}
  for rule in ref.RULES:
    losses = []
    for seed in range(seeds):
      rng = np.random.default_rng(seed)
      targets = rng.normal(size=(len(speeds), 16))
      x0 = rng.normal(size=16) * 3
      vs = ref.simulate(
        speeds=speeds,
        targets=targets,
        x0=x0,
        sync_period=8,
        inner_lr=0.05,
        outer_lr=0.7,
        outer_momentum=0.9,
        quorum=1,
        rule=rule,
        until=until,
      )
      optimum = ref.global_loss(np.mean(targets, 0), targets)
      losses.append(ref.global_loss(vs[-1].center, targets) - optimum)
    out[rule] = float(np.mean(losses))
  return out


def test_staleness_rules_on_the_toy_quadratic():
  table = {
    name: compare(speeds)
    for name, speeds in (
      ("equal 1,1,1", [1.0, 1.0, 1.0]),
      ("unequal 1,3,9", [1.0, 3.0, 9.0]),
    )
  }
  print("\nexcess global loss after 60 s (mean of 3 seeds; lower is better)")
  print(f"{'speeds':16s}" + "".join(f"{r:>18s}" for r in ref.RULES))
  for name, row in table.items():
    print(f"{name:16s}" + "".join(f"{row[r]:18.3e}" for r in ref.RULES))
  for row in table.values():
    assert all(np.isfinite(v) for v in row.values())
