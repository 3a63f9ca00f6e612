"""A worker for tests/test_elastic.py: once a second, a psum over the live
processes' devices in sorted order inside ``live_devices`` (JAX's own
fault-tolerance runtime, gloo, no shardopt), printing ``OK live=[ids]`` or
``FAIL <error>`` per round.

    python same_order_rejoin.py PROCESS_ID NUM_PROCESSES PORT SECONDS

Reduced from ../shared/probes/live_devices_probe.py: it pins the JAX
behaviour that a restarted process cannot rejoin under the device order its
predecessor used.
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_cpu_collective_timeout_seconds=10"

import jax  # noqa: E402
import numpy as np  # noqa: E402

pid, n, port = (int(a) for a in sys.argv[1:4])
seconds = float(sys.argv[4])
jax.config.update("jax_enable_recoverability", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
  f"127.0.0.1:{port}",
  num_processes=n,
  process_id=pid,
  heartbeat_timeout_seconds=5,
  initialization_timeout=60,
)
from jax.experimental.multihost_utils import live_devices  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

local = jax.local_devices()[0]


def psum_over(devices):
  mesh = Mesh(np.array(devices), ("i",))
  x = jax.make_array_from_single_device_arrays(
    (len(devices),),
    NamedSharding(mesh, P("i")),
    [jax.device_put(np.array([float(pid + 1)], np.float32), local)],
  )
  f = jax.jit(
    jax.shard_map(
      lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()
    )
  )
  return float(
    np.asarray(jax.block_until_ready(f(x)).addressable_shards[0].data)[0]
  )


t0 = time.time()
while time.time() - t0 < seconds:
  try:
    with live_devices(jax.devices()) as devices:
      total = psum_over(devices)
  except Exception as e:  # noqa: BLE001
    print(f"FAIL {type(e).__name__}: {str(e)[:200]}", flush=True)
  else:
    print(f"OK live={[d.id for d in devices]} sum={total}", flush=True)
  time.sleep(1)
os._exit(0)
