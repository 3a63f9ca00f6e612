"""Runs examples/elastic_diloco.py as N islands on this machine, killing and
restarting islands on a schedule; prints each island's rounds.

    python examples/elastic_launch.py --num-processes 3 --steps 48 \
        --sync-period 4 --step-seconds 0.2 --kill 2@4 --restart 2@14 --out /tmp/elastic

``--kill I@T`` SIGKILLs process I T seconds after the start, ``--restart I@T``
starts it again (same ``--process-id``); with ``--processes-per-island K``
an island is K consecutive processes. The tests and the elastic benchmark
drive the same :class:`Islands`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "elastic_diloco.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Islands:
  """N processes of the example on localhost; every child runs in its own
  process group and is SIGKILLed and reaped on :meth:`close`."""

  def __init__(
    self,
    out,
    *,
    num_processes: int,
    steps: int,
    sync_period: int,
    step_seconds: float = 0.0,
    processes_per_island: int = 1,
    env: dict | None = None,
    extra: tuple = (),
  ):
    self.out = Path(out)
    self.out.mkdir(parents=True, exist_ok=True)
    self.port = free_port()
    self.n = num_processes
    self.argv = [
      "--coordinator",
      f"127.0.0.1:{self.port}",
      "--num-processes",
      str(num_processes),
      "--steps",
      str(steps),
      "--sync-period",
      str(sync_period),
      "--out",
      str(self.out),
      "--step-seconds",
      str(step_seconds),
      "--processes-per-island",
      str(processes_per_island),
      *extra,
    ]
    self.env = dict(os.environ)
    self.env.pop("XLA_FLAGS", None)  # the example sets its own
    self.env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(SRC), self.env.get("PYTHONPATH")) if p
    )
    self.env.update(env or {})
    self.procs: dict[int, subprocess.Popen] = {}
    self.starts: dict[int, int] = {}
    self.kills: list[tuple[int, float]] = []  # (island, time.time())
    self.t0 = time.time()

  def start(self, i: int) -> None:
    n = self.starts.get(i, 0)
    self.starts[i] = n + 1
    log = open(self.out / f"out{i}.{n}.log", "w")
    self.procs[i] = subprocess.Popen(
      [sys.executable, "-u", str(EXAMPLE), "--process-id", str(i), *self.argv],
      stdout=log,
      stderr=subprocess.STDOUT,
      env=self.env,
      start_new_session=True,
    )
    log.close()

  def start_all(self) -> None:
    for i in range(self.n):
      self.start(i)

  def kill(self, i: int) -> None:
    proc = self.procs[i]
    self.kills.append((i, time.time()))
    _kill_group(proc)

  def wait(self, timeout_s: float) -> dict[int, int | None]:
    """Exit codes (None: still running after ``timeout_s``)."""
    deadline = time.time() + timeout_s
    codes = {}
    for i, proc in self.procs.items():
      try:
        codes[i] = proc.wait(timeout=max(deadline - time.time(), 0.1))
      except subprocess.TimeoutExpired:
        codes[i] = None
    return codes

  def rows(self, i: int) -> list[dict]:
    path = self.out / f"p{i}.jsonl"
    if not path.exists():
      return []
    return [json.loads(line) for line in path.read_text().splitlines()]

  def log(self, i: int) -> str:
    return "".join(
      (self.out / f"out{i}.{n}.log").read_text()
      for n in range(self.starts.get(i, 0))
    )

  def wait_for_step(self, i: int, step: int, timeout_s: float) -> bool:
    """Waits until island ``i`` has logged a round at ``step`` or later."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
      if any(r["step"] >= step for r in self.rows(i)):
        return True
      time.sleep(0.05)
    return False

  def close(self) -> None:
    for proc in self.procs.values():
      _kill_group(proc)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _kill_group(proc: subprocess.Popen) -> None:
  if proc.returncode is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait(timeout=30)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--num-processes", type=int, default=3)
  ap.add_argument("--steps", type=int, default=48)
  ap.add_argument("--sync-period", type=int, default=4)
  ap.add_argument(
    "--step-seconds",
    default="0.2",
    help="one value, or one per process id, comma-separated",
  )
  ap.add_argument("--processes-per-island", type=int, default=1)
  ap.add_argument("--kill", action="append", default=[], help="I@SECONDS")
  ap.add_argument("--restart", action="append", default=[], help="I@SECONDS")
  ap.add_argument("--out", default="/tmp/elastic")
  ap.add_argument("--timeout", type=float, default=300)
  ap.add_argument(
    "--chaos",
    type=int,
    metavar="SEED",
    default=None,
    help=(
      "kill random islands at random moments (under a dedicated"
      " coordinator) for --duration seconds: examples/elastic_chaos.py"
    ),
  )
  ap.add_argument("--duration", type=float, default=60.0)
  ap.add_argument(
    "--kills", type=int, default=None, help="--chaos: stop after N kills"
  )
  ap.epilog = (
    "Any other option (e.g. --comm-dtype topk:64 --error-feedback) goes to"
    " examples/elastic_diloco.py as it is."
  )
  args, extra = ap.parse_known_args()
  if args.chaos is not None:
    return _chaos(args, extra)
  plan = sorted(
    [(float(t), "kill", int(i)) for i, t in (k.split("@") for k in args.kill)]
    + [
      (float(t), "restart", int(i))
      for i, t in (k.split("@") for k in args.restart)
    ]
  )
  with Islands(
    args.out,
    num_processes=args.num_processes,
    steps=args.steps,
    sync_period=args.sync_period,
    step_seconds=args.step_seconds,
    processes_per_island=args.processes_per_island,
    extra=tuple(extra),
  ) as islands:
    islands.start_all()
    for at, what, i in plan:
      time.sleep(max(0.0, islands.t0 + at - time.time()))
      print(f"+{time.time() - islands.t0:.1f}s {what} island {i}", flush=True)
      islands.kill(i) if what == "kill" else islands.start(i)
    codes = islands.wait(args.timeout)
    for i in range(args.num_processes):
      print(f"island {i}: exit {codes.get(i)}")
      for row in islands.rows(i):
        print(
          f"  round {row['round']:3d} step {row['step']:4d} live"
          f" {row['live']} loss {row['loss']:.5f}"
          f" {row['params_sha256'][:12]}"
        )


def _chaos(args, extra) -> None:
  import elastic_chaos  # noqa: PLC0415 (beside this file)

  if args.kill or args.restart:
    raise SystemExit("--chaos chooses its own kills: drop --kill/--restart")
  if "--dedicated-coordinator" not in extra:
    extra = [*extra, "--dedicated-coordinator"]
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  env = elastic_chaos.environment(out)
  with Islands(
    out,
    num_processes=args.num_processes,
    steps=10**6,  # the islands stop when the chaos ends (the stop file)
    sync_period=args.sync_period,
    step_seconds=args.step_seconds,
    processes_per_island=args.processes_per_island,
    env=env,
    extra=tuple(extra),
  ) as islands:
    result = elastic_chaos.run(
      islands,
      seed=args.chaos,
      duration_s=args.duration,
      timeout_s=args.timeout,
      max_kills=args.kills,
    )
  result.update(seed=args.chaos, duration_s=args.duration)
  (out / "chaos.json").write_text(json.dumps(result, indent=1))
  print(elastic_chaos.show(result))


if __name__ == "__main__":
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  main()
