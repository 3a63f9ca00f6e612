"""The exchange of an asynchronous round: one island and the coordinator,
point to point, while every other island trains on.

The arrays move through JAX's own point-to-point transfer
(``jax.experimental.transfer``, behind :class:`shardopt._jax.TransferServer`);
the coordination service's key-value store carries control only (who
offers what, which version). ``benchmarks/probes/async_exchange.py``
measured why: a two-member gloo clique per exchange also runs without the
other processes, but a slow island holds the coordinator in the collective
(5 s behind one island stalled 8 s), and each failure uses up one of the
few device pairs an island has with the coordinator for good; a pull from
a transfer server needs no pair and no other process, and a dead peer's
closed socket fails it at once.

An island's exchange (:meth:`Mailbox.exchange`):

1. offer: its contribution waits on its transfer server under a fresh uuid
   (nothing is offered by a fresh island, weight 0);
2. post: ``shardopt/async/offer/<process>/<token>/<seq>`` tells the
   coordinator the center version it trained from, its weight, the uuid
   and its server's address (``token``: this process's incarnation);
3. wait: for ``shardopt/async/center/<process>/<token>/<seq>``, the
   coordinator's answer: the center's uuid and version;
4. pull: the center, from the coordinator's transfer server.

The coordinator's side: :meth:`Mailbox.offers` lists the posted offers in
the order they were posted, :meth:`Mailbox.receive` starts pulling one's
contribution (others are answered meanwhile), :meth:`Mailbox.answer`
offers the center back and posts the answer.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import socket
import time
from typing import NamedTuple

import jax
import numpy as np

from shardopt import _jax

_DIR = "shardopt/async/"
_OFFERS = _DIR + "offer/"
_CENTERS = _DIR + "center/"
_COORDINATOR = _DIR + "coordinator"


def offer_id(token: int, seq: int) -> int:
  """An offer's id, unique across incarnations: its island's incarnation
  ``token`` and the offer's sequence number ``seq`` in it (what both sides
  log: an audit matches an island's contributions to the outer steps that
  applied them)."""
  return (int(token) << 32) | int(seq)


class Offer(NamedTuple):
  """An island's posted offer, as the coordinator reads it."""

  key: str
  process: int
  token: int
  seq: int
  version: int
  weight: float
  uuid: int | None  # None: nothing offered (a fresh island)
  address: str
  posted: float  # the island's time.time() when it posted
  count: int  # the island's local steps when it posted

  @property
  def id(self) -> int:
    """:func:`offer_id` of this offer."""
    return offer_id(self.token, self.seq)


def host_address() -> str:
  """The address other processes reach this one at: the local end of a
  route to the coordination service's host (127.0.0.1 on one machine)."""
  host = _jax.coordinator_address().rsplit(":", 1)[0] or "127.0.0.1"
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, 9))
      return s.getsockname()[0]
    except OSError:
      return "127.0.0.1"


# A pull's bound: a fixed allowance plus its bytes at a rate far below any
# link's (the probe measured 5 ms a MB between two processes on one host).
PULL_SECONDS = 10.0
PULL_BYTES_PER_SECOND = 50e6


def pull_timeout(like: list, timeout_s: float) -> float:
  """How long a pull of arrays shaped as ``like`` may take (at most
  ``timeout_s``). A pull from a live peer can stall (seen once in a chaos
  run: the coordinator's pull of a live island's contribution never
  completed); the coordinator must not hold every island that long."""
  nbytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in like)
  return min(timeout_s, PULL_SECONDS + nbytes / PULL_BYTES_PER_SECOND)


class Mailbox:
  """This process's end of asynchronous exchanges.

  Args:
    store: the coordination service's key-value store.
    process: this process's id.
    device: the local device received arrays land on.
    timeout_s: how long an island waits for the coordinator's answer; a
      pull waits at most :func:`pull_timeout` of its bytes, never longer.
  """

  def __init__(self, store, process: int, device, *, timeout_s: float):
    self._store = store
    self._process = process
    self._timeout_s = timeout_s
    self._device = device
    self._server = _jax.TransferServer(device, host_address())
    # This process's incarnation: a restarted process never reuses the keys
    # or uuids of its predecessor.
    self.token = random.getrandbits(30)
    self._seq = itertools.count(1)
    self._uuids = itertools.count(1)

  def _uuid(self) -> int:
    return (self.token << 32) | next(self._uuids)

  # --------------------------------------------------------------- island

  def exchange(
    self, values: list, weight: float, version: int, like: list, count: int
  ):
    """Steps 1-4: ``(center, version, count, offer)`` from the coordinator, for
    this island's contribution ``values`` (float32 arrays on this mailbox's
    device) computed from center ``version`` with ``weight`` (0: a fresh
    island, nothing offered) after ``count`` local steps; ``like``: the
    center's pieces (shapes and dtypes). The returned ``count`` is the
    largest this process id posted (a restarted island's predecessor's);
    ``offer``: :func:`offer_id` of this exchange's offer (None if it
    offered nothing, or the coordinator could not pull it: not applied)."""
    seq = next(self._seq)
    uuid = None
    if weight > 0:
      uuid = self._uuid()
      self._server.offer(uuid, jax.block_until_ready(values))
    suffix = f"{self._process}/{self.token}/{seq}"
    posted = {
      "version": int(version),
      "weight": float(weight),
      "uuid": uuid,
      "address": self._server.address,
      "posted": time.time(),
      "count": int(count),
    }
    self._store.set(_OFFERS + suffix, json.dumps(posted))
    answer = json.loads(self._store.get(_CENTERS + suffix, self._timeout_s))
    self._store.delete(_CENTERS + suffix)
    center = self._server.pull(
      answer["address"],
      answer["uuid"],
      like,
      pull_timeout(like, self._timeout_s),
    )
    offered = None
    if uuid is not None and answer.get("applied", True):
      offered = offer_id(self.token, seq)
    return center, int(answer["version"]), int(answer["count"]), offered

  # ---------------------------------------------------------- coordinator

  def offers(self) -> list[Offer]:
    """The offers posted and not yet answered, oldest first."""
    out = []
    for key, value in self._store.items(_OFFERS):
      process, token, seq = (int(p) for p in key[len(_OFFERS) :].split("/"))
      v = json.loads(value)
      out.append(
        Offer(
          key,
          process,
          token,
          seq,
          v["version"],
          v["weight"],
          v["uuid"],
          v["address"],
          v["posted"],
          v["count"],
        )
      )
    return sorted(out, key=lambda o: (o.posted, o.process, o.seq))

  def receive(self, offer: Offer, like: list) -> _jax.Pull | None:
    """Starts pulling the contribution ``offer`` stands for and returns at
    once (None if it offered none): its :meth:`~shardopt._jax.Pull.result`
    raises if the island is gone, or did not hand it over within
    :func:`pull_timeout`. The offer's key is deleted either way."""
    self._store.delete(offer.key)
    if offer.uuid is None:
      return None
    return self._server.start_pull(
      offer.address, offer.uuid, like, pull_timeout(like, self._timeout_s)
    )

  def answer(
    self,
    offer: Offer,
    center: list,
    version: int,
    count: int,
    applied: bool = True,
  ) -> None:
    """Offers ``center`` (version ``version``) to ``offer``'s island, with
    the largest ``count`` its process id reached; ``applied=False``: its
    contribution could not be pulled and will not be applied (the island
    is told, and trains on from the center)."""
    uuid = self._uuid()
    self._server.offer(
      uuid,
      jax.block_until_ready([jax.device_put(c, self._device) for c in center]),
    )
    key = f"{_CENTERS}{offer.process}/{offer.token}/{offer.seq}"
    body = {
      "uuid": uuid,
      "version": int(version),
      "address": self._server.address,
      "count": int(count),
      "applied": bool(applied),
    }
    self._store.set(key, json.dumps(body))
