"""Memory: optimizer-state bytes per replica, ``tower(adam)`` vs ``cross_shard(adam)``.

For n = 2, 4 and 8 replicas (``pmap`` over the first n devices), the state
returned by ``jax.pmap(tx.init)`` is read shard by shard: the bytes that live
on one device. ``cross_shard(adam)`` keeps Adam's two moments for every
parameter on every replica (2 P); ``tower(adam)`` keeps them only for the
replica's 1/n slice (2 P / n, plus padding to a multiple of n). The step
time of the two is timed interleaved at each n.
"""

from __future__ import annotations

import jax
import optax

import shardopt
from benchmarks.perf import harness
from benchmarks.perf import workload

NAME = "memory"


def _state_bytes_on_first_device(state) -> int:
  total = 0
  for leaf in jax.tree.leaves(state):
    shard = leaf.addressable_shards[0].data
    total += shard.size * shard.dtype.itemsize
  return total


def run(quick: bool) -> dict:
  """Measures state bytes per replica and the tower/cross_shard step-time ratio."""
  sizes = (64, 128, 10) if quick else (1024, 2048, 1536, 10)
  per_replica = 8 if quick else 16
  repeats = 7 if quick else 9
  inner = 3 if quick else 1
  params = workload.mlp_init(jax.random.key(0), sizes)
  param_bytes = workload.tree_bytes(params)
  rows, data = [], {}
  for n in (2, 8) if quick else (2, 4, 8):
    devices = jax.devices()[:n]
    identity = jax.pmap(lambda t: t, devices=devices)
    p_params = identity(workload.replicate(params, n))
    x, y = identity(
      workload.batch(jax.random.key(n), n, per_replica, sizes[0], sizes[-1])
    )
    transforms = {
      "cross_shard(adam)": shardopt.cross_shard(
        optax.adam(1e-3), workload.AXIS
      ),
      "tower(adam)": shardopt.tower(optax.adam(1e-3), workload.AXIS),
    }
    candidates, state_bytes = {}, {}
    for name, tx in transforms.items():
      state = jax.pmap(tx.init, axis_name=workload.AXIS, devices=devices)(
        p_params
      )
      state_bytes[name] = _state_bytes_on_first_device(state)
      step = workload.pmap_step(tx, devices=devices)
      candidates[name] = lambda s=step, st=state: s(p_params, st, x, y)
    timing = harness.compare(
      candidates, baseline="cross_shard(adam)", repeats=repeats, inner=inner
    )
    entry = {
      "state_bytes_per_replica": state_bytes,
      "state_over_param_bytes": {
        k: v / param_bytes for k, v in state_bytes.items()
      },
    }
    ratio = timing["candidates"]["tower(adam)"]
    entry["tower_over_cross_shard_step_time"] = ratio["ratio"]
    entry["tower_over_cross_shard_paired"] = ratio["paired_ratio"]
    entry["tower_over_cross_shard_state"] = (
      state_bytes["tower(adam)"] / state_bytes["cross_shard(adam)"]
    )
    data[n] = entry
    rows.append(
      [
        f"{n}",
        f"{state_bytes['cross_shard(adam)'] / 1e6:,.3f}",
        f"{state_bytes['tower(adam)'] / 1e6:,.3f}",
        f"{entry['tower_over_cross_shard_state']:.3f} (ideal {1 / n:.3f})",
        f"{entry['tower_over_cross_shard_step_time']:.3f}"
        f" (paired {entry['tower_over_cross_shard_paired']:.3f})",
      ]
    )
  notes = [
    f"MLP {list(sizes)}: P = {param_bytes / 1e6:,.3f} MB of float32 params;"
    " state bytes are what one device holds after `jax.pmap(tx.init)`"
    f" (Adam: count + mu + nu). Step-time ratio: median of {repeats}"
    " interleaved rounds, warm-up excluded, pmap over the first n devices.",
  ]
  return {
    "title": "4. Memory: optimizer state per replica, tower vs cross_shard",
    "table": {
      "columns": [
        "replicas n",
        "cross_shard(adam) MB/replica",
        "tower(adam) MB/replica",
        "tower / cross_shard state",
        "tower / cross_shard step time",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": {
      "sizes": list(sizes),
      "param_bytes": param_bytes,
      "repeats": repeats,
      "by_replicas": data,
    },
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``memory.png``: optimizer-state MB per replica for each n."""
  from benchmarks import _plots

  labels, values = [], []
  for n, entry in result["data"]["by_replicas"].items():
    for name, count in entry["state_bytes_per_replica"].items():
      labels.append(f"n={n} · {name}")
      values.append(count / 1e6)
  return [
    _plots.bars(
      f"{directory}/memory.png",
      labels,
      values,
      title="Optimizer state per replica",
      xlabel="MB",
    )
  ]
