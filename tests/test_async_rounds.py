"""Asynchronous rounds in-process: the coordinator's rule
(``shardopt.elastic.asynchronous.Outer``) and an island's adoption, driven
through the same arrival order as the numpy reference
(tests/_async_rounds_reference.py), match its versions, contributors,
staleness and centers (quorum, grace, the staleness rules, Delayed
Nesterov)."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardopt
from shardopt.elastic import asynchronous
from shardopt.periodic import split
from tests import _async_rounds_reference as ref

TARGETS = [[1.0, -2.0, 0.5], [-1.0, 0.0, 2.0], [0.3, 1.5, -1.0]]
X0 = [0.2, 0.1, -0.3]
SYNC_PERIOD, INNER_LR = 4, 0.2


def run_library(
  *, speeds, quorum, grace, rule, outer, until, staleness="none"
) -> list:
  """The reference's timeline (island i arrives every SYNC_PERIOD /
  speeds[i] seconds, ties by island id; an outer step at a grace deadline
  before the next arrival) with the library on both sides."""
  tx = shardopt.diloco(
    optax.sgd(INNER_LR), "i", sync_period=SYNC_PERIOD, outer_optimizer=outer
  )
  engine = split.engine_of(tx, "test")
  params = jnp.asarray(X0, jnp.float32)
  center = asynchronous.Outer(
    engine,
    params,
    tx.init(params),
    min_quorum=quorum,
    grace_seconds=grace,
    staleness=staleness,
  )
  local = jax.jit(
    lambda g, s, p: split.local_update(engine, g, s, p, {}), donate_argnums=()
  )
  islands = [(params, tx.init(params), 0) for _ in speeds]
  events = [(SYNC_PERIOD / s, i, i) for i, s in enumerate(speeds)]
  heapq.heapify(events)
  out = []
  while events:
    t, _, i = events[0]
    if center.pending and grace is not None:
      deadline = center.pending[0].arrived + grace
      if deadline < t and deadline <= until:
        out.append((deadline, center.step(), np.asarray(center.center()[0])))
        continue
    if t > until:
      break
    heapq.heappop(events)
    p, s, version = islands[i]
    for _ in range(SYNC_PERIOD):
      updates, s = local(p - jnp.asarray(TARGETS[i], jnp.float32), s, p)
      p = optax.apply_updates(p, updates)
    values = asynchronous.contribution(engine, p, s)
    center.add(asynchronous.Contribution(i, version, SYNC_PERIOD, values, t))
    if center.due(now=t):
      out.append((t, center.step(), np.asarray(center.center()[0])))
    p, s = asynchronous.adopt(engine, p, s, center.center())
    islands[i] = (p, s, center.version)
    heapq.heappush(events, (t + SYNC_PERIOD / speeds[i], i, i))
  return out


CASES = {
  "equal speeds, quorum 3": dict(speeds=[1.0, 1.0, 1.0], quorum=3),
  "1x 3x 9x, quorum 1": dict(speeds=[1.0, 3.0, 9.0], quorum=1),
  "1x 3x 9x, quorum 2, grace": dict(
    speeds=[1.0, 3.0, 9.0], quorum=2, grace=0.3
  ),
  "1x 3x 9x, quorum 1, inverse": dict(
    speeds=[1.0, 3.0, 9.0], quorum=1, rule="inverse"
  ),
  "1x 3x 9x, quorum 1, delayed Nesterov": dict(
    speeds=[1.0, 3.0, 9.0], quorum=1, rule="delayed_nesterov"
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outer_steps_match_the_numpy_reference(case):
  kw = dict(CASES[case])
  kw.setdefault("grace", None)
  kw.setdefault("rule", "none")
  until = 12.0
  want = ref.simulate(
    targets=TARGETS,
    x0=X0,
    sync_period=SYNC_PERIOD,
    inner_lr=INNER_LR,
    outer_lr=0.7,
    outer_momentum=0.9,
    until=until,
    **kw,
  )
  if kw["rule"] == "delayed_nesterov":
    outer = shardopt.delayed_nesterov(
      0.7, 0.9, momentum_period=len(kw["speeds"])
    )
    staleness = "none"
  else:
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    staleness = kw["rule"]
  got = run_library(
    speeds=kw["speeds"],
    quorum=kw["quorum"],
    grace=kw["grace"],
    rule=kw["rule"],
    outer=outer,
    until=until,
    staleness=staleness,
  )
  assert len(want) >= 3 and len(got) == len(want), (len(got), len(want))
  for (t, applied, c), v in zip(got, want, strict=True):
    assert applied.version == v.version
    assert list(applied.contributors) == v.contributors
    assert list(applied.staleness) == v.staleness
    assert list(applied.weights) == v.weights
    assert t == pytest.approx(v.time)
    np.testing.assert_allclose(c, v.center, rtol=2e-4, atol=2e-5)


def test_an_unknown_staleness_rule_is_refused_with_the_choices():
  tx = shardopt.diloco(optax.sgd(0.1), "i", sync_period=2)
  engine = split.engine_of(tx, "test")
  params = jnp.zeros(3)
  with pytest.raises(ValueError, match="staleness='newest'.*'inverse'"):
    asynchronous.Outer(engine, params, tx.init(params), staleness="newest")


def _engine(**kwargs):
  return split.engine_of(
    shardopt.diloco(optax.sgd(0.1), "i", sync_period=4, **kwargs), "test"
  )


def _check(flag, **changes):
  """``elastic.checks.asynchronous`` with good arguments but ``changes``."""
  from shardopt.elastic import checks

  args = dict(
    dedicated=True,
    k=1,
    engine=_engine(),
    min_quorum=1,
    grace_seconds=None,
    staleness="none",
  )
  args.update(changes)
  return checks.asynchronous(flag, **args)


@pytest.mark.parametrize(
  ("kwargs", "words"),
  [
    ({"dedicated": False}, "pass dedicated_coordinator=True"),
    ({"k": 2}, "processes_per_island=2"),
    ({"engine": {"num_fragments": 2}}, "build it with num_fragments=1"),
    ({"engine": {"comm_dtype": jnp.int8}}, "build it without comm_dtype"),
    ({"min_quorum": 0}, "min_quorum=0 must be an integer >= 1"),
    ({"grace_seconds": -1.0}, "grace_seconds=-1.0 must be a finite number"),
    ({"staleness": "newest"}, "staleness='newest' is not a staleness rule"),
  ],
)
def test_island_refuses_what_asynchronous_rounds_cannot_run(kwargs, words):
  """Island(asynchronous=True)'s argument check (elastic/checks.py): each
  refusal names the argument, the value and the fix."""
  if "engine" in kwargs:
    kwargs = dict(kwargs, engine=_engine(**kwargs["engine"]))
  with pytest.raises(ValueError, match="shardopt.elastic.Island") as info:
    _check(True, **kwargs)
  assert words in str(info.value)


def test_the_options_of_asynchronous_rounds_need_it():
  with pytest.raises(ValueError, match="min_quorum is an option"):
    _check(False, min_quorum=2)
  assert _check(True, min_quorum=2, grace_seconds=0.5, staleness="inverse") == (
    True,
    2,
    0.5,
    "inverse",
  )
