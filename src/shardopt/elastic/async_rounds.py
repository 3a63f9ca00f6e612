"""Asynchronous rounds, both sides: an island's exchange and the dedicated
coordinator's loop (``Island(..., asynchronous=True)``).

An island's round (:meth:`Exchanger.exchange`):

1. its contribution (:func:`.asynchronous.contribution`) and weight (its
   inner steps since its last exchange; 0 for a fresh process, which
   offers nothing) go to the coordinator (:mod:`.mailbox`);
2. the newest center comes back, with its version (and, for a fresh
   process, the local step count its predecessor had reached);
3. the island adopts it (:func:`.asynchronous.adopt`) and trains on. It
   never waits for another island: only for the coordinator's handling of
   its own exchange.

The coordinator's loop (:func:`serve`), until an island has finished and
every other one it served has finished too or died (its heartbeat stopped;
while every island is dead and none has finished it waits for restarts, up
to ``timeout_s`` without an exchange), or SIGTERM:

1. read the posted offers, oldest first;
2. start pulling each one's contribution; for each pull that has ended,
   oldest offer first: add the contribution to the pending ones, take the
   outer step if one is due (:class:`.asynchronous.Outer`: quorum or
   grace), answer with the newest center (a contribution that cannot be
   pulled, its island gone or the pull stalled past
   :func:`.mailbox.pull_timeout`, is not applied, and the answer says so).
   A pull waits in a thread of its own: a frozen island holds no one's
   answer but its own;
3. take a grace window's outer step when one falls due between offers;
4. at the end, one last outer step over what is still pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardopt.elastic import asynchronous
from shardopt.elastic import coordinator as _coordinator
from shardopt.elastic import mailbox as _mailbox
from shardopt.elastic import quorum
from shardopt.periodic import split


def _like(engine, params, state) -> list:
  """The center's pieces, as shapes and dtypes (float32 on the wire)."""
  parts = split.pieces(engine, params, 1)
  return [
    jax.ShapeDtypeStruct(x.shape, np.float32)
    for x in split.take(jax.tree.leaves(state.center), parts)
  ]


class Exchanger:
  """An island's side of asynchronous rounds.

  Args:
    engine: the periodic transform's engine.
    store: the coordination service's key-value store.
    me: this process's id.
    device: the device pulled arrays land on (the island's first).
    timeout_s: how long an exchange waits for the coordinator.
    work_per_step: the weight of one inner step (its tokens, say).
  """

  def __init__(
    self,
    engine,
    store,
    me: int,
    device,
    *,
    timeout_s: float,
    work_per_step: int = 1,
  ):
    self._work_per_step = work_per_step
    self._engine = engine
    self._mailbox = _mailbox.Mailbox(store, me, device, timeout_s=timeout_s)
    self._device = device
    self.version = 0  # the center version this island trains from
    self._count_at_exchange = 0
    self._contribution = jax.jit(
      lambda p, s: asynchronous.contribution(engine, p, s)
    )
    self._adopt = jax.jit(lambda p, s, c: asynchronous.adopt(engine, p, s, c))

  def exchange(self, params, state, *, fresh: bool):
    """Steps 1-3: ``(params, state, info)``; ``info`` has ``version``,
    ``weight``, ``count``, ``seconds`` (inside the exchange) and ``offer``
    (the offer's id, :func:`.mailbox.offer_id`; None for weight 0)."""
    start = time.monotonic()
    count = quorum.host_int(state.count)
    steps = 0 if fresh else count - self._count_at_exchange
    weight = steps * self._work_per_step
    values = []
    if weight > 0:
      values = [
        jax.device_put(v, self._device)
        for v in self._contribution(params, state)
      ]
    elif fresh:  # compiled now, not in the first exchange that offers
      jax.block_until_ready(self._contribution(params, state))
    like = _like(self._engine, params, state)
    center, version, restored, offer = self._mailbox.exchange(
      values, weight, self.version, like, count
    )
    parts = split.pieces(self._engine, params, 1)
    center = asynchronous.laid_out(
      center, split.take(jax.tree.leaves(state.center), parts)
    )
    params, state = self._adopt(params, state, center)
    if fresh and restored > count:  # a restarted island goes on counting
      state = state._replace(
        count=jax.device_put(
          np.asarray(restored, np.dtype(state.count.dtype)),
          state.count.sharding,
        )
      )
    self.version = version
    self._count_at_exchange = quorum.host_int(state.count)
    return (
      params,
      state,
      {
        "version": version,
        "weight": float(weight),
        "count": self._count_at_exchange,
        "seconds": time.monotonic() - start,
        "offer": offer,
      },
    )


def serve(
  engine,
  params,
  state,
  *,
  store,
  device,
  min_quorum: int,
  grace_seconds: float | None,
  staleness: str,
  timeout_s: float,
  finished: Callable[[], set],
  on_step: Callable[[asynchronous.Applied, Any], None] | None = None,
  on_failure: Callable[[_mailbox.Offer, Exception], None] | None = None,
  poll_s: float = 0.005,
):
  """The coordinator's loop (steps 1-4); returns ``(params, state,
  served)``: the last center (as params), its state, and the processes it
  exchanged with.

  Args:
    finished: the processes that have said they are done (a set).
    on_step: called with each outer step and the coordinator's ``Outer``.
    on_failure: called with an offer whose pull failed and the error.

  Raises:
    TimeoutError: no island exchanged for ``timeout_s`` (at the start, or
      after every island died and none came back).
  """
  mailbox = _mailbox.Mailbox(store, 0, device, timeout_s=timeout_s)
  outer = asynchronous.Outer(
    engine,
    params,
    state,
    min_quorum=min_quorum,
    grace_seconds=grace_seconds,
    staleness=staleness,
  )
  outer.warm()
  like = _like(engine, params, state)
  counts: dict[int, int] = {}  # process -> its count at its last exchange
  watcher = _coordinator.Watcher(store)
  last_offer = time.monotonic()
  on_step = on_step or (lambda applied, outer: None)
  on_failure = on_failure or (lambda offer, error: None)

  def step():
    on_step(outer.step(), outer)

  def handle(offer: _mailbox.Offer, pull) -> None:
    """Step 2 for one offer whose pull has ended."""
    try:
      values = None if pull is None else pull.result()
    except Exception as error:  # noqa: BLE001 (its island is gone)
      on_failure(offer, error)
      if isinstance(error, TimeoutError):
        # A live island whose contribution could not be pulled is told
        # so and trains on; a gone one (refused or closed connection)
        # gets no answer, which would stay offered here for good.
        mailbox.answer(
          offer,
          outer.center(),
          outer.version,
          max(counts.get(offer.process, 0), offer.count),
          applied=False,
        )
      return
    counts[offer.process] = max(counts.get(offer.process, 0), offer.count)
    if values is not None:
      center_like = outer.center()
      outer.add(
        asynchronous.Contribution(
          offer.process,
          offer.version,
          offer.weight,
          asynchronous.laid_out(values, center_like),
          time.monotonic(),
          offer.id,
        )
      )
    if outer.due():
      step()
    mailbox.answer(offer, outer.center(), outer.version, counts[offer.process])

  pulling: list = []  # (offer, its pull), oldest first
  with _coordinator.stop_on_sigterm() as stopped:
    while not stopped.is_set():
      offers = mailbox.offers()
      pulling += [(offer, mailbox.receive(offer, like)) for offer in offers]
      ready = [p is None or p.ready() for _, p in pulling]  # asked once
      ended = [x for x, r in zip(pulling, ready, strict=True) if r]
      pulling = [x for x, r in zip(pulling, ready, strict=True) if not r]
      for offer, pull in ended:
        handle(offer, pull)
      if outer.due():  # a grace window ended between offers
        step()
      if offers or ended:
        last_offer = time.monotonic()
        continue
      if pulling:  # until the oldest pull ends, or the next poll
        pulling[0][1].wait(poll_s)
        continue
      # The end: an island has finished, and every other one it served has
      # finished too or is dead. Islands that all died wait for restarts.
      done = finished()
      if done and all(p in done or p not in watcher.alive() for p in counts):
        break
      if time.monotonic() - last_offer > timeout_s:
        raise TimeoutError(
          f"no island exchanged within timeout_s={timeout_s} s"
        )
      time.sleep(poll_s)
  if outer.pending:
    step()
  return outer.params, outer.state, set(counts)
