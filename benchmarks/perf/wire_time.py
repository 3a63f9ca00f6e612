"""The quantized wires' update timed against another revision's, side by side.

``python -m benchmarks.perf.wire_time --against REV [--quick]`` compiles
``shardopt.cross_shard_mean(axis, comm_dtype=..., error_feedback=...)``'s
update as :mod:`benchmarks.perf.wire_cost` does (jit + ``shard_map`` over the
8 CPU devices, the state donated) twice: with this tree's
``shardopt/wire/blocks.py`` and with the one ``git show REV:src/shardopt/
wire/blocks.py`` gives (the rest of the package is this tree's), then runs
the two interleaved (``benchmarks.perf.harness.compare``, median of 15
rounds) on the same gradients, for int8, float8 (e4m3fn) and int4, with and
without error feedback, on the flat 2**18 leaf, the padded 100,000 one and
the 5.3M-parameter MLP's leaves. Prints each row's bytes accessed per
element (XLA's cost analysis) and milliseconds under both, and the paired
ratio (this tree / REV); writes ``benchmarks/results/wire_time.json``
(``results/quick/`` with ``--quick``: the 2**18 leaf only, with error
feedback only).

The machine is shared: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick=False)

import argparse  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks.perf import harness  # noqa: E402
from benchmarks.perf import wire_cost  # noqa: E402
from shardopt.wire import blocks  # noqa: E402

WIRES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "int4": jnp.int4}
REPEATS = 15


def blocks_of(rev: str) -> dict:
  """The namespace of ``rev``'s ``shardopt/wire/blocks.py``, executed over
  this tree's package (its imports resolve here)."""
  source = subprocess.run(
    ["git", "show", f"{rev}:src/shardopt/wire/blocks.py"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  namespace = {
    "__name__": "shardopt.wire.blocks",
    "__package__": "shardopt.wire",
  }
  exec(compile(source, f"{rev}:blocks.py", "exec"), namespace)  # noqa: S102
  return namespace


def _compiled(dtype, error_feedback, shapes, mesh, all_reduce=None):
  """``wire_cost.compiled_update``, with ``all_reduce`` in place of this
  tree's ``blocks.all_reduce`` while it traces (the wire calls it by name)."""
  here = blocks.all_reduce
  blocks.all_reduce = all_reduce or here
  try:
    return wire_cost.compiled_update(dtype, error_feedback, shapes, mesh)
  finally:
    blocks.all_reduce = here


def _runner(compiled, dtype, error_feedback, shapes, mesh, grads):
  """A zero-argument step of ``compiled`` on ``grads`` that carries its own
  (donated) state from call to call."""
  n = mesh.shape[wire_cost.AXIS]
  tx = shardopt.cross_shard_mean(
    wire_cost.AXIS, comm_dtype=dtype, error_feedback=error_feedback
  )
  one = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

  def zeros(a):
    spec = P(wire_cost.AXIS) if a.ndim else P()
    shape = ((n * a.shape[0],) + a.shape[1:]) if a.ndim else ()
    return jax.device_put(jnp.zeros(shape, a.dtype), NamedSharding(mesh, spec))

  state = [jax.tree.map(zeros, jax.eval_shape(tx.init, one))]

  def step():
    out, state[0] = compiled(grads, state[0])
    return out

  return step


def run(against: str, quick: bool = False) -> dict:
  mesh = jax.make_mesh((jax.device_count(),), (wire_cost.AXIS,))
  n = mesh.shape[wire_cost.AXIS]
  theirs = blocks_of(against)["all_reduce"]
  names = wire_cost.QUICK_SHAPES if quick else tuple(wire_cost.SHAPES)
  rng = np.random.default_rng(0)
  rows = []
  for shape_name in names:
    shapes = wire_cost.SHAPES[shape_name]
    grads = [
      jax.device_put(
        rng.standard_normal((n * s[0],) + s[1:]).astype(np.float32),
        NamedSharding(mesh, P(wire_cost.AXIS)),
      )
      for s in shapes
    ]
    for label, dtype in WIRES.items():
      for ef in (True,) if quick else (False, True):
        versions = {
          "here": _compiled(dtype, ef, shapes, mesh),
          against: _compiled(dtype, ef, shapes, mesh, theirs),
        }
        timed = harness.compare(
          {
            k: _runner(c, dtype, ef, shapes, mesh, grads)
            for k, c in versions.items()
          },
          baseline=against,
          repeats=REPEATS,
        )["candidates"]
        rows.append(
          {
            "shape": shape_name,
            "wire": label + (" + EF" if ef else ""),
            "bytes_per_element": {
              k: wire_cost.bytes_per_element(c, shapes)
              for k, c in versions.items()
            },
            "median_ms": {k: 1e3 * t["median_s"] for k, t in timed.items()},
            "paired_ratio": timed["here"]["paired_ratio"],
          }
        )
        print(_line(rows[-1], against), flush=True)
  return {
    "title": "Quantized wires: cross_shard_mean's update, this tree's"
    f" wire/blocks.py against {against}'s, interleaved (CPU, 8 devices)",
    "command": "python -m benchmarks.perf.wire_time --against "
    + against
    + (" --quick" if quick else ""),
    "machine": _report.machine(),
    "against": against,
    "repeats": REPEATS,
    "rows": rows,
  }


def _line(row: dict, against: str) -> str:
  b, t = row["bytes_per_element"], row["median_ms"]
  return (
    f"| {row['shape']} | {row['wire']} | {b[against]:.1f} | {b['here']:.1f}"
    f" | {t[against]:.2f} | {t['here']:.2f} | {row['paired_ratio']:.3f} |"
  )


def table(result: dict) -> str:
  against = result["against"]
  lines = [
    f"{result['title']}; {result['machine']['date_utc']}, commit"
    f" {result['machine']['git_commit']}, load average"
    f" {result['machine']['load_average_at_start'][0]:.1f}",
    "",
    f"| leaves | wire | bytes/element {against} | here | ms {against}"
    " | here | here / " + against + " (paired) |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  return "\n".join(lines + [_line(r, against) for r in result["rows"]])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--against", required=True, help="a git revision (its wire/blocks.py)"
  )
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  result = run(args.against, args.quick)
  print(table(result))
  path = _report.write_json("wire_time.json", result, quick=args.quick)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
