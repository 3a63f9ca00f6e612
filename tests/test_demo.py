"""`python -m shardopt.demo` trains, counts communication honestly, plots."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from shardopt import demo

STEPS = 20
PERIOD = 10


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
      "--out",
      str(out),
    ]
  )
  return out, results


def test_demo_writes_loss_curve_png(demo_run):
  out, _ = demo_run
  png = out / "loss_curves.png"
  assert png.exists()
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_table_lists_the_three_methods_with_accuracy_above_chance(
  demo_run,
):
  out, results = demo_run
  table = (out / "results.md").read_text()
  for method in ("cross_shard", "tower", "agn"):
    assert f"| {method}" in table
  assert [r.method for r in results] == ["cross_shard", "tower", "agn"]
  for r in results:
    # Ten balanced classes: chance is 10%. Even 20 steps get far above it.
    assert r.test_accuracy > 0.3, r
    assert f"{r.test_accuracy:.1%}" in table


def test_demo_counts_one_all_reduce_per_step_and_agn_one_per_period(demo_run):
  _, results = demo_run
  by_method = {r.method: r for r in results}
  assert by_method["cross_shard"].all_reduces == STEPS
  assert by_method["tower"].all_reduces == STEPS
  assert by_method["agn"].all_reduces == STEPS // PERIOD
  assert all(r.steps == STEPS for r in results)


def test_demo_replicas_end_bit_identical(demo_run):
  _, results = demo_run
  # cross_shard/tower every step; agn because STEPS is a multiple of PERIOD.
  assert [r.replica_divergence for r in results] == [0.0, 0.0, 0.0]


def test_demo_loss_goes_down(demo_run):
  _, results = demo_run
  for r in results:
    assert r.losses.shape == (STEPS,)
    assert r.losses[-5:].mean() < r.losses[:5].mean(), r.method


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
  """`python -m shardopt.demo` with no XLA_FLAGS gets the devices it asks for."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "shardopt.demo",
      "--steps",
      "3",
      "--devices",
      "4",
      "--method",
      "cross_shard",
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
  assert "| cross_shard |" in proc.stdout
  assert (tmp_path / "loss_curves.png").exists()
