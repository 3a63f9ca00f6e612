"""Bytes a compiled step accesses: host-scheduled vs in-graph schedule.

``python -m benchmarks.perf.step_bytes [--quick]`` compiles the donated
training step (``jax.jit`` + ``shard_map(check_vma=False)``, per-replica
``P(axis)`` blocks: :func:`benchmarks.perf.workload.concat_shard_map_step`,
the layout of :mod:`benchmarks.perf.cost`'s donated runs) of every periodic
transform with every wire, four ways, and reads each compiled program
(issue 54):

1. **floor**: the plain ``optax.adam`` step (for ``agn``: adam plus a
   hand-written accumulator add, the local work its step must do);
2. **in-graph**: ``tx.update(grads, state, params)``, the schedule decided
   in the graph (a ``lax.cond`` per sync), the program every step runs;
3. **host sync=0**: ``tx.update(..., sync=0)``, the host's plain local step;
4. **host sync=1**: ``tx.update(..., sync=1)``, the host's first sync (a
   fragment, a level) alone.

Per program: XLA's ``bytes accessed`` (``compiled.cost_analysis()``) and
its ratio to the floor, the number of ``conditional`` instructions and of
collectives (:func:`shardopt.measure.hlo.compiled_collectives`, those in
branches included), and the bytes of ``copy`` instructions
(:func:`shardopt.measure.hlo.copied_bytes`, the entry computation and every
branch together). Nothing runs: these are compiled programs, read. A
transform that refuses a wire (``hierarchical_local_sgd`` takes no error
feedback) is listed with its error.

Prints a table and writes ``benchmarks/results/step_bytes.json`` (``--quick``:
a small MLP and two wires, into ``benchmarks/results/quick/``) with the
run's own provenance (:func:`benchmarks._report.provenance`).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before jax is imported
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick="--quick" in sys.argv[1:])

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks.perf import step_bytes_blocks  # noqa: E402
from benchmarks.perf import workload  # noqa: E402
from shardopt.measure import hlo  # noqa: E402

PROG = "benchmarks.perf.step_bytes"
FILENAME = "step_bytes.json"
AXIS = workload.AXIS
# tests/test_host_schedule.py's program MLP and batch (issue 54's numbers)
MLP = (64, 256, 256, 10)
QUICK_MLP = (32, 64, 10)
PER_REPLICA = 4
PROGRAMS = step_bytes_blocks.STEP_PROGRAMS  # in-graph, host sync=0, host sync=1

WIRES: dict[str, dict] = {
  "float32": {},
  "bfloat16": {"comm_dtype": jnp.bfloat16},
  "int8": {"comm_dtype": jnp.int8},
  "int8 + error feedback": {"comm_dtype": jnp.int8, "error_feedback": True},
  "int4": {"comm_dtype": jnp.int4},
  "float8_e4m3fn": {"comm_dtype": jnp.float8_e4m3fn},
  "top-k 64/4096 + error feedback": {
    "comm_dtype": shardopt.topk(64),
    "error_feedback": True,
  },
}
QUICK_WIRES = ("float32", "int8 + error feedback")


def _adam() -> optax.GradientTransformation:
  return optax.adam(1e-3)


FLOORS = {
  "adam": _adam,
  "adam + accumulator add": workload.adam_and_accumulator_add,
}

# name -> (the transform, given a wire's keywords; its floor)
TRANSFORMS: dict[str, tuple[Callable[..., optax.GradientTransformation], str]]
TRANSFORMS = {
  "agn(adam, T=4)": (
    lambda **w: shardopt.agn(_adam(), AXIS, sync_period=4, **w),
    "adam + accumulator add",
  ),
  "local_sgd(adam, H=4)": (
    lambda **w: shardopt.local_sgd(_adam(), AXIS, sync_period=4, **w),
    "adam",
  ),
  "diloco(adam, H=4)": (
    lambda **w: shardopt.diloco(_adam(), AXIS, sync_period=4, **w),
    "adam",
  ),
  "streaming diloco(adam, H=8, F=4)": (
    lambda **w: shardopt.diloco(
      _adam(), AXIS, sync_period=8, num_fragments=4, **w
    ),
    "adam",
  ),
  "streaming diloco(adam, H=8, F=4, overlap tau=1, alpha=0.5)": (
    lambda **w: shardopt.diloco(
      _adam(),
      AXIS,
      sync_period=8,
      num_fragments=4,
      overlap_steps=1,
      overlap_alpha=0.5,
      **w,
    ),
    "adam",
  ),
  "hierarchical_local_sgd(adam, {2: 2, 4: 8})": (
    lambda **w: shardopt.hierarchical_local_sgd(
      _adam(), AXIS, period_group_sizes={2: 2, 4: 8}, **w
    ),
    "adam",
  ),
}


class Compiler:
  """The MLP, its per-replica params and batch on an 8-device mesh, and
  :meth:`program`, which compiles one step and reads it."""

  def __init__(self, sizes: Sequence[int]):
    self.n = jax.device_count()
    self.mesh = jax.make_mesh((self.n,), (AXIS,))
    self.sizes = tuple(sizes)
    self.stacked = workload.replicate(
      workload.mlp_init(jax.random.key(0), sizes), self.n
    )
    self.params = workload.on_mesh(self.stacked, self.mesh)
    self.batch = workload.on_mesh(
      workload.batch(
        jax.random.key(1), self.n, PER_REPLICA, sizes[0], sizes[-1]
      ),
      self.mesh,
    )

  def state(self, tx) -> Any:
    """``tx``'s state in :func:`workload.on_mesh`'s layout, as shapes only
    (the step is compiled, never run)."""

    def placed(a):
      # (n, d0, ...) -> (n * d0, ...); one scalar per replica -> a scalar
      shape = (
        () if len(a.shape) == 1 else (a.shape[0] * a.shape[1],) + a.shape[2:]
      )
      spec = P(AXIS) if shape else P()
      sharding = NamedSharding(self.mesh, spec)
      return jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding)

    shapes = jax.eval_shape(jax.pmap(tx.init, axis_name=AXIS), self.stacked)
    return jax.tree.map(placed, shapes)

  def program(self, tx, state, sync: int | None = None) -> dict:
    """``bytes_accessed``, ``conditionals``, ``collectives`` and
    ``copied_bytes`` of ``tx``'s donated step (``sync=`` if given);
    ``state``: :meth:`state`'s."""
    specs = jax.tree.map(lambda a: a.sharding.spec, state)
    step = workload.concat_shard_map_step(
      tx, self.mesh, specs, donate=True, sync=sync
    )
    compiled = step.lower(self.params, state, *self.batch).compile()
    return read(compiled, self.n)


def read(compiled, num_devices: int) -> dict:
  """What :class:`Compiler` reports of one compiled program."""
  text = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  copies = hlo.copied_bytes(text)
  return {
    "bytes_accessed": float(cost["bytes accessed"]),
    "conditionals": sum(
      op == "conditional" for op, _ in hlo.instructions(text)
    ),
    "collectives": len(hlo.compiled_collectives(text, num_devices=num_devices)),
    "copied_bytes": copies["top"] + sum(copies["conditional"].values()),
    "copied_bytes_in_branches": copies["conditional"],
  }


def _refusal(exc: BaseException) -> str:
  return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"


def run(quick: bool, argv: Sequence[str] | None = None) -> dict:
  """Every transform x wire, its four programs read; the results file."""
  start = time.perf_counter()
  result = _report.provenance(PROG, argv)
  sizes = QUICK_MLP if quick else MLP
  compiler = Compiler(sizes)
  floors = {}
  for name, make in FLOORS.items():
    tx = make()
    floors[name] = compiler.program(tx, compiler.state(tx))
  rows = []
  for name, (make, floor) in TRANSFORMS.items():
    for wire in QUICK_WIRES if quick else WIRES:
      row = {"transform": name, "wire": wire, "floor": floor}
      try:
        tx = make(**WIRES[wire])
      except (TypeError, ValueError) as exc:  # the transform refuses it
        rows.append({**row, "refused": _refusal(exc)})
        continue
      state = compiler.state(tx)
      for program, sync in zip(PROGRAMS, (None, 0, 1), strict=True):
        read_ = compiler.program(tx, state, sync)
        read_["ratio_to_floor"] = (
          read_["bytes_accessed"] / floors[floor]["bytes_accessed"]
        )
        row[program] = read_
      rows.append(row)
      print(f"[step_bytes] {name}, {wire}", flush=True)
  result.update(
    title="Bytes a compiled step accesses: host-scheduled vs in-graph",
    quick=quick,
    mlp=list(sizes),
    params=workload.count_params(workload.mlp_init(jax.random.key(0), sizes)),
    replicas=compiler.n,
    per_replica_batch=PER_REPLICA,
    floors=floors,
    rows=rows,
    seconds=time.perf_counter() - start,
    notes="bytes_accessed: XLA's cost_analysis() of the compiled, donated"
    " jit + shard_map(check_vma=False) step (all replicas' blocks, gradient"
    " included); ratio_to_floor: over the plain optax.adam step (agn: adam +"
    " a hand-written accumulator add); conditionals and collectives: counts"
    " in the compiled HLO, branches included; copied_bytes: bytes of copy"
    " instructions, entry computation and every branch together"
    " (copied_bytes_in_branches: per branch, a sync's branch runs only on"
    " its steps).",
  )
  return result


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"MLP {list(QUICK_MLP)} and the wires {', '.join(QUICK_WIRES)};"
    " writes benchmarks/results/quick/",
  )
  args = parser.parse_args(argv)
  result = run(args.quick, argv)
  print(step_bytes_blocks.step_bytes_table(result))
  path = _report.write_json(FILENAME, result, quick=args.quick)
  print(f"[step_bytes] {result['seconds']:.0f} s; wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
