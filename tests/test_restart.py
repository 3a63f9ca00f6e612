"""Restart without loss: SIGKILL a checkpointing run, restart it, lose nothing.

``tests/_workers/train_with_checkpoints.py`` trains ``cross_shard_mean``,
``tower(adam)`` and ``agn`` (communication_period 4) side by side on 8 CPU
devices and checkpoints params, optimizer state, step and data position with
orbax every 3 steps. The test kills it with SIGKILL at a random step, restarts
it, kills the resumed run again later, restarts it once more, and checks that
the final params are bit-identical to an uninterrupted run of the same code in
this process. Both kills leave ``agn`` in the middle of a communication
period, and the checkpoints it resumes from are mid-period too.
Run with ``pytest -s`` to see the figures.
"""

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from _workers import children
from _workers import tiny_training

WORKER = Path(__file__).parent / "_workers" / "train_with_checkpoints.py"
STEPS = 24
EVERY = 3  # checkpoint interval, coprime with agn's period
PERIOD = tiny_training.AGN_PERIOD
STEP_DELAY_S = 0.1  # a "slower model", so the kill lands mid-run
KILL_SLACK = 2  # steps the kill may land late on a busy machine
TIMEOUT_S = 120  # per launch


def _command(ckpt_dir: Path, out: Path) -> list:
  return [
    sys.executable,
    str(WORKER),
    "--ckpt-dir",
    str(ckpt_dir),
    "--steps",
    str(STEPS),
    "--every",
    str(EVERY),
    "--out",
    str(out),
    "--step-delay",
    str(STEP_DELAY_S),
  ]


def _last_checkpoint(step: int) -> int:
  return step - step % EVERY


def _kill_steps_that_stay_mid_period(low: int, high: int) -> list:
  """Steps S in [low, high] where S, and every checkpoint a restart could
  resume from, are in the middle of agn's communication period.

  The kill may land up to KILL_SLACK steps after S. Checkpoints are written
  asynchronously and orbax starts a save only once the previous one is
  complete, so at the kill at most the newest checkpoint is unfinished, and
  the restart resumes from it or from the one before it.
  """

  def safe(s):
    resumes = {
      _last_checkpoint(t) for t in range(s - EVERY, s + KILL_SLACK + 1)
    }
    return s % PERIOD != 0 and all(r > 0 and r % PERIOD != 0 for r in resumes)

  return [s for s in range(low, high + 1) if safe(s)]


def _launch(ckpt_dir, out, kill_at=None):
  """Runs the worker; SIGKILLs it once it prints ``step kill_at``.

  Returns (exit code, stdout lines). The child is always reaped.
  """
  proc = subprocess.Popen(
    _command(ckpt_dir, out),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=children.child_env(),
  )
  lines = queue.Queue()

  def pump():
    for line in proc.stdout:
      lines.put(line.rstrip("\n"))
    lines.put(None)

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  seen = []
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while True:
      try:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
      except queue.Empty:
        raise AssertionError(
          f"worker timed out after {TIMEOUT_S}s:\n" + "\n".join(seen[-40:])
        ) from None
      if line is None:
        break
      seen.append(line)
      if kill_at is not None and line == f"step {kill_at}":
        os.kill(proc.pid, signal.SIGKILL)
    code = proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=30)
    reader.join(timeout=30)
  return code, seen


def _restored_step(lines) -> int:
  found = [
    re.fullmatch(r"restored step (\d+) data position \[(\d+), (\d+)\]", line)
    for line in lines
  ]
  found = [m for m in found if m]
  assert len(found) == 1, "\n".join(lines[-40:])
  step, epoch, index = map(int, found[0].groups())
  # The data position was restored with the step, not recomputed from it.
  batches_per_epoch = tiny_training.EXAMPLES // tiny_training.BATCH
  assert (epoch, index) == divmod(step, batches_per_epoch)
  return step


@pytest.mark.slow
def test_sigkill_at_random_steps_then_restart_is_bit_identical(tmp_path):
  started = time.perf_counter()
  rng = random.SystemRandom()
  ckpt_dir, out = tmp_path / "checkpoints", tmp_path / "final.npz"
  kills, resumes, left_on_disk = [], [], []

  # First kill, early in the run; second kill, in the resumed run, later on.
  for low, high in ((EVERY, STEPS // 2 - 1), (STEPS // 2 + 2, STEPS - 2)):
    kill_at = rng.choice(_kill_steps_that_stay_mid_period(low, high))
    code, lines = _launch(ckpt_dir, out, kill_at=kill_at)
    log = "\n".join(lines[-40:])
    assert code == -signal.SIGKILL, f"not killed (exit {code}):\n{log}"
    assert not out.exists(), "the killed run must not have finished"
    assert f"step {kill_at}" in lines, log
    if kills:
      resumes.append(_restored_step(lines))
    kills.append(kill_at)
    left_on_disk.append(sorted(os.listdir(ckpt_dir)))
    assert kill_at % PERIOD != 0  # agn is killed in the middle of a period

  code, lines = _launch(ckpt_dir, out)
  log = "\n".join(lines[-40:])
  assert code == 0, log
  assert "done" in lines, log
  resumes.append(_restored_step(lines))
  for kill_at, resumed in zip(kills, resumes):
    assert kill_at - 2 * EVERY < resumed <= kill_at + KILL_SLACK, (
      kills,
      resumes,
    )
    assert resumed % PERIOD != 0, (kills, resumes)  # restored mid-period
  assert resumes[1] > resumes[0], (kills, resumes)

  got = np.load(out)
  mesh = tiny_training.make_mesh()
  for name in tiny_training.TRANSFORMS:
    want = tiny_training.train(name, mesh, STEPS)
    for key, value in want.items():
      np.testing.assert_array_equal(
        got[f"{name}/{key}"], value, err_msg=f"{name}: {key}"
      )
  print(
    f"\n[restart] {len(kills)} SIGKILLs at steps {kills} of {STEPS}"
    f" (agn communication_period {PERIOD}, checkpoint every {EVERY});"
    f" checkpoint dir after each kill: {left_on_disk};"
    f" resumed from steps {resumes}; final params of"
    f" {', '.join(tiny_training.TRANSFORMS)} bit-identical to the"
    f" uninterrupted run (max |diff| = 0.0); 3 launches,"
    f" wall {time.perf_counter() - started:.1f}s"
  )
