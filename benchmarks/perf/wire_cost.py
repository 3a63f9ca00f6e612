"""Wires' memory traffic: XLA's bytes accessed per element of a reduction.

``python -m benchmarks.perf.wire_cost [--quick]`` compiles
``shardopt.cross_shard_mean(axis, comm_dtype=..., error_feedback=...)``'s
update (the gradients and the state in, the mean and the state out) under
``jax.jit`` + ``jax.shard_map(check_vma=False)`` over the 8 CPU devices,
each replica's gradients a ``P(axis)`` block of one global array, the state
donated (a training loop's error buffer is updated in place), and prints
``compiled.cost_analysis()["bytes accessed"]`` (one device's module) over the
gradient elements of one replica: float32, int8, int4 and float8 (e4m3fn)
without and with error feedback, and the top-k wire (64 of every 4096,
2-bit values) with it. Nothing runs: it reads what XLA plans to touch.

Three gradient shapes: one flat leaf of 2**18 elements (every chunk and
block full), one of 100,000 (padded chunks) and the gradients of
``benchmarks.perf.quantized``'s MLP (1024-2048-1536-10, 5.3M parameters in
6 leaves). ``minus`` is a wire's bytes with error feedback less its bytes
without (reading and writing a float32 error buffer once is 8), and top-k's
less int8 + EF's.

Caveat: XLA's cost analysis counts a ``while`` loop's body once, whatever
its trip count; the quantized wires sum the ``n`` received rows in one
(:func:`shardopt.wire.blocks._sum_received`), so their totals leave out
``n - 2`` passes over the owned chunk (about ``(n - 2) x 5 / n`` bytes per
element at ``n`` = 8) for all of them alike: the differences stand.

Prints a table and writes ``benchmarks/results/wire_cost.json`` (with the
date, the commit and the device it ran on; ``results/quick/`` with
``--quick``, which measures the flat 2**18 leaf only).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick=False)

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import _report  # noqa: E402

AXIS = "batch"
# label -> (comm_dtype, error_feedback)
WIRES = {
  "float32": (None, False),
  "int8": (jnp.int8, False),
  "int8 + EF": (jnp.int8, True),
  "int4": (jnp.int4, False),
  "int4 + EF": (jnp.int4, True),
  "float8_e4m3fn": (jnp.float8_e4m3fn, False),
  "float8_e4m3fn + EF": (jnp.float8_e4m3fn, True),
  "topk(64) + EF": (shardopt.topk(64), True),
}
# What a row is compared with: a quantized wire's error feedback with the
# same wire without it (the goal: <= 16), top-k with int8 + EF (<= 0).
AGAINST = {
  "int8 + EF": "int8",
  "int4 + EF": "int4",
  "float8_e4m3fn + EF": "float8_e4m3fn",
  "topk(64) + EF": "int8 + EF",
}
MLP = (1024, 2048, 1536, 10)
SHAPES = {
  "flat 2^18": [(1 << 18,)],
  "flat 100,000": [(100_000,)],
  f"MLP {list(MLP)}": [
    s for a, b in zip(MLP[:-1], MLP[1:], strict=True) for s in ((a, b), (b,))
  ],
}
QUICK_SHAPES = ("flat 2^18",)


def compiled_update(comm_dtype, error_feedback: bool, shapes, mesh=None):
  """``cross_shard_mean``'s update compiled for per-replica gradients of
  ``shapes`` (each a ``P(AXIS)`` block), the state donated."""
  mesh = mesh or jax.make_mesh((jax.device_count(),), (AXIS,))
  n = mesh.shape[AXIS]
  tx = shardopt.cross_shard_mean(
    AXIS, comm_dtype=comm_dtype, error_feedback=error_feedback
  )
  one = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  state = jax.eval_shape(tx.init, one)
  state_specs = jax.tree.map(lambda a: P(AXIS) if a.ndim else P(), state)

  def blocks(a, spec):  # n replicas' values as P(AXIS) blocks
    shape = ((n * a.shape[0],) + a.shape[1:]) if spec == P(AXIS) else a.shape
    return jax.ShapeDtypeStruct(
      shape, a.dtype, sharding=NamedSharding(mesh, spec)
    )

  grads = [blocks(g, P(AXIS)) for g in one]
  state = jax.tree.map(blocks, state, state_specs)
  update = jax.jit(
    jax.shard_map(
      tx.update,
      mesh=mesh,
      in_specs=(P(AXIS), state_specs),
      out_specs=(P(AXIS), state_specs),
      check_vma=False,
    ),
    donate_argnums=(1,),
  )
  return update.lower(grads, state).compile()


def bytes_per_element(compiled, shapes) -> float:
  """XLA's bytes accessed (one device) over one replica's elements."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["bytes accessed"]) / sum(int(np.prod(s)) for s in shapes)


def run(quick: bool = False) -> dict:
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
  names = QUICK_SHAPES if quick else tuple(SHAPES)
  rows = {}
  for shape_name in names:
    shapes = SHAPES[shape_name]
    rows[shape_name] = {
      label: bytes_per_element(compiled_update(dtype, ef, shapes, mesh), shapes)
      for label, (dtype, ef) in WIRES.items()
    }
  return {
    "title": "Wires: XLA's bytes accessed per gradient element of"
    " cross_shard_mean's update (CPU, one device's module)",
    "command": "python -m benchmarks.perf.wire_cost"
    + (" --quick" if quick else ""),
    "machine": _report.machine(),
    "replicas": jax.device_count(),
    "shapes": {k: [list(s) for s in SHAPES[k]] for k in names},
    "bytes_per_element": rows,
    "minus": {
      shape_name: {
        label: row[label] - row[base] for label, base in AGAINST.items()
      }
      for shape_name, row in rows.items()
    },
  }


def table(result: dict) -> str:
  names = list(result["bytes_per_element"])
  lines = [
    f"{result['title']}; {result['replicas']} replicas,"
    f" {result['machine']['date_utc']}, commit"
    f" {result['machine']['git_commit']}",
    "",
    "| wire | " + " | ".join(names) + " | minus | " + " | ".join(names) + " |",
    "|---|" + "---:|" * len(names) + "---|" + "---:|" * len(names),
  ]
  for label in WIRES:
    cells = [f"{result['bytes_per_element'][n][label]:.1f}" for n in names]
    minus = [
      f"{result['minus'][n][label]:+.1f}" if label in AGAINST else ""
      for n in names
    ]
    lines.append(
      f"| {label} | "
      + " | ".join(cells)
      + f" | {AGAINST.get(label, '')} | "
      + " | ".join(minus)
      + " |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  result = run(args.quick)
  print(table(result))
  path = _report.write_json("wire_cost.json", result, quick=args.quick)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
