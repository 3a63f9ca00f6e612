"""Runs examples/elastic_diloco.py as N islands on this machine, killing and
restarting islands on a schedule; prints one line per committed round.

    python examples/elastic_launch.py --num-processes 3 --steps 60 \
        --sync-period 4 --step-seconds 0.2 --kill 2@r4 --restart 2@r8 --out /tmp/elastic

``--kill I@rR`` SIGKILLs process I once round R has committed (any island
logged it), ``--restart I@rR`` starts it again (same ``--process-id``) once
round R has committed; ``--kill I@T`` and ``--restart I@T`` do it T seconds
after the start instead. With ``--processes-per-island K`` an island is K
consecutive processes. Each process's output goes to ``OUT/out{I}.{n}.log``
(its n-th start); the launcher prints each committed round as the islands
log it (``OUT/p{I}.jsonl``), the kills and restarts, and the exit codes. It
exits 0 if every process exited 0 or was killed by it on purpose, and 1
otherwise (a process that aborted, exited non-zero, or was still running
after ``--timeout`` seconds), printing the end of that process's log. The
tests and the elastic benchmark drive the same :class:`Islands`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    # Every start: (process, n, Popen); the Popens killed on purpose.
    self.incarnations: list[tuple[int, int, subprocess.Popen]] = []
    self.killed: set[int] = set()  # their pids
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
    self.incarnations.append((i, n, self.procs[i]))

  def start_all(self) -> None:
    for i in range(self.n):
      self.start(i)

  def kill(self, i: int) -> None:
    proc = self.procs[i]
    self.kills.append((i, time.time()))
    if proc.poll() is None:
      self.killed.add(proc.pid)
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
    """Process ``i``'s rows (``p{i}.jsonl``), one per round it logged."""
    return _jsonl(self.out / f"p{i}.jsonl")

  def committed(self) -> int:
    """The last round any process logged as committed (0: none yet)."""
    paths = [self.out / f"p{i}.jsonl" for i in range(self.n)]
    paths.append(self.out / "coordinator.jsonl")
    return max((r["round"] for p in paths for r in _jsonl(p)), default=0)

  def unexpected(self) -> list[tuple[int, int, int | None]]:
    """``(process, n, exit code)`` of every start that did not exit 0 and
    was not killed on purpose (:meth:`kill`); None: still running."""
    return [
      (i, n, proc.poll())
      for i, n, proc in self.incarnations
      if proc.poll() != 0 and proc.pid not in self.killed
    ]

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


def _jsonl(path: Path) -> list[dict]:
  """The complete lines of a JSON-lines file that may be being written."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    return []
  return [
    json.loads(line)
    for line in text.splitlines(keepends=True)
    if line.endswith("\n")
  ]


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
  ap.add_argument(
    "--kill",
    action="append",
    default=[],
    help="I@rR: SIGKILL process I once round R has committed; I@T: T s in",
  )
  ap.add_argument(
    "--restart",
    action="append",
    default=[],
    help="I@rR: start process I again once round R has committed; I@T",
  )
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
    [when(k, "kill") for k in args.kill]
    + [when(k, "restart") for k in args.restart],
    key=lambda e: (e[2] is None, e[2] or 0, e[3] or 0, e[1] == "restart"),
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
    code = run(islands, plan, args.timeout)
  raise SystemExit(code)


ROUND_FORM = re.compile(r"^(\d+)@r(\d+)$")
SECONDS_FORM = re.compile(r"^(\d+)@(\d+(?:\.\d*)?)$")


def when(text: str, what: str) -> tuple:
  """``--kill``/``--restart``'s ``I@rR`` (once round R has committed) or
  ``I@T`` (T seconds after the start): ``(process, what, seconds,
  round)``, one of the last two None.

  >>> when("2@r4", "kill"), when("2@8", "restart")
  ((2, 'kill', None, 4), (2, 'restart', 8.0, None))
  """
  if m := ROUND_FORM.match(text):
    return int(m.group(1)), what, None, int(m.group(2))
  if m := SECONDS_FORM.match(text):
    return int(m.group(1)), what, float(m.group(2)), None
  raise SystemExit(
    f"--{what} {text}: expected I@rR (process I, once round R has"
    f" committed, e.g. 2@r4) or I@T (T seconds after the start, e.g. 2@8)"
  )


def run(islands: Islands, plan: list, timeout_s: float, poll_s=0.1) -> int:
  """Carries out ``plan`` (:func:`when`'s events, in order: a round's or a
  second's event fires once it is reached; a restart only once its process
  has stopped), printing each committed round as it is logged, until every
  process has exited (or ``timeout_s``); then the exit codes. Returns the
  launcher's exit code: 0, or 1 if a process exited non-zero (or is still
  running) without being killed on purpose, or an event never fired."""
  plan, shown, resumed = list(plan), set(), set()
  deadline = islands.t0 + timeout_s

  def say(text: str) -> None:
    print(f"+{time.time() - islands.t0:6.1f}s {text}", flush=True)

  def show_rounds() -> None:
    for i in range(islands.n):
      for row in islands.rows(i):
        if row.get("resumed") and (i, row["round"]) not in resumed:
          resumed.add((i, row["round"]))
          say(f"process {i} resumed at round {row['round']} (no new round)")
        elif not row.get("resumed") and row["round"] not in shown:
          shown.add(row["round"])
          say(round_text(row))

  while time.time() < deadline:
    committed = islands.committed()
    show_rounds()  # after: every round an event below waits for is shown
    for event in list(plan):
      i, what, seconds, number = event
      if number is not None:
        reached = committed >= number
      else:
        reached = time.time() >= islands.t0 + seconds
      running = islands.procs[i].poll() is None
      if not reached or (what == "restart" and running):
        continue  # a restart waits for its process to have stopped
      plan.remove(event)
      after = f"round {number}" if number is not None else f"{seconds:g} s"
      if what == "kill" and not running:
        say(f"kill process {i} (after {after}): it had already exited")
        continue
      say(f"{what} process {i} (after {after})")
      islands.kill(i) if what == "kill" else islands.start(i)
    if all(p.poll() is not None for p in islands.procs.values()):
      if all(e[2] is None for e in plan):  # no start left to wait for
        break
    time.sleep(poll_s)
  show_rounds()
  code = 0
  for i, what, seconds, number in plan:
    after = f"round {number}" if number is not None else f"{seconds:g} s"
    say(
      f"never done: {what} process {i} after {after} (the job ended at"
      f" round {islands.committed()}, or --timeout)"
    )
    code = 1
  codes = []
  for i, n, proc in islands.incarnations:
    c = proc.poll()
    killed = proc.pid in islands.killed
    codes.append(
      f"p{i}"
      + (f" (start {n + 1})" if n else "")
      + ": "
      + ("killed" if killed else "running" if c is None else str(c))
    )
  say("exit codes: " + ", ".join(codes))
  for i, n, c in islands.unexpected():
    code = 1
    log = islands.out / f"out{i}.{n}.log"
    what = (
      f"was still running after --timeout {timeout_s:g} s"
      if c is None
      else f"aborted (signal {-c})"
      if c < 0
      else f"exited {c}"
    )
    say(f"process {i} (start {n + 1}) {what}; the end of {log}:")
    for line in quiet(log.read_text()).splitlines()[-8:]:
      print(f"    {line}")
  return code


def round_text(row: dict) -> str:
  """One committed round, from an island's row."""
  text = f"round {row['round']:3d} step {row['step']:4d} live {row['live']}"
  if row.get("joined"):
    text += f" healed {row['joined']}"
  if row.get("attempts"):
    kinds = sorted({why.split(":", 1)[0] for why in row.get("failures", [])})
    text += f" retried {row['attempts']}x ({', '.join(kinds)})"
  return text + f" loss {row['loss']:.5f} {row['params_sha256'][:12]}"


# Lines of a child's log that come from gloo or JAX's internals, not from
# the example: gloo's "[Gloo] Rank ... connected" (printed from C++ by every
# process that opens a communicator; several processes' lines interleave).
NOISE = re.compile(r"\[Gloo\]|is connected to \d+ peer ranks|peer ranks is :")


def quiet(text: str) -> str:
  """``text`` without gloo's connection lines (:data:`NOISE`)."""
  return "".join(
    line for line in text.splitlines(keepends=True) if not NOISE.search(line)
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
    unexpected = islands.unexpected()
  result.update(seed=args.chaos, duration_s=args.duration)
  (out / "chaos.json").write_text(json.dumps(result, indent=1))
  print(elastic_chaos.show(result))
  for i, n, c in unexpected:
    print(f"process {i} (start {n + 1}) exited {c}: see {out}/out{i}.{n}.log")
  raise SystemExit(1 if unexpected else 0)


if __name__ == "__main__":
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  main()
