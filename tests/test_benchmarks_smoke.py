"""The benchmark suite runs end to end (``--quick``), and its yardsticks are right.

Benchmarks are scripts, not tests: CI only checks that ``python -m
benchmarks.run --quick`` finishes, writes its JSON, Markdown and plots with
every section (the performance sections and the quality studies), that the
two pieces of arithmetic the report rests on (the HLO byte count and the
ring all-reduce formula) agree with hand computation, and that the two
packages import without a cycle, the studies never importing the
performance side.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PERF = (
  "overhead",
  "groups",
  "communication",
  "memory",
  "projection",
  "powersgd",
  "cost",
)
STUDIES = ("convergence", "schedule_convergence", "quality_per_byte")
SECTIONS = PERF + STUDIES


def test_hlo_reader_counts_bytes_and_finds_collectives_inside_cond():
  from shardopt.measure import hlo

  def step(count, x):
    x = jax.lax.psum(x, "i")  # every step: 8 x 256 float32 = 8192 bytes
    return jax.lax.cond(
      count % 4 == 0,
      lambda v: jax.lax.psum(v[0, :64], "i"),  # 256 bytes
      lambda v: v[0, :64],
      x,
    )

  f = jax.pmap(step, axis_name="i")
  text = f.lower(jnp.arange(8), jnp.ones((8, 8, 256))).compile().as_text()
  found = sorted(
    (op.kind, op.context, op.buffer_bytes)
    for op in hlo.compiled_collectives(text)
  )
  assert found == [
    ("all-reduce", "conditional", 64 * 4),
    ("all-reduce", "top", 8 * 256 * 4),
  ]


def test_hlo_reader_counts_reduce_scatter_and_bf16_wire_bytes(mesh):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from shardopt.measure import hlo

  def f(x):  # per device: 1000 elements, bf16 on the wire = 2000 bytes
    y = jax.lax.psum_scatter(x.astype(jnp.bfloat16), "batch", tiled=True)
    return jax.lax.all_gather(y, "batch", tiled=True).astype(jnp.float32)

  g = jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
  )
  x = jax.device_put(jnp.ones(8000), NamedSharding(mesh, P("batch")))
  lowered = hlo.summarize(hlo.lowered_collectives(g.lower(x).as_text()))
  assert lowered["buffer_bytes"]["lowered"] == {
    "reduce-scatter": 2000,
    "all-gather": 2000,
  }
  # Half of each full buffer: a reduce-scatter + all-gather = one all-reduce.
  assert lowered["allreduce_equivalent_bytes"]["lowered"] == 2000
  assert lowered["dtypes"] == ["bf16"]


def test_projection_uses_ring_allreduce_formula():
  from benchmarks.perf import projection

  # 2 (n - 1) / n * bytes / bandwidth: 2 * 7 / 8 * 4e9 / 12.5e9 = 0.56 s.
  assert projection.ring_allreduce_seconds(4e9, 12.5e9, 8) == pytest.approx(
    0.56
  )


def test_quick_run_writes_every_section(tmp_path):
  # This checkout's sources first (an installed shardopt may be another one).
  env = dict(
    os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)])
  )
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads((tmp_path / "latest.json").read_text())
  markdown = (tmp_path / "latest.md").read_text()
  assert results["quick"] is True
  assert results["machine"]["device_count"] == 8
  for name in SECTIONS:
    section = results["sections"][name]
    assert "error" not in section, section.get("error")
    assert section["table"]["rows"], name
    assert section["title"] in markdown
    for plot in section.get("plots", []):
      assert (tmp_path / plot).stat().st_size > 0
  assert len(list(tmp_path.glob("*.png"))) == len(SECTIONS)


def test_each_harness_runs_its_own_sections():
  from benchmarks.perf import harness as perf
  from benchmarks.studies import harness as studies

  assert set(perf.SECTIONS) == set(PERF)
  assert set(studies.SECTIONS) == set(STUDIES)
  for package, names in (("perf", PERF), ("studies", STUDIES)):
    for name in names:
      assert (ROOT / "benchmarks" / package / f"{name}.py").exists(), name


def _benchmark_imports() -> dict:
  """Module name -> the benchmarks modules it imports (read with ast)."""
  graph = {}
  for path in (ROOT / "benchmarks").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        if node.module.split(".")[0] == "benchmarks":
          for alias in node.names:
            full = f"{node.module}.{alias.name}"
            as_file = ROOT / (full.replace(".", "/") + ".py")
            deps.add(full if as_file.exists() else node.module)
      elif isinstance(node, ast.Import):
        deps |= {a.name for a in node.names if a.name.startswith("benchmarks")}
    graph[name] = deps
  return graph


def test_benchmarks_import_without_a_cycle_studies_never_import_perf():
  graph = _benchmark_imports()
  assert "benchmarks.perf.workload" in graph  # the walk found the packages
  state, cycles = {}, []

  def visit(name, stack):
    state[name] = "open"
    for dep in sorted(graph[name] & graph.keys()):
      if state.get(dep) == "open":
        cycles.append(stack[stack.index(dep) :] + [dep])
      elif dep not in state:
        visit(dep, stack + [dep])
    state[name] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  assert not cycles
  upward = {
    (name, dep)
    for name, deps in graph.items()
    if name.startswith("benchmarks.studies")
    for dep in deps
    if dep.startswith("benchmarks.perf")
  }
  assert not upward


def test_bytes_per_mini_step_are_one_kth_of_cross_shard():
  from benchmarks.perf import accumulate_bytes

  rows = accumulate_bytes.bytes_per_mini_step(sizes=(1 << 14,), ks=(4,))
  for row in rows:
    print(f"\n[bench] {row}")
    assert (
      row["accumulate_bytes_per_mini_step"] * row["k"]
      == row["cross_shard_bytes_per_step"]
    )


def test_step_bytes_reads_the_host_local_step_as_the_floor():
  """benchmarks.perf.step_bytes's compiler: host sync=0 reads as plain
  adam (no conditional, no collective, its bytes accessed), the in-graph
  schedule with its conditional and more bytes."""
  import optax

  import shardopt
  from benchmarks.perf import step_bytes

  compiler = step_bytes.Compiler(step_bytes.QUICK_MLP)
  adam = optax.adam(1e-3)
  floor = compiler.program(adam, compiler.state(adam))
  tx = shardopt.local_sgd(optax.adam(1e-3), "batch", sync_period=4)
  state = compiler.state(tx)
  host = compiler.program(tx, state, sync=0)
  in_graph = compiler.program(tx, state)
  assert host["conditionals"] == 0 and host["collectives"] == 0, host
  assert host["bytes_accessed"] == pytest.approx(
    floor["bytes_accessed"], rel=0.01
  )
  assert in_graph["conditionals"] >= 1 and in_graph["collectives"] >= 1
  assert in_graph["bytes_accessed"] > 1.5 * floor["bytes_accessed"]
