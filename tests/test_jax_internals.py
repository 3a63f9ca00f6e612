"""Every experimental or private JAX call shardopt makes (src/shardopt/_jax.py)
still exists in this JAX: a JAX upgrade that moves one fails here, by name,
rather than inside an elastic run or as a slower step.

The transforms' fast paths: a test per touch point asserts that it ran (and
so that this JAX did not take the fallback); another points the private name
elsewhere and shows the fallback gives the same numbers and warns once."""

import collections
import functools
import inspect
import socket
import threading
import time
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardopt
from shardopt import _jax
from shardopt._skip import update_or_skip

# --- The transforms' fast paths. ---


@pytest.fixture
def unresolved(monkeypatch):
  """Every touch point resolved afresh, with fresh counts (both restored)."""
  monkeypatch.setattr(_jax, "_resolved", {})
  monkeypatch.setattr(_jax, "fast_path_runs", collections.Counter())


def _batched_flags(x, counter, in_axes=(0, None)):
  """(is x batched, is counter batched), read at trace time under vmap."""
  seen = []

  def body(x, counter):
    seen.append((_jax.batched_by_vmap(x), _jax.batched_by_vmap(counter)))
    return x

  jax.vmap(body, in_axes=in_axes)(x, counter)
  return seen


def test_batched_by_vmap_takes_the_batch_tracer_fast_path(unresolved):
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    seen = _batched_flags(jnp.ones((4, 3)), jnp.int32(0))
  assert seen == [(True, False)]
  assert _jax.fast_path_runs["batched_by_vmap"] == 2
  assert _jax.batched_by_vmap(jnp.ones(3)) is False  # not traced at all


def test_periodic_update_reads_batched_by_vmap_through_the_fast_path(
  unresolved,
):
  tx = shardopt.local_sgd(optax.sgd(0.1), "data", sync_period=2)
  params = {"w": jnp.ones((4, 3))}
  state = jax.vmap(tx.init, axis_name="data")(params)
  with pytest.raises(ValueError, match="batched by jax.vmap"):
    jax.vmap(lambda g, s: tx.update(g, s, g)[0], axis_name="data")(
      params, state
    )
  assert _jax.fast_path_runs["batched_by_vmap"] >= 1


def _local_sgd_under_vmap_with_unbatched_counters(grads, p0, lr, steps):
  tx = shardopt.local_sgd(optax.sgd(lr), "data", sync_period=2)
  stacked = jax.vmap(tx.init, axis_name="data")({"w": jnp.asarray(p0)})
  axes = jax.tree.map(lambda _: None, stacked)._replace(
    local_state=jax.tree.map(lambda _: 0, stacked.local_state), restart=0
  )
  state = jax.tree.map(
    lambda x, a: x if a == 0 else x[0],
    stacked,
    axes,
    is_leaf=lambda x: x is None,
  )

  @functools.partial(
    jax.vmap, in_axes=(0, axes, 0), out_axes=(0, axes), axis_name="data"
  )
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = {"w": jnp.asarray(p0)}
  for _ in range(steps):
    p, state = step(p, state, {"w": jnp.asarray(grads)})
  return np.asarray(p["w"])


def test_without_the_batch_tracer_the_class_name_decides_and_warns_once(
  unresolved, monkeypatch
):
  """A JAX that moved BatchTracer's module: the same answers (and the same
  error for a vmapped counter, the same numbers for unbatched ones) from
  the tracer's class name, and one RuntimeWarning naming the version."""
  monkeypatch.setattr(
    _jax, "BATCH_TRACER", ("jax._src.interpreters.moved", "BatchTracer")
  )
  with pytest.warns(RuntimeWarning) as caught:
    first = _batched_flags(jnp.ones((4, 3)), jnp.int32(0))
    second = _batched_flags(jnp.ones(2), jnp.ones((4, 2)), (None, 0))
    tx = shardopt.local_sgd(optax.sgd(0.1), "data", sync_period=2)
    params = {"w": jnp.ones((4, 3))}
    state = jax.vmap(tx.init, axis_name="data")(params)
    with pytest.raises(ValueError, match="batched by jax.vmap"):
      jax.vmap(lambda g, s: tx.update(g, s, g)[0], axis_name="data")(
        params, state
      )
    p0 = np.zeros((4, 3), np.float32)
    grads = np.arange(12, dtype=np.float32).reshape(4, 3)
    got = _local_sgd_under_vmap_with_unbatched_counters(grads, p0, 0.5, 2)
  assert first == [(True, False)] and second == [(False, True)]
  # numpy: two local SGD steps, then the average of the replicas.
  local = p0 - 2 * 0.5 * grads
  np.testing.assert_allclose(
    got, np.broadcast_to(local.mean(0), (4, 3)), rtol=1e-6
  )
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1, messages
  assert jax.__version__ in messages[0]
  assert "jax._src.interpreters.moved.BatchTracer" in messages[0]
  assert _jax.fast_path_runs["batched_by_vmap"] == 0


def _adam_state_and_grads():
  tx = optax.adam(1e-2)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  state = tx.init(params)
  for _ in range(2):  # a state that is not all zeros
    g = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
    _, state = jax.jit(tx.update)(g, state, params)
  grads = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  return tx, params, state, grads


def _check_update_or_skip_numbers(tx, params, state, grads):
  """Applied: adam's own update, bit for bit; skipped: zeros, old state."""
  want = jax.jit(tx.update)(grads, state, params)
  got = jax.jit(lambda g, s, p: update_or_skip(True, tx.update, g, s, p))(
    grads, state, params
  )
  chex.assert_trees_all_equal(got, want)
  bad = {"w": grads["w"].at[1, 2].set(jnp.nan)}
  updates, kept = jax.jit(
    lambda g, s, p: update_or_skip(False, tx.update, g, s, p)
  )(bad, state, params)
  chex.assert_trees_all_equal(kept, state)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))


def test_update_or_skip_takes_the_equation_by_equation_fast_path(unresolved):
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    _check_update_or_skip_numbers(*_adam_state_and_grads())
  assert _jax.fast_path_runs["bind_equation"] > 0


def test_apply_if_finite_reads_its_guard_through_the_fast_path(unresolved):
  tx = shardopt.apply_if_finite(optax.sgd(1.0), 3, axis_name=None)
  params = jnp.zeros(3)
  updates, _ = jax.jit(tx.update)(jnp.ones(3), tx.init(params), params)
  np.testing.assert_array_equal(updates, -1.0)
  assert _jax.fast_path_runs["bind_equation"] > 0


@pytest.mark.parametrize("attribute", ["BIND_PARAMS", "EQUATION_CONTEXT"])
def test_without_equation_binding_update_or_skip_selects_after_and_warns_once(
  unresolved, monkeypatch, attribute
):
  """A JAX without Primitive.get_bind_params or JaxprEqn.ctx: the generic
  path (update whole, then select) gives the same numbers, with one
  RuntimeWarning naming the version and what degraded."""
  monkeypatch.setattr(_jax, attribute, "moved_in_a_later_jax")
  with pytest.warns(RuntimeWarning) as caught:
    _check_update_or_skip_numbers(*_adam_state_and_grads())
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1, messages
  assert jax.__version__ in messages[0]
  assert "moved_in_a_later_jax" in messages[0]
  assert "selects its outputs" in messages[0]
  assert _jax.fast_path_runs["bind_equation"] == 0


# --- shardopt.elastic. ---


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


def test_transfer_server_moves_arrays_between_two_servers_and_times_out():
  """jax.experimental.transfer (asynchronous rounds' exchange): an offered
  array is pulled whole onto the puller's device; a pull of a uuid nobody
  offered raises TimeoutError after its timeout instead of hanging (the
  pull's own timeout does not end it on jax 0.10.2: a thread waits)."""
  devices = jax.devices()
  offering = _jax.TransferServer(devices[0], "127.0.0.1")
  pulling = _jax.TransferServer(devices[1], "127.0.0.1")
  x = jax.device_put(jnp.arange(6.0).reshape(2, 3), devices[0])
  offering.offer(11, [x])
  (got,) = pulling.pull(offering.address, 11, [x], timeout_s=30)
  assert got.devices() == {devices[1]}
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
  with pytest.raises(TimeoutError, match="uuid 12"):
    pulling.pull(offering.address, 12, [x], timeout_s=0.5)
  # The waiting thread stays blocked until something is offered under the
  # uuid (a thread blocked in the pull at exit aborts the process): offer it.
  offering.offer(12, [x])
  for thread in threading.enumerate():
    if thread.name == "shardopt-pull":
      thread.join(timeout=30)
      assert not thread.is_alive()


def test_a_pull_from_an_address_nothing_listens_at_fails_at_once():
  """A dead peer's address: a transfer connection to it would wait out the
  pull's timeout (jax 0.10.2); the pull checks that something listens and
  raises ConnectionError at once."""
  with socket.socket() as s:  # a port nothing listens at once it is closed
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  pulling = _jax.TransferServer(jax.devices()[1], "127.0.0.1")
  like = [jax.ShapeDtypeStruct((4,), np.float32)]
  began = time.monotonic()
  with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
    pulling.pull(f"127.0.0.1:{port}", 1, like, timeout_s=30)
  assert time.monotonic() - began < 5.0


def test_coordinator_address_is_empty_without_distributed():
  assert _jax.coordinator_address() == ""
