"""Times the fast test tier and records the result.

``python tests/fast_tier.py`` (from the repository root; ``make
test-fast-timing``) runs the tier exactly as ``make test-fast`` does: its
recipe is read from the Makefile, with ``$(PY)`` the Python running this
script, and ``$SHARDOPT_TIMING_FAST_TIER`` set so that the checks of
tests/test_fast_tier.py skip (they check the record this run replaces).
When no test fails it writes ``tests/fast_tier.json``: the tests it ran
(collected, less the slow tier's) and passed, the wall seconds, the date
(ISO, UTC), the git commit, the CPU count and the 1-minute load average at
the start; and it rewrites README.md's block between ``<!-- fast-tier:start
-->`` and ``<!-- fast-tier:end -->`` from it. A failing run writes nothing
and exits 1.

``python tests/fast_tier.py --render`` only rewrites the README block from
the JSON. tests/test_fast_tier.py checks that the block is what the JSON
renders, that the JSON counts as many tests as the tier collects now, and
that it took at most :data:`BUDGET_S` seconds: time the tier on a quiet
machine after changing what it holds (tests/conftest.py tiers the tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "fast_tier.json"
README = ROOT / "README.md"
START = "<!-- fast-tier:start -->"
END = "<!-- fast-tier:end -->"
# What the tier may take on the 2-core development machine, otherwise quiet.
BUDGET_S = 180.0
# pytest's outcomes that are tests the tier ran.
_RAN = ("passed", "failed", "skipped", "xfailed", "xpassed")
# Set in the timed run: tests/test_fast_tier.py's checks of the record skip
# there (they would check the record this run replaces).
TIMING = "SHARDOPT_TIMING_FAST_TIER"


def command(python: str = sys.executable) -> list:
  """``make test-fast``'s command, from the Makefile, run by ``python``."""
  text = (ROOT / "Makefile").read_text()
  match = re.search(r"^test-fast:[^\n]*\n\t([^\n]+)", text, re.M)
  if not match:
    raise SystemExit("tests/fast_tier.py: the Makefile has no test-fast recipe")
  return [python if word == "$(PY)" else word for word in shlex.split(match[1])]


def outcomes(output: str) -> dict:
  """The counts of pytest's last summary line, ``{"passed": 1034, ...}``."""
  lines = [
    line for line in output.splitlines() if re.search(r" in [\d.]+s\b", line)
  ]
  if not lines:
    return {}
  found = re.findall(r"(\d+) (\w+)", lines[-1])
  counts = {}
  for number, word in found:
    word = {"error": "errors", "warning": "warnings"}.get(word, word)
    counts[word] = counts.get(word, 0) + int(number)
  return counts


def collected_now(python: str = sys.executable) -> int:
  """How many tests ``make test-fast`` would run now: ``pytest
  --collect-only -m "not slow"``, in a fresh process."""
  result = subprocess.run(
    [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    + ["-m", "not slow", "tests"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  match = re.search(
    r"^(\d+)(?:/\d+)? tests? collected", result.stdout, re.M
  ) or re.search(r"^no tests collected", result.stdout, re.M)
  if result.returncode != 0 or not match:
    raise RuntimeError(
      f"pytest --collect-only failed ({result.returncode}):\n"
      + result.stdout[-3000:]
      + result.stderr[-3000:]
    )
  return int(match[1]) if match.groups() else 0


def _git(*args: str) -> str:
  return subprocess.run(
    ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.strip()


def render(record: dict) -> str:
  """The README block (markers included) for a record."""
  when = datetime.datetime.fromisoformat(record["date_utc"])
  commit = record["commit"][:7] + (
    " plus uncommitted changes" if record["dirty"] else ""
  )
  return (
    f"{START}\n"
    f"`make test-fast` ran {record['tests']:,} tests ({record['passed']:,}"
    f" passed) in {record['seconds']:.0f} s on {record['cpus']} CPUs, the"
    f" 1-minute load average {record['load_1m']:.2f} at the start"
    f" ({when:%Y-%m-%d %H:%M} UTC, commit {commit}; written by `python"
    " tests/fast_tier.py` to tests/fast_tier.json).\n"
    f"{END}"
  )


def readme_block(text: str) -> str:
  """The block of README.md's ``text``, markers included."""
  start, end = text.find(START), text.find(END)
  if start < 0 or end < start:
    raise ValueError(f"README.md has no {START} ... {END} block")
  return text[start : end + len(END)]


def write_readme(record: dict) -> None:
  text = README.read_text()
  README.write_text(text.replace(readme_block(text), render(record)))


def time_tier() -> dict | None:
  """Runs the tier as ``make test-fast`` does, its output shown as it
  comes; the record, or None when a test failed."""
  argv = command()
  print("tests/fast_tier.py:", shlex.join(argv), flush=True)
  load = os.getloadavg()[0]
  date = datetime.datetime.now(datetime.timezone.utc)
  commit = _git("rev-parse", "HEAD")
  dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
  start = time.monotonic()
  process = subprocess.Popen(
    argv,
    cwd=ROOT,
    env={**os.environ, TIMING: "1"},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  output = []
  for line in process.stdout:
    sys.stdout.write(line)
    output.append(line)
  status = process.wait()
  seconds = time.monotonic() - start
  counts = outcomes("".join(output))
  if status != 0 or counts.get("failed") or counts.get("errors"):
    print(f"tests/fast_tier.py: pytest exited {status}; wrote nothing.")
    return None
  return {
    "command": shlex.join(["make", "test-fast"]),
    "argv": argv[1:],
    "tests": sum(counts.get(k, 0) for k in _RAN),
    "passed": counts.get("passed", 0),
    "skipped": counts.get("skipped", 0),
    "seconds": round(seconds, 1),
    "date_utc": date.isoformat(timespec="seconds"),
    "commit": commit,
    "dirty": dirty,
    "cpus": os.cpu_count(),
    "load_1m": round(load, 2),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python tests/fast_tier.py", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument(
    "--render",
    action="store_true",
    help="only rewrite README.md's block from tests/fast_tier.json",
  )
  args = parser.parse_args(argv)
  if args.render:
    record = json.loads(RECORD.read_text())
  else:
    record = time_tier()
    if record is None:
      return 1
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
  write_readme(record)
  print(render(record))
  if record["seconds"] > BUDGET_S:
    print(
      f"tests/fast_tier.py: {record['seconds']:.0f} s is over the"
      f" {BUDGET_S:.0f} s budget (tests/test_fast_tier.py fails): move slow"
      " tests to the slow tier (tests/conftest.py), or time it on a quiet"
      " machine."
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
