"""shardopt on JAX's multi-controller runtime: 2 processes x 4 CPU devices.

Two child processes join a coordinator on 127.0.0.1 with
``jax.distributed.initialize`` (CPU collectives through gloo), build one
global 8-device mesh and train with ``cross_shard_mean``, ``tower(adam)`` and
``agn`` (``tests/_workers/multiprocess_worker.py``). The params they reach must
equal the same run in this process over 8 local devices, to float32 rounding.
Run with ``pytest -s`` to see the figures.
"""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _workers import children
from _workers import tiny_training

WORKER = Path(__file__).parent / "_workers" / "multiprocess_worker.py"
NUM_PROCESSES = 2
STEPS = 8  # two agn syncs (communication_period 4)
TIMEOUT_S = 150  # for both processes together, start to finish
SKIP_EXIT_CODE = 3


def _run_processes(out_dir: Path, steps: int):
  """Starts the workers, waits (bounded), always reaps them; returns logs."""
  port = children.free_port()
  procs, logs = [], []
  try:
    for i in range(NUM_PROCESSES):
      log = open(out_dir / f"process_{i}.log", "w+")
      logs.append(log)
      procs.append(
        subprocess.Popen(
          [
            sys.executable,
            str(WORKER),
            "--process-id",
            str(i),
            "--num-processes",
            str(NUM_PROCESSES),
            "--port",
            str(port),
            "--steps",
            str(steps),
            "--out",
            str(out_dir),
          ],
          stdout=log,
          stderr=subprocess.STDOUT,
          env=children.child_env(),
        )
      )
    deadline = time.monotonic() + TIMEOUT_S
    # Meanwhile, the reference: the same run over 8 devices in this process.
    reference = {
      name: tiny_training.train(name, tiny_training.make_mesh(), steps)
      for name in tiny_training.TRANSFORMS
    }
    for proc in procs:
      try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    codes = [proc.poll() for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait(timeout=30)
    texts = []
    for log in logs:
      log.seek(0)
      texts.append(log.read())
      log.close()
  return codes, texts, reference


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_process_of_eight(tmp_path):
  started = time.perf_counter()
  codes, texts, reference = _run_processes(tmp_path, STEPS)
  report = "\n".join(
    f"--- process {i} (exit {c}) ---\n{t[-3000:]}"
    for i, (c, t) in enumerate(zip(codes, texts))
  )
  if SKIP_EXIT_CODE in codes:
    reason = next(
      line for t in texts for line in t.splitlines() if line.startswith("SKIP:")
    )
    pytest.skip(reason)
  assert None not in codes, f"timed out after {TIMEOUT_S}s:\n{report}"
  assert codes == [0] * NUM_PROCESSES, report
  for i, text in enumerate(texts):
    assert f"process {i}/{NUM_PROCESSES}: 4 local devices of 8" in text, report

  got = np.load(tmp_path / "params.npz")
  figures = []
  for name, params in reference.items():
    for key, want in params.items():
      have = got[f"{name}/{key}"]
      assert (
        have.shape
        == want.shape
        == ((tiny_training.NUM_REPLICAS,) + want.shape[1:])
      )
      np.testing.assert_allclose(
        have, want, rtol=2e-6, atol=1e-7, err_msg=f"{name}: {key}"
      )
    diff = max(
      float(np.max(np.abs(got[f"{name}/{k}"] - v))) for k, v in params.items()
    )
    figures.append(f"{name}: max |2-process - 1-process| = {diff:.3g}")
  print(
    f"\n[multiprocess] {NUM_PROCESSES} processes x 4 CPU devices (gloo),"
    f" {STEPS} steps per transform, wall {time.perf_counter() - started:.1f}s;"
    f" " + "; ".join(figures)
  )
