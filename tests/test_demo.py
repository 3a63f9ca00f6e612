"""`python -m examples.demo` trains, counts communication honestly, plots."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from examples import demo
from shardopt.measure import traffic

STEPS = 32
PERIOD = 8
N = 8
# The demo's MLP: 64 -> 64 -> 10, float32.
PARAM_BYTES = 4 * (64 * 64 + 64 + 64 * 10 + 10)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo_out")
  results = demo.main(
    [
      "--steps",
      str(STEPS),
      "--devices",
      "8",
      "--method",
      "all",
      "--sync-period",
      str(PERIOD),
      "--out",
      str(out),
      "--json",
      str(out / "demo.json"),
    ]
  )
  return out, results


def test_demo_writes_the_frontier_png(demo_run):
  out, _ = demo_run
  png = out / "frontier.png"
  assert png.exists()
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_table_lists_the_four_methods_with_accuracy_above_chance(
  demo_run,
):
  out, results = demo_run
  table = (out / "results.md").read_text()
  for method in demo.METHODS:
    assert f"| {method}" in table
  assert [r.method for r in results] == list(demo.METHODS)
  for r in results:
    # Ten balanced classes: chance is 10%. Even 32 steps get far above it.
    assert r.test_accuracy > 0.3, r
    assert f"{r.test_accuracy:.1%}" in table


def test_demo_json_holds_the_results_and_what_produced_them(demo_run):
  """``--json``: what ``python -m benchmarks.blocks`` renders the README's
  table from (benchmarks/results/demo.json)."""
  import datetime
  import json

  out, results = demo_run
  data = json.loads((out / "demo.json").read_text())
  assert data["command"].startswith("python -m examples.demo --steps 32 ")
  assert f"--json {out / 'demo.json'}" in data["command"]
  assert datetime.datetime.fromisoformat(data["measured_utc"]).tzinfo
  assert data["commit"] is None or len(data["commit"]) >= 7
  assert (data["devices"], data["steps"], data["sync_period"]) == (
    N,
    STEPS,
    PERIOD,
  )
  assert [m["method"] for m in data["methods"]] == [r.method for r in results]
  for m, r in zip(data["methods"], results, strict=True):
    assert m["test_accuracy"] == r.test_accuracy
    assert m["bytes_per_replica"] == r.bytes_per_replica


def test_demo_bytes_equal_the_ring_all_reduce_formula(demo_run):
  """sync all-reduces the float32 gradient every step: 2 (n-1)/n x params
  bytes per step; diloco the outer gradient (plus a 4-byte finite flag) once
  per period; powersgd far fewer."""
  _, results = demo_run
  by = {r.method: r for r in results}
  ring = 2 * (N - 1) / N
  assert by["sync"].bytes_per_replica == STEPS * ring * PARAM_BYTES
  per_sync = ring * (PARAM_BYTES + 4)
  assert by["diloco"].bytes_per_replica == pytest.approx(
    STEPS / PERIOD * per_sync, rel=1e-6
  )
  # Streaming DiLoCo: two fragments, each once per period, the outer
  # gradient in int4 (half a byte per element) plus a float32 scale per
  # block of 256 and the finite flags: between 1/8 and 1/6 of diloco's.
  int4 = STEPS / PERIOD * ring * (PARAM_BYTES / 8)
  assert int4 < by["streaming"].bytes_per_replica < 8 / 6 * int4
  assert by["powersgd"].bytes_per_replica < by["sync"].bytes_per_replica / 5


def test_demo_shared_params_are_bit_identical(demo_run):
  _, results = demo_run
  # sync / powersgd: every step; diloco: the center, replicated by the sync.
  assert [r.replica_divergence for r in results] == [0.0] * 4


def test_demo_loss_goes_down(demo_run):
  _, results = demo_run
  for r in results:
    assert r.losses.shape == (STEPS,)
    assert r.losses[-5:].mean() < r.losses[:5].mean(), r.method


def test_wire_bytes_count_a_cond_branch_once_per_period():
  """The demo's reader (shardopt.measure.traffic) on a hand-made step: one
  all-reduce at the top level and one inside a lax.cond branch, which runs
  once per 4 steps."""
  f = jax.pmap(
    lambda x, c: (
      jax.lax.psum(x, "i")
      + jax.lax.cond(c > 0, lambda: jax.lax.psum(2 * x, "i"), lambda: x)
    ),
    axis_name="i",
  )
  x = jax.numpy.ones((8, 256))
  measured = traffic(f, x, jax.numpy.ones(8), sync_period=4)
  ring = 2 * 7 / 8 * 1024
  assert measured.per_step == pytest.approx(ring + ring / 4)


def test_force_host_devices_respects_an_existing_count(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
  assert not demo.force_host_devices(8)
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
  assert demo.force_host_devices(8)
  assert os.environ["XLA_FLAGS"] == (
    "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=8"
  )


def test_asking_for_more_devices_than_exist_says_how_to_fix_it():
  with pytest.raises(RuntimeError, match="fresh process"):
    demo.select_devices(jax.device_count() + 1)


def test_bad_flags_are_rejected():
  with pytest.raises(SystemExit):
    demo.parse_args(["--method", "adam"])
  with pytest.raises(SystemExit):
    demo.parse_args(["--steps", "0"])


def test_command_line_forces_cpu_devices_in_a_fresh_process(tmp_path):
  """`python -m examples.demo` with no XLA_FLAGS gets the devices it asks for."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "examples.demo",
      "--steps",
      "3",
      "--devices",
      "4",
      "--method",
      "sync",
      "--out",
      str(tmp_path),
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=pathlib.Path(__file__).resolve().parents[1],
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "4 x cpu devices" in proc.stdout
  assert "| sync " in proc.stdout
  assert (tmp_path / "frontier.png").exists()


# --- Without the demo extra: a message naming it, no traceback. --------------

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_demo_needs_exactly_the_demo_extra_of_pyproject():
  """The modules the demo checks for are the `demo` extra users install."""
  tomllib = pytest.importorskip("tomllib")
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  declared = project["optional-dependencies"]["demo"]
  assert sorted(demo.DEMO_EXTRA.values()) == sorted(declared)


@pytest.mark.parametrize("module", ["sklearn", "matplotlib", "tqdm"])
def test_without_the_demo_extra_main_names_it_and_exits(monkeypatch, module):
  monkeypatch.setitem(sys.modules, module, None)  # `import module` fails
  with pytest.raises(SystemExit) as info:
    demo.main(["--steps", "1", "--method", "sync"])
  message = info.value.code
  assert isinstance(message, str), message  # a str exits with status 1
  assert 'pip install -e ".[demo]"' in message, message
  assert demo.DEMO_EXTRA[module] in message, message


def test_python_m_examples_demo_without_the_demo_extra_prints_it_in_a_fresh_process():
  """`python -m examples.demo` with scikit-learn missing: status 1, the extra
  on stderr, no traceback."""
  hide = (
    "import runpy, sys; sys.modules['sklearn'] = None;"
    " runpy.run_module('examples.demo', run_name='__main__', alter_sys=True)"
  )
  proc = subprocess.run(
    [sys.executable, "-c", hide, "--method", "sync"],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    check=False,
  )
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  assert 'pip install -e ".[demo]"' in proc.stderr, proc.stderr
  assert "scikit-learn" in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr


def test_python_m_shardopt_says_where_the_demo_is():
  """The package holds no demo: `python -m shardopt` names `make demo` and
  exits with status 1."""
  proc = subprocess.run(
    [sys.executable, "-m", "shardopt"],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    check=False,
  )
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  assert "make demo" in proc.stderr and "examples.demo" in proc.stderr
