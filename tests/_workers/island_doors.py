"""A worker for tests/test_elastic_doors.py: one process of a small job of
shardopt.elastic islands (one CPU device each), in one of these modes:

    python island_doors.py MODE PROCESS_ID NUM_PROCESSES PORT [ROUNDS]

- ``shapes``: process 1's params have another shape for leaf ``['w']``;
  every process syncs once (the handshake), then finishes.
- ``ints``: every process's params hold an int32 leaf ``['step']``.
- ``lonely``: a dedicated coordinator (``timeout_s=5``) whose island,
  process 1, leaves right after ``initialize`` and never joins.
- ``sigterm``: the same with ``timeout_s=600``: the test sends SIGTERM to
  process 0 once it prints ``COORDINATING``.
- ``keys``: ROUNDS rounds (``sync_period=1``, ``stall_timeout_s`` set so
  that the stall keys are written too); process 0 prints the number of keys
  under ``shardopt/`` in the coordination service's store after each round
  (``KEYS round <n> <keys>``), and all finish. ``keys_coordinated``: the
  same under a dedicated coordinator (process 0, which prints them).

Each line it prints starts with ``[p<id>]``.
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=1"
  " --xla_cpu_collective_timeout_seconds=20"
)

mode, pid, n, port = sys.argv[1], *(int(a) for a in sys.argv[2:5])
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 0

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardopt  # noqa: E402
from shardopt import _jax  # noqa: E402


def say(message: str) -> None:
  print(f"[p{pid}] {message}", flush=True)


dedicated = mode in ("lonely", "sigterm", "keys_coordinated")
shardopt.elastic.initialize(
  f"127.0.0.1:{port}",
  num_processes=n,
  process_id=pid,
  initialization_timeout=120,
  dedicated_coordinator=dedicated,
)
if mode in ("lonely", "sigterm") and pid != 0:
  say("LEAVING")
  os._exit(0)

params = {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}
if mode == "shapes" and pid == 1:
  params["w"] = np.ones((4, 4), np.float32)
if mode == "ints":
  params["step"] = np.zeros((), np.int32)
params = jax.tree.map(jax.numpy.asarray, params)

tx = shardopt.diloco(optax.sgd(0.1), "island", sync_period=1)
island = shardopt.elastic.Island(
  tx,
  timeout_s=5 if mode == "lonely" else 60,
  round_timeout_s=120 if mode != "sigterm" else 900,
  stall_timeout_s=30 if mode.startswith("keys") else None,
  dedicated_coordinator=dedicated,
)
state = island.tx.init(params)

store = _jax.KeyValueStore()


def count_keys(params, state, done) -> None:
  say(f"KEYS round {done.number} {len(store.keys('shardopt/'))}")


if dedicated and pid == 0:
  say("COORDINATING")
  params, state = island.coordinate(params, state, on_round=count_keys)
  say("RETURNED")
  say("KEYS " + " ".join(sorted(store.keys("shardopt/"))))
  island.finish()

say("SYNCING")
params, state, _ = island.sync(params, state)
say("SYNCED")
store = _jax.KeyValueStore()


@jax.jit
def local_step(params, state):
  grads = jax.tree.map(lambda p: 0.01 * (p - pid), params)
  updates, state = island.tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


for r in range(rounds):
  params, state = local_step(params, state)
  params, state, done = island.sync(params, state)
  if pid == 0:
    count_keys(params, state, done)
if pid == 0:
  say("KEYS " + " ".join(sorted(store.keys("shardopt/"))))
time.sleep(0.1)
island.finish()
