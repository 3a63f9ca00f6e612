"""Faults across processes: SIGKILL one of two processes, then restart both.

Two processes of 4 CPU devices each (``jax.distributed`` on 127.0.0.1, CPU
collectives through gloo) train the transforms of
``tiny_training.FAULT_TRANSFORMS`` side by side on one global 8-device mesh and
checkpoint with orbax every few steps
(``tests/_workers/train_across_processes.py``). The test

1. runs them once uninterrupted: the reference params;
2. runs them again and SIGKILLs ONE process (drawn at random) at a random
   step; the survivor must not hang: it has to exit with a clear error within
   a bounded time (JAX's coordination service declares the dead process gone
   after ``HEARTBEAT_TIMEOUT_S``; a watchdog in the worker is the backstop);
3. restarts both processes, which resume from the last complete orbax
   checkpoint and finish the run; their final params must be bit-identical
   to the reference.

Every child is started in its own process group and, whatever happens, that
group is SIGKILLed and the child reaped before the test returns. Run with
``pytest -s`` to see the figures.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _workers import children
from _workers import tiny_training

WORKER = Path(__file__).parent / "_workers" / "train_across_processes.py"
NUM_PROCESSES = 2
STEPS = 16
EVERY = 3  # checkpoint interval
STEP_DELAY_S = 0.05  # a "slower model", so the kill lands mid-run
HEARTBEAT_TIMEOUT_S = (
  10  # jax.distributed.initialize(heartbeat_timeout_seconds=)
)
WATCHDOG_S = 60  # the worker exits if no step completes for this long
# The survivor must be gone this long after the kill: the watchdog's bound,
# plus slack for a loaded machine. The heartbeat usually ends it far sooner.
SURVIVOR_BOUND_S = WATCHDOG_S + 15
LAUNCH_TIMEOUT_S = 150  # for one launch of both processes
SKIP_EXIT_CODE = 3
# What a survivor may print when it stops: the coordination service's fatal
# error, an exception from a collective or barrier, or the watchdog.
CLEAR_ERRORS = (
  "Terminating process because the JAX distributed service detected fatal"
  " errors",
  "FAILED: ",
  "WATCHDOG: ",
)


def _reap(proc: subprocess.Popen) -> None:
  """SIGKILLs the child's process group and reaps the child.

  Only while the child is not yet reaped: until then (alive or a zombie) its
  pid, which is its group's id, cannot have been reused.
  """
  if proc.returncode is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait(timeout=30)


class _Launch:
  """Both processes of one run, with their logs; reaped on exit."""

  def __init__(
    self,
    tmp: Path,
    tag: str,
    ckpt_dir: Path,
    out: Path,
    watchdog_s: float = WATCHDOG_S,
    extra_args=None,
  ):
    self.port = children.free_port()
    self.logs = [tmp / f"{tag}_process_{i}.log" for i in range(NUM_PROCESSES)]
    self.procs = []
    try:
      for i in range(NUM_PROCESSES):
        with open(self.logs[i], "w") as log:
          self.procs.append(
            subprocess.Popen(
              [
                sys.executable,
                "-u",
                str(WORKER),
                "--process-id",
                str(i),
                "--num-processes",
                str(NUM_PROCESSES),
                "--port",
                str(self.port),
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
                "--heartbeat-timeout",
                str(HEARTBEAT_TIMEOUT_S),
                "--watchdog",
                str(watchdog_s),
              ]
              + list((extra_args or {}).get(i, [])),
              stdout=log,
              stderr=subprocess.STDOUT,
              env=children.child_env(),
              start_new_session=True,
            )
          )  # its own group: killpg reaches all
    except BaseException:
      self.close()
      raise

  def text(self, i: int) -> str:
    return self.logs[i].read_text(errors="replace")

  def report(self) -> str:
    return "\n".join(
      f"--- process {i} (exit {p.poll()}) ---\n{self.text(i)[-2500:]}"
      for i, p in enumerate(self.procs)
    )

  def skip_if_unsupported(self) -> None:
    if SKIP_EXIT_CODE in [p.poll() for p in self.procs]:
      reason = next(
        line
        for i in range(NUM_PROCESSES)
        for line in self.text(i).splitlines()
        if line.startswith("SKIP:")
      )
      pytest.skip(reason)

  def wait(self, timeout_s: float) -> list:
    """Exit codes after at most ``timeout_s`` (None: still running)."""
    deadline = time.monotonic() + timeout_s
    for proc in self.procs:
      try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    return [p.poll() for p in self.procs]

  def wait_for_line(self, i: int, line: str, timeout_s: float) -> bool:
    """True once process ``i`` printed ``line``; False if it ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if line in self.text(i).splitlines():
        return True
      if self.procs[i].poll() is not None:
        return line in self.text(i).splitlines()
      time.sleep(0.01)
    raise AssertionError(
      f"no {line!r} from process {i} within {timeout_s}s:\n" + self.report()
    )

  def close(self) -> None:
    for proc in self.procs:
      _reap(proc)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _run_to_the_end(tmp: Path, tag: str, ckpt_dir: Path, out: Path) -> str:
  with _Launch(tmp, tag, ckpt_dir, out) as launch:
    codes = launch.wait(LAUNCH_TIMEOUT_S)
    launch.skip_if_unsupported()
    assert codes == [0] * NUM_PROCESSES, (
      f"{tag}: exit codes {codes} (None: timed out after"
      f" {LAUNCH_TIMEOUT_S}s)\n{launch.report()}"
    )
    # Each process holds 4 contiguous replicas, so a group of 4 (the inner
    # level of hierarchical_local_sgd) lies within one process.
    for i in range(NUM_PROCESSES):
      assert f"process {i}: mesh positions {list(range(4 * i, 4 * i + 4))}" in (
        launch.text(i)
      ), launch.report()
    return launch.text(0)


def _restored_step(text: str):
  found = re.findall(
    r"restored step (\d+) data position \[(\d+), (\d+)\]", text
  )
  if not found:
    return None
  step, epoch, index = map(int, found[-1])
  batches_per_epoch = tiny_training.EXAMPLES // tiny_training.BATCH
  assert (epoch, index) == divmod(step, batches_per_epoch)  # restored, too
  return step


@pytest.mark.slow
def test_sigkill_one_of_two_processes_survivor_exits_restart_is_bit_identical(
  tmp_path,
):
  started = time.perf_counter()
  names, missing = tiny_training.available_fault_transforms()
  rng = random.SystemRandom()
  victim = rng.randrange(NUM_PROCESSES)
  survivor = 1 - victim
  # A kill after step 2*EVERY+1 leaves at least one complete checkpoint
  # (orbax starts a save only once the previous one is committed).
  kill_at = rng.randint(2 * EVERY + 1, STEPS - 2)

  # 1. The reference: the same two processes, never interrupted.
  reference_out = tmp_path / "reference.npz"
  _run_to_the_end(
    tmp_path, "reference", tmp_path / "reference_ckpt", reference_out
  )

  # 2. Kill one process at step kill_at; the survivor must stop by itself.
  ckpt_dir, out = tmp_path / "checkpoints", tmp_path / "final.npz"
  with _Launch(tmp_path, "killed", ckpt_dir, out) as launch:
    reached = launch.wait_for_line(victim, f"step {kill_at}", LAUNCH_TIMEOUT_S)
    launch.skip_if_unsupported()
    assert reached, f"process {victim} ended early:\n{launch.report()}"
    assert launch.procs[victim].poll() is None, launch.report()
    os.killpg(launch.procs[victim].pid, signal.SIGKILL)  # not reaped yet
    killed = time.monotonic()
    launch.procs[victim].wait(timeout=30)
    try:
      code = launch.procs[survivor].wait(timeout=SURVIVOR_BOUND_S)
    except subprocess.TimeoutExpired:
      raise AssertionError(
        f"process {survivor} still running {SURVIVOR_BOUND_S}s after"
        f" process {victim} was killed at step {kill_at}:\n"
        f"{launch.report()}"
      ) from None
    survivor_s = time.monotonic() - killed
    text = launch.text(survivor)
    assert code != 0, f"the survivor exited 0:\n{launch.report()}"
    assert not out.exists(), "a killed run must not finish"
    why = [e for e in CLEAR_ERRORS if e in text]
    assert why, f"no clear error from the survivor:\n{launch.report()}"
    survivor_step = max(
      map(int, re.findall(r"^step (\d+)$", text, re.M)), default=0
    )
  left_on_disk = sorted(os.listdir(ckpt_dir)) if ckpt_dir.exists() else []

  # 3. Restart both; they resume from the last complete checkpoint.
  text = _run_to_the_end(tmp_path, "restarted", ckpt_dir, out)
  resumed = _restored_step(text)
  assert resumed is not None and kill_at - 2 * EVERY <= resumed <= kill_at, (
    kill_at,
    resumed,
    text[-2500:],
  )

  got, want = np.load(out), np.load(reference_out)
  assert sorted(got.files) == sorted(want.files) and len(got.files) == 2 * len(
    names
  ), (got.files, names)
  for key in want.files:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  print(
    f"\n[process faults] {NUM_PROCESSES} processes x 4 CPU devices"
    f" (gloo), {STEPS} steps of {', '.join(names)}"
    f" (not in this shardopt, skipped: {missing or 'none'}); SIGKILL of"
    f" process {victim} at step {kill_at}: process {survivor} (at step"
    f" {survivor_step}) exited with code {code} after {survivor_s:.1f}s"
    f" ({why[0].strip()!r}; heartbeat timeout {HEARTBEAT_TIMEOUT_S}s,"
    f" watchdog {WATCHDOG_S}s); checkpoints on disk {left_on_disk};"
    f" restarted both from step {resumed}; final params bit-identical to"
    f" the uninterrupted 2-process run (max |diff| = 0.0); 3 launches,"
    f" wall {time.perf_counter() - started:.1f}s"
  )


HANG_WATCHDOG_S = 12


@pytest.mark.slow
def test_a_peer_that_hangs_alive_is_caught_by_the_watchdog(tmp_path):
  """The coordination service only sees processes die; the watchdog bounds
  the wait for a peer that stays alive but never enters the collective."""
  started = time.perf_counter()
  hang_at = random.SystemRandom().randint(2, STEPS - 2)
  hanging = random.SystemRandom().randrange(NUM_PROCESSES)
  with _Launch(
    tmp_path,
    "hang",
    tmp_path / "ckpt",
    tmp_path / "out.npz",
    watchdog_s=HANG_WATCHDOG_S,
    extra_args={hanging: ["--hang-at", str(hang_at)]},
  ) as launch:
    reached = launch.wait_for_line(hanging, f"step {hang_at}", LAUNCH_TIMEOUT_S)
    launch.skip_if_unsupported()
    assert reached, launch.report()
    hung = time.monotonic()
    codes = launch.wait(HANG_WATCHDOG_S + 30)
    waited = time.monotonic() - hung
    assert None not in codes, (
      f"still running {waited:.0f}s after process {hanging} hung:\n"
      + launch.report()
    )
    texts = [launch.text(i) for i in range(NUM_PROCESSES)]
    for i, (code, text) in enumerate(zip(codes, texts)):
      assert code != 0 and any(e in text for e in CLEAR_ERRORS), (
        i,
        code,
        launch.report(),
      )
    assert not (tmp_path / "out.npz").exists()
  clear_lines = [
    line
    for t in texts
    for line in t.splitlines()
    if line.startswith(CLEAR_ERRORS)
  ]
  print(
    f"\n[process faults] process {hanging} hung (alive) after step"
    f" {hang_at}: exit codes {codes} within {waited:.1f}s"
    f" ({'; '.join(clear_lines)[:400]});"
    f" watchdog {HANG_WATCHDOG_S}s; wall {time.perf_counter() - started:.1f}s"
  )
