"""Every experimental or private JAX call shardopt makes (src/shardopt/_jax.py)
still exists in this JAX: a JAX upgrade that moves one fails here, by name,
rather than inside an elastic run."""

import inspect

import jax
import pytest

from shardopt import _jax


def test_recoverability_option_exists():
  assert "jax_enable_recoverability" in jax.config.values


def test_live_devices_and_process_failure_error_exist():
  assert issubclass(_jax.process_failure_error(), Exception)
  from jax.experimental import multihost_utils

  # A context manager over a device list; its incarnation table (read by
  # _jax.incarnations) is an attribute it sets on entry.
  assert callable(multihost_utils.live_devices)
  assert hasattr(multihost_utils.live_devices, "devices")
  source = inspect.getsource(type(multihost_utils.live_devices))
  assert "self.devices = " in source
  assert "get_live_nodes" in inspect.getsource(multihost_utils._live_devices)


def test_incarnations_refuses_clearly_outside_a_block():
  # Outside any live_devices block the table is None: a clear error, not a
  # KeyError inside a round.
  from jax.experimental import multihost_utils

  if multihost_utils.live_devices.devices is None:
    with pytest.raises(_jax.JaxInternalsError, match="live_devices.devices"):
      _jax.incarnations()


def test_key_value_client_has_the_methods_elastic_calls():
  from jax._src import distributed
  from jax._src.lib import _jax as jaxlib

  assert hasattr(distributed.global_state, "client")
  client = jaxlib.DistributedRuntimeClient
  for method in (
    "key_value_set",
    "blocking_key_value_get",
    "key_value_dir_get_bytes",
    "key_value_delete",
  ):
    assert hasattr(client, method), method


def test_key_value_store_refuses_clearly_without_distributed():
  with pytest.raises(RuntimeError, match="elastic.initialize"):
    _jax.KeyValueStore()


def test_backends_initialized_is_read():
  jax.devices()
  assert _jax.backends_initialized() is True


def test_add_xla_flag_keeps_a_flag_the_user_set(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=99")
  _jax.add_xla_flag("xla_cpu_collective_timeout_seconds", 10)
  _jax.add_xla_flag("xla_some_other_flag", 1)
  import os

  assert os.environ["XLA_FLAGS"] == (
    "--xla_cpu_collective_timeout_seconds=99 --xla_some_other_flag=1"
  )


class _FakeStore:
  def __init__(self, keys):
    self.keys_ = list(keys)
    self.deleted = []

  def keys(self, directory):
    return [k for k in self.keys_ if k.startswith(directory)]

  def delete(self, key):
    self.deleted.append(key)


def test_forget_cliques_within_deletes_only_cliques_inside_the_devices():
  store = _FakeStore(
    [
      "cpu:gloo/4096,4097/0",
      "cpu:gloo/4096,4097/1",
      "cpu:gloo/4097,4096/0",
      "cpu:gloo/0,2048,4096/2",
      "cpu:gloo/2048,2049/0",
    ]
  )
  assert _jax.forget_cliques_within(store, [4096, 4097]) == 2
  assert sorted(store.deleted) == ["cpu:gloo/4096,4097", "cpu:gloo/4097,4096"]


def test_initialize_refuses_once_backends_run():
  import shardopt

  jax.devices()
  with pytest.raises(RuntimeError, match="before any other JAX call"):
    shardopt.elastic.initialize("127.0.0.1:1", 1, 0)
