"""Every experimental or private JAX call of :mod:`shardopt.elastic`, behind
names of ours.

JAX's fault tolerance is experimental (jax >= 0.10.1), and a few things the
elastic rounds need have no public API yet. Each is touched here and nowhere
else, so a JAX release that moves one breaks one function, named in one test
(``tests/test_jax_internals.py``), with a :class:`JaxInternalsError` that
says which and why:

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
"""

from __future__ import annotations

import os
from typing import Any

import jax


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

  def set(self, key: str, value: str) -> None:
    self._client.key_value_set(key, value)

  def get(self, key: str, timeout_s: float) -> str:
    """The value of ``key``, waiting up to ``timeout_s`` for it to be set."""
    return self._client.blocking_key_value_get(key, int(timeout_s * 1000))

  def keys(self, directory: str) -> list[str]:
    # The _bytes variant: gloo's values are binary.
    return [k for k, _ in self._client.key_value_dir_get_bytes(directory)]

  def delete(self, key: str) -> None:
    self._client.key_value_delete(key)


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
