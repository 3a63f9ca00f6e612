"""One process of ``python -m benchmarks.perf.elastic``'s round-cost part.

    python benchmarks/perf/_elastic_worker.py PROCESS_ID NUM_PROCESSES PORT OUT ROUNDS

Each process is an island of 2 CPU devices training examples/elastic_diloco.py's
MLP. Interleaved, ROUNDS times, every process runs (in the same order):

1. an elastic round: ``island.sync`` after one inner step (``shardopt.elastic``:
   ``live_devices``, a row, one all_gather, the commit);
2. today's sync: ``shardopt.diloco`` over the islands inside one
   ``jax.jit(jax.shard_map(...))`` over the global (island, data) mesh, at a
   step that syncs (sync_period=2) and at one that does not.

Writes the per-repeat seconds to ``OUT/p{PROCESS_ID}.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=2"
  " --xla_cpu_collective_timeout_seconds=30"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
_spec = importlib.util.spec_from_file_location(
  "elastic_diloco", ROOT / "examples" / "elastic_diloco.py"
)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardopt  # noqa: E402


def main() -> None:
  me, n, port = (int(a) for a in sys.argv[1:4])
  out, rounds = Path(sys.argv[4]), int(sys.argv[5])
  shardopt.elastic.initialize(f"127.0.0.1:{port}", n, me)
  inner = optax.adamw(example.LEARNING_RATE, weight_decay=example.WEIGHT_DECAY)

  def loss(p, x, y):
    return jnp.mean((example.mlp(p, x, jnp) - y) ** 2)

  # --- elastic: this island's devices, data parallel
  local = Mesh(np.array(jax.local_devices()), ("data",))
  rep, data = NamedSharding(local, P()), NamedSharding(local, P("data"))
  island = shardopt.elastic.Island(
    shardopt.diloco(inner, "island", sync_period=1)
  )

  @jax.jit
  def inner_step(p, s, x, y):
    updates, s = island.tx.update(jax.grad(loss)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s

  params = jax.device_put(example.init_mlp(0), rep)
  state = jax.device_put(island.tx.init(params), rep)
  params, state, _ = island.sync(params, state)

  # --- today's sync: one program over every island's devices
  glob = jax.make_mesh((n, 2), ("island", "data"), devices=jax.devices())
  tx = shardopt.diloco(inner, "island", sync_period=2)
  init = example.init_mlp(0)
  # Per island a block of the concatenated leading axis (P("island")).
  stacked = {k: np.concatenate([v] * n) for k, v in init.items()}
  per_island = jax.tree.map(lambda _: P("island"), stacked)
  state_specs = shardopt.state_specs(tx, init, "island", mesh=glob)

  def plain(p, s, x, y):
    g = jax.grad(loss)(p, x, y)
    g = jax.lax.pmean(g, "data")
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  plain_step = jax.jit(
    jax.shard_map(
      plain,
      mesh=glob,
      in_specs=(
        per_island,
        state_specs,
        P(("island", "data")),
        P(("island", "data")),
      ),
      out_specs=(per_island, state_specs),
    )
  )
  gp = jax.device_put(stacked, NamedSharding(glob, P("island")))
  gs = jax.jit(
    jax.shard_map(tx.init, mesh=glob, in_specs=(P(),), out_specs=state_specs)
  )(jax.device_put(init, NamedSharding(glob, P())))

  def global_batch(t):
    x, y = example.batch(me, t)
    xs = NamedSharding(glob, P(("island", "data")))
    make = lambda a: jax.make_array_from_process_local_data(xs, a)  # noqa: E731
    return make(x), make(y)

  times = {
    "inner_step": [],
    "elastic_round": [],
    "plain_local": [],
    "plain_sync": [],
  }
  for t in range(1, rounds + 3):
    x, y = example.batch(me, t)
    t0 = time.perf_counter()
    params, state = inner_step(
      params, state, jax.device_put(x, data), jax.device_put(y, data)
    )
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    params, state, _ = island.sync(params, state)
    t2 = time.perf_counter()
    for kind in ("plain_local", "plain_sync"):  # count 2t-1 local, 2t syncs
      gx, gy = global_batch(t)
      t3 = time.perf_counter()
      gp, gs = plain_step(gp, gs, gx, gy)
      jax.block_until_ready(gs)
      times[kind].append(time.perf_counter() - t3)
    times["inner_step"].append(t1 - t0)
    times["elastic_round"].append(t2 - t1)
  times = {k: v[2:] for k, v in times.items()}  # drop the compiling rounds
  (out / f"p{me}.json").write_text(json.dumps(times))
  if me == 0:
    time.sleep(2)
  os._exit(0)


if __name__ == "__main__":
  main()
