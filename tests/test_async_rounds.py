"""Asynchronous rounds in-process: the coordinator's rule
(``shardopt.elastic.asynchronous.Outer``) and an island's adoption, driven
through the same arrival order as the numpy reference
(tests/_async_rounds_reference.py), match its versions, contributors,
staleness and centers (quorum, grace, the staleness rules, Delayed
Nesterov)."""

import heapq
import json
import socket
import threading

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


# ---------------------------------------------- the coordinator's loop, in-process


class _Store:
  """The key-value store's methods over a dict: the coordinator's loop and
  an island's mailbox in one process, on two CPU devices, each with its own
  real transfer server (``jax.experimental.transfer``)."""

  def __init__(self):
    self._values = {}
    self._changed = threading.Condition()

  def set(self, key, value, *, overwrite=False):
    with self._changed:
      self._values[key] = value
      self._changed.notify_all()

  def get(self, key, timeout_s):
    with self._changed:
      if not self._changed.wait_for(lambda: key in self._values, timeout_s):
        raise TimeoutError(key)
      return self._values[key]

  def items(self, directory):
    with self._changed:
      return [
        (k, v) for k, v in self._values.items() if k.startswith(directory)
      ]

  def keys(self, directory):
    return [k for k, _ in self.items(directory)]

  def delete(self, key):
    with self._changed:
      self._values.pop(key, None)


def _serve(store, tx, params, device):
  """``async_rounds.serve`` in-process over ``store``, quorum 1, until every
  island that exchanged has set ``finished/<process>``; returns its outer
  steps and its failed pulls ``(process, error)``."""
  from shardopt.elastic import async_rounds

  applied, failures = [], []
  async_rounds.serve(
    split.engine_of(tx, "test"),
    params,
    tx.init(params),
    store=store,
    device=device,
    min_quorum=1,
    grace_seconds=None,
    staleness="none",
    timeout_s=30,
    finished=lambda: {int(k[-1]) for k in store.keys("finished/")},
    on_step=lambda step, outer: applied.append(step),
    on_failure=lambda offer, error: failures.append((offer.process, error)),
  )
  return applied, failures


def _end_stalled_pull(offer, mailbox, values):
  """A stalled pull's thread waits until something is offered under its
  uuid (a thread blocked in a pull at exit aborts the process): ``offer``
  (the mailbox server's real ``offer``) it under ``mailbox``'s first uuid
  (``Mailbox._uuid``), and wait for every pull thread to end."""
  offer((mailbox.token << 32) | 1, values)
  for waiting in threading.enumerate():
    if waiting.name == "shardopt-pull":
      waiting.join(timeout=30)
      assert not waiting.is_alive()


def test_a_contribution_the_coordinator_cannot_pull_is_answered_not_applied(
  monkeypatch,
):
  """An island offers a contribution whose pull stalls (its uuid is posted,
  nothing is offered under it): the coordinator's pull gives up after
  ``pull_timeout``, and the island is answered with the current center,
  told its contribution is not applied (no offer id), and no outer step
  runs; its next, good contribution is applied (version 1, its offer id
  in the step). A gone island's offer (nothing listens at its address) is
  skipped without an answer."""
  from shardopt.elastic import mailbox as _mailbox

  monkeypatch.setattr(_mailbox, "PULL_SECONDS", 0.5)
  monkeypatch.setattr(_mailbox, "host_address", lambda: "127.0.0.1")
  tx = shardopt.diloco(optax.sgd(INNER_LR), "i", sync_period=SYNC_PERIOD)
  devices = jax.devices()
  params = jax.device_put(jnp.asarray(X0, jnp.float32), devices[0])
  store = _Store()
  island = _mailbox.Mailbox(store, 1, devices[1], timeout_s=30)
  like = [jax.ShapeDtypeStruct((3,), jnp.float32)]
  values = [jax.device_put(jnp.asarray([1.0, 2.0, 3.0]), devices[1])]
  stalled = island._server.offer  # post the offer, offer nothing under it
  monkeypatch.setattr(island._server, "offer", lambda uuid, arrays: None)
  # A gone island: its offer names an address nothing listens at.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    gone = f"127.0.0.1:{s.getsockname()[1]}"
  store.set(
    "shardopt/async/offer/2/7/1",
    json.dumps(
      {
        "version": 0,
        "weight": 4.0,
        "uuid": 1,
        "address": gone,
        "posted": 0.0,
        "count": 4,
      }
    ),
  )
  answers = []

  def island_side():
    answers.append(island.exchange(values, 4.0, 0, like, 4))
    monkeypatch.setattr(island._server, "offer", stalled)
    answers.append(island.exchange(values, 4.0, 0, like, 8))
    store.set("finished/1", "")

  thread = threading.Thread(target=island_side)
  thread.start()
  applied, failures = _serve(store, tx, params, devices[0])
  thread.join(30)
  assert not thread.is_alive()
  assert [(p, type(e)) for p, e in failures] == [
    (2, ConnectionError),
    (1, TimeoutError),
  ]
  (center, version, count, offer), (_, version_2, _, offer_2) = answers
  assert (version, count, offer) == (0, 4, None)  # not applied
  np.testing.assert_array_equal(
    np.asarray(center[0]), np.asarray(X0, np.float32)
  )
  assert version_2 == 1 and offer_2 is not None
  assert [(a.version, a.contributors, a.offers) for a in applied] == [
    (1, (1,), (offer_2,))
  ]
  _end_stalled_pull(stalled, island, values)


def test_work_weighs_across_outer_steps_by_the_running_mean_weight():
  """Quorum 1, outer SGD at rate 1: each outer step moves the center by
  ``w_k delta_k / w_bar``, ``w_bar`` the mean weight of the contributions
  received so far (numpy), so a contribution of 12 steps moves it 3 times
  as far as one of 4 against the same running mean; the step's own weight
  alone (``w_k / w_k``) would move it by ``delta_k`` whatever its work."""
  tx = shardopt.diloco(
    optax.sgd(INNER_LR),
    "i",
    sync_period=SYNC_PERIOD,
    outer_optimizer=optax.sgd(1.0),
  )
  engine = split.engine_of(tx, "test")
  params = jnp.asarray(X0, jnp.float32)
  center = asynchronous.Outer(engine, params, tx.init(params), min_quorum=1)
  rng = np.random.default_rng(0)
  expected = np.asarray(X0, np.float64)
  seen = []
  for k, weight in enumerate([4.0, 12.0, 2.0, 4.0]):
    delta = rng.standard_normal(3).astype(np.float32)
    center.add(
      asynchronous.Contribution(k, center.version, weight, [delta], float(k))
    )
    seen.append(weight)
    center.step()
    expected = expected - weight * delta.astype(np.float64) / np.mean(seen)
    np.testing.assert_allclose(
      np.asarray(center.center()[0]), expected, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("quorum", [1, 3])
def test_the_coordinator_compiles_its_outer_step_before_the_first_offer(
  quorum,
):
  """``Outer.warm`` (run by ``serve`` before it answers anyone) compiles the
  step a quorum of contributions takes, laid out as ``serve`` lays them out
  (``asynchronous.laid_out``): the first real step compiles nothing more
  (an island's exchange waited 0.26-0.42 s for it), and warming changes
  neither the center, its state nor its version."""
  tx = shardopt.diloco(optax.sgd(INNER_LR), "i", sync_period=SYNC_PERIOD)
  engine = split.engine_of(tx, "test")
  params = {"w": jnp.asarray(X0, jnp.float32), "b": jnp.zeros([2])}
  center = asynchronous.Outer(
    engine, params, tx.init(params), min_quorum=quorum
  )
  before = jax.tree.map(np.asarray, (center.params, center.state))
  center.warm()
  warmed = jax.tree.map(np.asarray, (center.params, center.state))
  jax.tree.map(np.testing.assert_array_equal, before, warmed)
  assert center.version == 0 and not center.pending
  sizes = (asynchronous._combine._cache_size(), center._apply._cache_size())
  like = center.center()
  for k in range(quorum):
    values = asynchronous.laid_out(
      [np.full(x.shape, 0.1 * (k + 1), np.float32) for x in like], like
    )
    center.add(asynchronous.Contribution(k, 0, 4.0, values, float(k)))
  assert center.due()
  center.step()
  assert center.version == 1
  after = (asynchronous._combine._cache_size(), center._apply._cache_size())
  assert after == sizes, (before, after)


def test_a_frozen_island_holds_no_other_island_s_answer(monkeypatch):
  """Island 1's contribution never comes (a frozen island: its offer is
  posted, nothing is offered under it); island 3 offers after the
  coordinator has started pulling island 1's. The coordinator pulls in
  threads of their own: island 3 is answered, its contribution applied,
  while island 1's pull still waits out ``pull_timeout`` (3 s here); a
  coordinator that pulled one offer at a time answered island 3 only
  after that."""
  from shardopt.elastic import mailbox as _mailbox

  monkeypatch.setattr(_mailbox, "PULL_SECONDS", 3.0)
  monkeypatch.setattr(_mailbox, "host_address", lambda: "127.0.0.1")
  tx = shardopt.diloco(optax.sgd(INNER_LR), "i", sync_period=SYNC_PERIOD)
  devices = jax.devices()
  params = jax.device_put(jnp.asarray(X0, jnp.float32), devices[0])
  store = _Store()
  pulling_1 = threading.Event()  # the coordinator took island 1's offer
  delete = store.delete

  def deleting(key):
    if key.startswith("shardopt/async/offer/1/"):
      pulling_1.set()
    delete(key)

  monkeypatch.setattr(store, "delete", deleting)
  frozen = _mailbox.Mailbox(store, 1, devices[1], timeout_s=30)
  offer = frozen._server.offer
  monkeypatch.setattr(frozen._server, "offer", lambda uuid, arrays: None)
  other = _mailbox.Mailbox(store, 3, devices[2], timeout_s=30)
  like = [jax.ShapeDtypeStruct((3,), jnp.float32)]
  answered = []  # (island, its answer), in the order they came back

  def island(mailbox, number, device):
    if number == 3:
      assert pulling_1.wait(30)
    values = [jax.device_put(jnp.asarray([1.0, 2.0, 3.0]), device)]
    answered.append((number, mailbox.exchange(values, 4.0, 0, like, 4)))
    store.set(f"finished/{number}", "")

  threads = [
    threading.Thread(target=island, args=(frozen, 1, devices[1])),
    threading.Thread(target=island, args=(other, 3, devices[2])),
  ]
  for thread in threads:
    thread.start()
  applied, failures = _serve(store, tx, params, devices[0])
  for thread in threads:
    thread.join(30)
    assert not thread.is_alive()
  assert [number for number, _ in answered] == [3, 1]
  (_, (_, version_3, _, offer_3)), (_, (_, _, _, offer_1)) = answered
  assert version_3 == 1 and offer_3 is not None and offer_1 is None
  assert [(a.contributors, a.offers) for a in applied] == [((3,), (offer_3,))]
  assert [(p, type(e)) for p, e in failures] == [(1, TimeoutError)]
  _end_stalled_pull(offer, frozen, [jnp.zeros([3])])
