"""Quantized wire: bytes per step and step time of ``cross_shard(adam)``.

``python -m benchmarks.perf.quantized [--quick] [--repeats R]`` times the ``pmap``
training step of ``shardopt.cross_shard(optax.adam(1e-3), axis,
comm_dtype=...)`` on the ~5M-parameter MLP (1024-2048-1536-10, 8 replicas,
16 examples each) with a float32 wire (the baseline), a bfloat16 wire, and
int8 / int8 with error feedback / float8 (e4m3fn) / int4 quantized wires,
interleaved (:func:`benchmarks.perf.harness.compare`, warm-up excluded, median of
``R`` rounds). Bytes per replica per step come from the lowered StableHLO
(every collective's operand: a ring all-reduce moves ``2 (n - 1) / n`` of its
buffer, an all-to-all ``(n - 1) / n`` of its operand, an all-gather ``n - 1``
times its operand). Where the quantized step costs more than the float32 one,
it pays off on links slower than ``(bytes saved) / (extra seconds)``: the
break-even bandwidth (on this CPU the wire is a shared-memory rendezvous, so
the extra time is mostly the quantize / dequantize passes, 8 virtual devices
sharing the cores: an upper bound of what one accelerator per replica pays).

Prints a table and writes ``benchmarks/results/quantized.json``
(``benchmarks/results/quick/quantized.json`` with ``--quick``).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick="--quick" in sys.argv[1:])

import argparse  # noqa: E402
import datetime  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks.perf import harness  # noqa: E402
from benchmarks.perf import workload  # noqa: E402
from shardopt.measure import hlo  # noqa: E402

MLP = (1024, 2048, 1536, 10)
QUICK_MLP = (64, 128, 10)
BASELINE = "float32 wire"
WIRES = {
  BASELINE: (None, False),
  "bfloat16 wire": (jnp.bfloat16, False),
  "int8": (jnp.int8, False),
  "int8 + error feedback": (jnp.int8, True),
  "float8_e4m3fn": (jnp.float8_e4m3fn, False),
  "float8_e4m3fn + error feedback": (jnp.float8_e4m3fn, True),
  "int4": (jnp.int4, False),
  "int4 + error feedback": (jnp.int4, True),
  # SparseLoCo's density: 64 of every 4096 (1.6%), 2-bit values.
  "topk(64) + error feedback": (shardopt.topk(64), True),
}
# The float32 wire plus nothing but an error buffer's traffic: what error
# feedback costs however it is fused (read e, write e' every step).
FLOOR = "float32 wire + an error buffer's read and write"
LINKS = {"100 Gb/s": 12.5e9, "10 Gb/s": 1.25e9, "1 Gb/s": 0.125e9}
# Per replica, the fraction of a collective's buffer (hlo.HloCollective's
# buffer_bytes: an all-reduce's or all-to-all's operand, an all-gather's
# result) that it sends.
_SENDS = {
  "all-reduce": lambda n: 2 * (n - 1) / n,
  "all-to-all": lambda n: (n - 1) / n,
  "all-gather": lambda n: (n - 1) / n,
}


def wire_bytes(stablehlo: str, n: int) -> dict:
  """Bytes one replica sends per step, by collective, from the StableHLO."""
  out = {}
  for op in hlo.lowered_collectives(stablehlo, num_devices=n):
    sent = op.buffer_bytes * _SENDS[op.kind](n)
    key = op.kind.replace("-", "_")
    out[key] = out.get(key, 0.0) + sent
  return out


def compiled_ops(text: str) -> dict:
  """What the compiled step runs, from its HLO text: ``fusions`` (every
  fusion instruction outside fused computations, a loop body's once),
  ``sorts`` (full sorts) and ``topk_calls`` (the CPU backend's partial-sort
  TopK custom call)."""
  return {
    "fusions": text.count(" fusion("),
    "sorts": text.count(" sort("),
    "topk_calls": text.count('custom_call_target="TopK"'),
  }


def error_buffer_traffic() -> optax.GradientTransformation:
  """Carries a float32 buffer like the gradients and rewrites it every step
  (``e' = (g + e) / 2``, the sum sent on): the memory traffic error
  feedback cannot avoid, on the float32 wire (the :data:`FLOOR` row)."""

  def init(params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def update(updates, state, params=None):
    del params
    sent = jax.tree.map(lambda g, e: g + e, updates, state)
    return sent, jax.tree.map(lambda x: x * jnp.float32(0.5), sent)

  return optax.GradientTransformation(init, update)


def _setup(comm_dtype, error_feedback, sizes, per_replica):
  if comm_dtype == FLOOR:
    tx = optax.chain(
      error_buffer_traffic(),
      shardopt.cross_shard(optax.adam(1e-3), workload.AXIS),
    )
    return workload.pmap_setup(tx, sizes, per_replica)
  tx = shardopt.cross_shard(
    optax.adam(1e-3),
    workload.AXIS,
    comm_dtype=comm_dtype,
    error_feedback=error_feedback,
  )
  return workload.pmap_setup(tx, sizes, per_replica)


def run(quick: bool, repeats: int) -> dict:
  n = jax.device_count()
  sizes = QUICK_MLP if quick else MLP
  candidates, rows = {}, {}
  for name, (comm_dtype, feedback) in {**WIRES, FLOOR: (FLOOR, True)}.items():
    step, args = _setup(comm_dtype, feedback, sizes, per_replica=16)
    lowered = step.lower(*args)
    sent = wire_bytes(lowered.as_text(), n)
    rows[name] = {
      "bytes_per_replica": sum(sent.values()),
      "by_op": sent,
      **compiled_ops(lowered.compile().as_text()),
    }
    candidates[name] = lambda s=step, a=args: s(*a)
  timing = harness.compare(
    candidates, baseline=BASELINE, repeats=repeats, inner=1 if quick else 3
  )
  base = rows[BASELINE]["bytes_per_replica"]
  base_time = timing["candidates"][BASELINE]["median_s"]
  for name, row in rows.items():
    t = timing["candidates"][name]
    row.update({k: t[k] for k in ("median_s", "ratio", "paired_ratio")})
    row["fewer_bytes"] = base / row["bytes_per_replica"]
    extra = t["median_s"] - base_time
    saved = base - row["bytes_per_replica"]
    row["break_even_bytes_per_s"] = (
      saved / extra if extra > 0 and saved > 0 else None
    )
    row["links_saved_s"] = {
      link: saved / bw - max(extra, 0.0) for link, bw in LINKS.items()
    }
  return {
    "title": "Quantized wire: cross_shard(adam) step, bytes and time",
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "command": "python -m benchmarks.perf.quantized"
    + (" --quick" if quick else "")
    + f" --repeats {repeats}",
    "devices": n,
    "mlp": list(sizes),
    "params": workload.count_params(
      workload.mlp_init(jax.random.key(0), sizes)
    ),
    "repeats": repeats,
    "rows": rows,
  }


def table(result: dict) -> str:
  lines = [
    f"{result['title']} (MLP {result['mlp']}, {result['params']:,} params,"
    f" {result['devices']} replicas, median of {result['repeats']})",
    "",
    "| wire | bytes/replica/step | fewer bytes | median step | ratio"
    " | paired ratio | pays off below | fusions | sorts | TopK calls |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, row in result["rows"].items():
    even = row["break_even_bytes_per_s"]
    pays = (
      "always (no extra time)"
      if even is None and row["fewer_bytes"] > 1
      else ("-" if even is None else f"{even * 8 / 1e9:.1f} Gb/s")
    )
    lines.append(
      f"| {name} | {row['bytes_per_replica']:,.0f} |"
      f" {row['fewer_bytes']:.2f}x | {row['median_s'] * 1e3:.2f} ms |"
      f" {row['ratio']:.3f} | {row['paired_ratio']:.3f} | {pays} |"
      f" {row['fusions']} | {row['sorts']} | {row['topk_calls']} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--repeats", type=int, default=21)
  args = parser.parse_args(argv)
  result = run(args.quick, args.repeats)
  print(table(result))
  path = _report.write_json("quantized.json", result, quick=args.quick)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
