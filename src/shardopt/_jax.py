"""Every experimental or private JAX call of shardopt, behind names of ours.

Each is touched here and nowhere else, so a JAX release that moves one breaks
one function, named in one test (``tests/test_jax_internals.py``).

**The transforms' fast paths** have a slow-but-correct fallback each: a JAX
without the private name degrades (one ``RuntimeWarning`` per touch point,
naming the JAX version and what degraded), it never fails every transform
with an ``ImportError``. :data:`fast_path_runs` counts each fast path taken,
so the tests assert that this JAX still takes every one:

- ``jax._src.interpreters.batching.BatchTracer`` (private): whether a value
  is batched by an enclosing ``jax.vmap`` (:func:`batched_by_vmap`, read on
  every update of ``accumulate`` and the periodic family). Fallback: the
  tracer's class name, through the public ``jax.core.Tracer``.
- ``Primitive.get_bind_params`` and ``JaxprEqn.ctx`` (undocumented): evaluate
  a jaxpr one equation at a time (:func:`equation_binder`, used by
  ``shardopt._skip.update_or_skip``). Fallback: ``update_or_skip`` runs the
  update whole and selects its outputs (same numbers, one more copy of the
  state per step).

**shardopt.elastic** has no fallback (JAX's fault tolerance is experimental,
jax >= 0.10.1, and a few things the elastic rounds need have no public API
yet); a missing one raises a :class:`JaxInternalsError` that says which and
why:

- ``jax_enable_recoverability`` (config, experimental): survivors outlive a
  dead process; a restarted one may reconnect.
- ``jax.experimental.multihost_utils.live_devices`` and
  ``ProcessFailureError`` (experimental, public module).
- ``live_devices.devices`` (undocumented): the incarnation id of each live
  device's process, which tells a restarted process from its predecessor.
- the coordination service's key-value store
  (``jax._src.distributed.global_state.client``, private): process 0 hands out
  the device order of each new membership there, and a restarted process
  deletes the stale gloo rendezvous keys of its own local clique.
- ``jax._src.xla_bridge.backends_are_initialized`` (private): whether the XLA
  flags may still change.
- ``jax.experimental.transfer`` (experimental): point-to-point pulls of
  arrays between two processes (:class:`TransferServer`), the exchange of
  asynchronous rounds (``benchmarks/probes/async_exchange.py`` measured it
  against two-member gloo cliques and the key-value store).
"""

from __future__ import annotations

import collections
import importlib
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jax_core

# --- The transforms' fast paths: a private name, or a slower fallback. ---

# Where this JAX keeps each private name a fast path reads (module, name);
# tests/test_jax_internals.py points one elsewhere to take the fallback.
BATCH_TRACER = ("jax._src.interpreters.batching", "BatchTracer")
# The undocumented attributes update_or_skip evaluates a jaxpr through.
BIND_PARAMS = "get_bind_params"  # of a Primitive
EQUATION_CONTEXT = "ctx"  # of a JaxprEqn; its .manager is entered to bind

#: How many times each fast path ran (at trace time): ``"batched_by_vmap"``
#: and ``"bind_equation"``.
fast_path_runs: collections.Counter = collections.Counter()

# Each touch point, resolved once: the private object, or None (degraded).
_resolved: dict[str, Any] = {}


def _resolve(touch_point: str, load: Callable[[], Any], fallback: str) -> Any:
  """``load()``, once per process; ``None`` and one ``RuntimeWarning``
  naming the JAX version and what degrades if this JAX lacks the name."""
  if touch_point not in _resolved:
    try:
      _resolved[touch_point] = load()
    except (ImportError, AttributeError) as e:
      _resolved[touch_point] = None
      warnings.warn(
        f"shardopt: this JAX ({jax.__version__}) lacks {touch_point}"
        f" ({type(e).__name__}: {e}); {fallback}. shardopt is tested with"
        " jax 0.10.x; pin that version or update shardopt.",
        RuntimeWarning,
        stacklevel=4,
      )
  return _resolved[touch_point]


def _load_batch_tracer() -> type:
  module, name = BATCH_TRACER
  tracer = getattr(importlib.import_module(module), name)
  if not (isinstance(tracer, type) and issubclass(tracer, jax.core.Tracer)):
    raise AttributeError(f"{module}.{name} is {tracer!r}, not a Tracer class")
  return tracer


def batched_by_vmap(x: Any) -> bool:
  """True when ``x`` is batched by an enclosing ``jax.vmap``.

  Fast path: ``isinstance(x, BatchTracer)`` (JAX 0.10:
  ``jax._src.interpreters.batching.BatchTracer``). Without it: a
  ``jax.core.Tracer`` whose class (or a base) is named ``BatchTracer``; a
  JAX that renames it too makes this False (no check, one warning).
  """
  tracer = _resolve(
    f"{'.'.join(BATCH_TRACER)} (the tracer of jax.vmap)",
    _load_batch_tracer,
    "shardopt tells a value batched by jax.vmap by its tracer's class name"
    " instead, which a later JAX may change: a per-replica step counter"
    " under jax.vmap could then go unnoticed and run the sync's collective"
    " on every step",
  )
  if tracer is not None:
    fast_path_runs["batched_by_vmap"] += 1
    return isinstance(x, tracer)
  return isinstance(x, jax.core.Tracer) and any(
    cls.__name__ == BATCH_TRACER[1] for cls in type(x).__mro__
  )


def _bind_equation(eqn, invals: list) -> list:
  """Runs one jaxpr equation on ``invals``, as ``jax.core.eval_jaxpr`` does."""
  fast_path_runs["bind_equation"] += 1
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns = ()
  if isinstance(params, tuple):  # older JAX: (subfuns, params)
    subfuns, params = params
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def _load_equation_binder() -> Callable[[Any, list], list]:
  # Checked on a real equation, once: the method, the context and its
  # manager that _bind_equation reads.
  (eqn,) = jax.make_jaxpr(lambda x: x + 1)(np.float32(0)).jaxpr.eqns
  if not isinstance(eqn, jax_core.JaxprEqn):
    raise AttributeError(f"a jaxpr equation is a {type(eqn).__name__}")
  getattr(eqn.primitive, BIND_PARAMS)(eqn.params)
  getattr(getattr(eqn, EQUATION_CONTEXT), "manager")  # noqa: B009
  return _bind_equation


def equation_binder() -> Callable[[Any, list], list] | None:
  """``bind(eqn, invals) -> outvals``, which evaluates one equation of a
  jaxpr (through ``Primitive.get_bind_params`` and ``JaxprEqn.ctx``); None,
  after one warning, in a JAX that lacks them."""
  return _resolve(
    f"Primitive.{BIND_PARAMS} and JaxprEqn.{EQUATION_CONTEXT} (evaluating a"
    " jaxpr one equation at a time)",
    _load_equation_binder,
    "apply_if_finite's guard runs the inner update whole and selects its"
    " outputs instead (the same numbers; XLA copies the optimizer state once"
    " more per step)",
  )


# --- shardopt.elastic: experimental calls, no fallback. ---


class JaxInternalsError(RuntimeError):
  """An experimental or private JAX API that shardopt.elastic needs moved."""


def _missing(what: str, error: Exception) -> JaxInternalsError:
  return JaxInternalsError(
    f"shardopt.elastic needs {what}, which this JAX ({jax.__version__}) does"
    f" not have ({type(error).__name__}: {error}). shardopt.elastic is tested"
    " with jax 0.10.x; pin that version or update shardopt."
  )


def _multihost():
  try:
    from jax.experimental import multihost_utils

    multihost_utils.live_devices  # noqa: B018
    multihost_utils.ProcessFailureError  # noqa: B018
  except (ImportError, AttributeError) as e:
    raise _missing("jax.experimental.multihost_utils.live_devices", e) from e
  return multihost_utils


def process_failure_error() -> type:
  """``jax.experimental.multihost_utils.ProcessFailureError``."""
  return _multihost().ProcessFailureError


def live_devices(devices: list):
  """``with live_devices(devices) as live:`` the live subset, sorted by id;
  the block succeeds on every live process or raises on all of them."""
  return _multihost().live_devices(devices)


def incarnations() -> dict:
  """``{device: incarnation id}`` of the live devices of the innermost
  ``live_devices`` block (a restarted process has a new id)."""
  table = getattr(_multihost().live_devices, "devices", None)
  if not isinstance(table, dict):
    raise _missing(
      "live_devices.devices (the incarnation id of each live device)",
      AttributeError(f"live_devices.devices is {table!r}"),
    )
  return {d: int(i) for d, i in table.items()}


def enable_recoverability() -> None:
  """``jax.config.update("jax_enable_recoverability", True)``."""
  try:
    jax.config.update("jax_enable_recoverability", True)
  except AttributeError as e:
    raise _missing("the jax_enable_recoverability option", e) from e


def backends_initialized() -> bool:
  """Whether XLA's backends (and so its flags) are already set up."""
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError) as e:
    raise _missing("jax._src.xla_bridge.backends_are_initialized", e) from e


def add_xla_flag(name: str, value: Any) -> None:
  """Appends ``--name=value`` to ``XLA_FLAGS`` unless it is set there."""
  flags = os.environ.get("XLA_FLAGS", "")
  if f"--{name}=" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def coordinator_address() -> str:
  """``host:port`` of JAX's coordination service (``""`` if unknown)."""
  from jax._src import distributed

  return getattr(distributed.global_state, "coordinator_address", None) or ""


class KeyValueStore:
  """The coordination service's key-value store (hosted by process 0)."""

  def __init__(self):
    try:
      from jax._src import distributed
      from jax._src.lib import _jax as jaxlib

      client = distributed.global_state.client
      for method in (
        "key_value_set",
        "blocking_key_value_get",
        "key_value_dir_get_bytes",
        "key_value_delete",
      ):
        getattr(jaxlib.DistributedRuntimeClient, method)
    except (ImportError, AttributeError) as e:
      raise _missing("the coordination service's key-value client", e) from e
    if client is None:
      raise RuntimeError(
        "shardopt.elastic: jax.distributed is not initialized; call"
        " shardopt.elastic.initialize(...) first."
      )
    self._client = client

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    """Sets ``key``; an existing key raises unless ``overwrite``."""
    if overwrite:
      self._client.key_value_set(key, value, allow_overwrite=True)
    else:
      self._client.key_value_set(key, value)

  def get(self, key: str, timeout_s: float) -> str:
    """The value of ``key``, waiting up to ``timeout_s`` for it to be set."""
    return self._client.blocking_key_value_get(key, int(timeout_s * 1000))

  def keys(self, directory: str) -> list[str]:
    # The _bytes variant: gloo's values are binary.
    return [k for k, _ in self._client.key_value_dir_get_bytes(directory)]

  def items(self, directory: str) -> list[tuple[str, str]]:
    """``(key, value)`` of the keys under ``directory`` (values as text)."""
    return [
      (k, v.decode(errors="replace") if isinstance(v, bytes) else v)
      for k, v in self._client.key_value_dir_get_bytes(directory)
    ]

  def delete(self, key: str) -> None:
    self._client.key_value_delete(key)


def _listening(address: str, timeout_s: float) -> None:
  """Raises ConnectionError at once if nothing listens at ``address``
  (``host:port``): a transfer connection to a dead process's address does
  not fail, its pulls wait out their timeout (measured on jax 0.10.2: 10 s
  against 0.02 s through a connection made while the peer lived)."""
  host, port = address.rsplit(":", 1)
  try:
    socket.create_connection(
      (host, int(port)), timeout=min(timeout_s, 5.0)
    ).close()
  except OSError as e:
    raise ConnectionError(f"nothing listens at {address}: {e}") from e


class TransferServer:
  """This process's end of ``jax.experimental.transfer``: it offers arrays
  for one pull each (``offer``) and pulls what another process offered
  (``pull``), with no collective and no other process taking part.

  Args:
    device: the local device the pulled arrays land on.
    host: the address other processes reach this one at (the port is
      picked free).
  """

  def __init__(self, device, host: str):
    try:
      from jax.experimental import transfer

      server = transfer.start_transfer_server(
        device.client, f"{host}:0", [f"{host}:0"]
      )
    except (ImportError, AttributeError) as e:
      raise _missing(
        "jax.experimental.transfer.start_transfer_server", e
      ) from e
    self._server = server
    self._device = device
    self._connections: dict[str, Any] = {}
    self._lock = threading.Lock()

  @property
  def address(self) -> str:
    return self._server.address()

  def offer(self, uuid: int, arrays: list) -> None:
    """``arrays`` wait for one pull under ``uuid``. An offer nobody pulls
    stays in the server's table (an await_pull timeout would hand the
    puller an array that never completes, measured on jax 0.10.2)."""
    self._server.await_pull(uuid, list(arrays))

  def pull(self, address: str, uuid: int, like: list, timeout_s: float) -> list:
    """The arrays offered under ``uuid`` at ``address``, shaped as ``like``
    (arrays or ShapeDtypeStructs), on this server's device, complete:
    :meth:`start_pull`'s :meth:`Pull.result`, waited for."""
    return self.start_pull(address, uuid, like, timeout_s).result()

  def start_pull(
    self, address: str, uuid: int, like: list, timeout_s: float
  ) -> Pull:
    """Starts pulling what :meth:`pull` returns, in a thread of its own, and
    returns at once: a coordinator goes on answering other islands while
    one island's pull waits (a SIGSTOPped island held it ``timeout_s``)."""
    sharding = jax.sharding.SingleDeviceSharding(self._device)
    specs = [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in like
    ]
    done: dict[str, Any] = {}

    def wait():
      try:
        with self._lock:
          connection = self._connections.get(address)
        if connection is None:
          _listening(address, timeout_s)
          connection = self._server.connect(address)
          with self._lock:
            self._connections[address] = connection
        done["arrays"] = jax.block_until_ready(
          list(connection.pull(uuid, specs))
        )
      except Exception as e:  # noqa: BLE001 (raised by Pull.result)
        done["error"] = e

    thread = threading.Thread(target=wait, daemon=True, name="shardopt-pull")
    thread.start()
    return Pull(self, address, uuid, thread, done, timeout_s)

  def _forget(self, address: str) -> None:
    """A failed peer: the next pull from ``address`` connects afresh."""
    with self._lock:
      self._connections.pop(address, None)


class Pull:
  """A pull under way (:meth:`TransferServer.start_pull`).

  Raised by :meth:`result`: ConnectionError or the transfer's error if the
  peer is gone (nothing listens at its address, or the connection closed:
  seen at once), and TimeoutError if the arrays are not complete within
  ``timeout_s`` of the start (a live peer that never offers, or a frozen
  one): the pull's own ``timeout`` does not end a pull of a uuid never
  offered (jax 0.10.2), so its daemon thread is left behind on a timeout.
  """

  def __init__(self, server, address, uuid, thread, done, timeout_s):
    self._server = server
    self._address = address
    self._uuid = uuid
    self._thread = thread
    self._done = done
    self._timeout_s = timeout_s
    self._deadline = time.monotonic() + timeout_s

  def wait(self, seconds: float) -> None:
    """Returns when the pull ends, its deadline passes, or after
    ``seconds``, whichever comes first."""
    self._thread.join(max(0.0, min(seconds, self._deadline - time.monotonic())))

  def ready(self) -> bool:
    """Whether :meth:`result` returns or raises at once."""
    return not self._thread.is_alive() or time.monotonic() >= self._deadline

  def result(self) -> list:
    """The pulled arrays, waited for until they arrive or the deadline
    passes (at once when :meth:`ready`)."""
    self._thread.join(max(0.0, self._deadline - time.monotonic()))
    if "arrays" in self._done:
      return self._done["arrays"]
    self._server._forget(self._address)
    if "error" in self._done:
      raise self._done["error"]
    raise TimeoutError(
      f"no arrays under uuid {self._uuid} from {self._address} within"
      f" {self._timeout_s} s"
    )


# gloo keeps the rendezvous of each clique under this directory, one key per
# rank, named by the clique's ordered device ids: "cpu:gloo/0,1/0".
_GLOO = "cpu:gloo/"


def gloo_cliques(store: KeyValueStore) -> dict[tuple[int, ...], list[str]]:
  """The gloo cliques the job has rendezvoused: device ids -> their keys."""
  cliques: dict[tuple[int, ...], list[str]] = {}
  for key in store.keys(_GLOO):
    name = key.split(_GLOO, 1)[-1].split("/")[0]
    try:
      ids = tuple(int(i) for i in name.split(","))
    except ValueError:
      continue
    cliques.setdefault(ids, []).append(key)
  return cliques


def forget_cliques_within(store: KeyValueStore, device_ids) -> int:
  """Deletes the rendezvous keys of every gloo clique whose devices are all
  in ``device_ids`` (a process's own, left by its previous incarnation: the
  restarted process could not rendezvous again, ``ALREADY_EXISTS``).
  Returns how many cliques it deleted."""
  mine = set(device_ids)
  stale = [ids for ids in gloo_cliques(store) if set(ids) <= mine]
  for ids in stale:
    store.delete(_GLOO + ",".join(map(str, ids)))
  return len(stale)
