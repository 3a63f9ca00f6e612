"""The report both harnesses write: machine, tables, notes, plots.

:func:`main` is what ``python -m benchmarks.run``, ``python -m
benchmarks.perf`` and ``python -m benchmarks.studies`` do with their
sections: run them, record the machine each ran on, merge them into
``benchmarks/results/latest.json``, write ``latest.md`` (every section in
:data:`ORDER`, the report's numbering) and one PNG per section, and (a full
run into ``benchmarks/results/``) rewrite the results block of
``benchmarks/README.md``. A section is a module with ``run(quick) -> dict``
(title, table, notes, data) and optionally ``plot(section, directory)``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType

from benchmarks import RESULTS

# The report's order: sections 1-9 as numbered in their titles.
ORDER = (
  "overhead",
  "groups",
  "communication",
  "memory",
  "convergence",
  "schedule_convergence",
  "projection",
  "powersgd",
  "quality_per_byte",
  "cost",
)
HERE = os.path.dirname(os.path.abspath(__file__))
GPU_NOTE = (
  "No GPU figure for this run: no accelerator was available to it,"
  " so sections 1 and 3 have not been repeated as a single-device GPU"
  " sanity run."
)
README_BEGIN = "<!-- RESULTS:BEGIN (written by python -m benchmarks.run) -->"
README_END = "<!-- RESULTS:END -->"


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def _git(*args: str) -> str:
  """``git ARGS``'s output in the checkout, stripped."""
  return subprocess.run(
    ["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10
  ).stdout.strip()


def git_commit(*, mark_dirty: bool = False) -> str:
  """The checkout's short commit, or ``"unknown"`` (no git, no checkout):
  recorded with the numbers of every results file. ``mark_dirty`` appends
  ``+dirty`` where tracked files differ from that commit."""
  try:
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    if head == "unknown" or not mark_dirty:
      return head
    dirty = _git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


# Where git is absent (a copy of the working tree without its history, as
# on a lent accelerator), the caller may name the commit in this variable.
COMMIT_VARIABLE = "SHARDOPT_COMMIT"


def _driver(device) -> dict:
  """The runtime's own words for the device's platform and driver."""
  out = {"platform_version": getattr(device.client, "platform_version", None)}
  try:  # NVIDIA's kernel driver writes its version here
    with open("/proc/driver/nvidia/version") as f:
      out["nvidia_driver"] = f.readline().strip()
  except OSError:
    pass
  return out


def provenance(prog: str, argv: Sequence[str] | None = None) -> dict:
  """What a results file records about its own run, written by the run
  itself (nothing edits a results file afterwards).

  ``command``: ``python -m PROG`` and the arguments as the process got them
  (the shell's variables already expanded), ``argv`` the same list in full
  (``sys.argv``, or ``[PROG, *argv]`` for a call with ``argv``);
  ``date_utc``: ISO 8601 in UTC; ``commit``: the checkout's (``+dirty``
  with local changes), else :data:`COMMIT_VARIABLE` if set, else
  ``"unknown"``, and ``commit_from`` says which; the device kind, platform
  and driver from the runtime (``jax.devices()[0]``), JAX's version.
  """
  import jax

  args = list(sys.argv[1:] if argv is None else argv)
  commit, commit_from = git_commit(mark_dirty=True), "git"
  if commit == "unknown":
    commit = os.environ.get(COMMIT_VARIABLE) or "unknown"
    commit_from = (
      f"environment variable {COMMIT_VARIABLE}"
      if commit != "unknown"
      else f"unknown (no git checkout, no {COMMIT_VARIABLE})"
    )
  device = jax.devices()[0]
  return {
    "command": " ".join([f"python -m {prog}", *args]),
    "argv": list(sys.argv) if argv is None else [prog, *args],
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "commit": commit,
    "commit_from": commit_from,
    "platform": device.platform,
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "driver": _driver(device),
    "jax": jax.__version__,
  }


def machine() -> dict:
  """The device and software every number in this run came from."""
  import jax
  import jaxlib
  import numpy
  import optax

  devices = jax.devices()
  return {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "device_count": len(devices),
    "devices": [str(d) for d in devices],
    "cpu_model": _cpu_model(),
    "cpu_count": os.cpu_count(),
    "load_average_at_start": list(os.getloadavg()),
    "python": platform.python_version(),
    "os": platform.platform(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "numpy": numpy.__version__,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "git_commit": git_commit(),
    "gpu": None,
    "gpu_note": GPU_NOTE,
  }


def _cell(value) -> str:
  return str(value).replace("|", "\\|")


def markdown(
  results: dict, *, image_prefix: str = "", heading: str = "#"
) -> str:
  """The whole report as Markdown: machine line, then one table per section."""
  m = results["machine"]
  lines = [
    f"{heading} shardopt benchmarks"
    + (" (quick smoke run)" if results["quick"] else ""),
    "",
    f"Ran {m['date_utc']} on {m['device_count']} forced {m['platform']} devices"
    f" ({m['cpu_model']}, {m['cpu_count']} cores, load average at start"
    f" {m['load_average_at_start'][0]:.1f}); jax {m['jax']}, optax"
    f" {m['optax']}, commit {m['git_commit']}. Command: `{results['command']}`.",
    "",
    m["gpu_note"],
  ]
  for name in ORDER:
    section = results["sections"].get(name)
    if section is None:
      continue
    lines += ["", f"{heading}# {section.get('title', name)}", ""]
    if "error" in section:
      lines += ["```text", section["error"].rstrip(), "```"]
      continue
    table = section["table"]
    lines.append("| " + " | ".join(_cell(c) for c in table["columns"]) + " |")
    lines.append("|" + "---|" * len(table["columns"]))
    for row in table["rows"]:
      lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines.append("")
    lines += [f"- {note}" for note in section["notes"]]
    for path in section.get("plots", []):
      lines += ["", f"![{name}]({image_prefix}{os.path.basename(path)})"]
    lines.append("")
    ran = section.get("ran_on", m)
    lines.append(
      f"_Ran on {ran['device_count']} {ran['platform']} devices"
      f" ({ran['cpu_model']}), {ran['date_utc']}, commit {ran['git_commit']};"
      f" wall time {section['seconds']:.0f} s._"
    )
  return "\n".join(lines).rstrip() + "\n"


def update_readme(results: dict) -> bool:
  """Replaces the results block of ``benchmarks/README.md``; False if absent."""
  path = os.path.join(HERE, "README.md")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    text = f.read()
  if README_BEGIN not in text or README_END not in text:
    return False
  head, rest = text.split(README_BEGIN, 1)
  _, tail = rest.split(README_END, 1)
  block = markdown(results, image_prefix="results/", heading="##")
  with open(path, "w") as f:
    f.write(head + README_BEGIN + "\n\n" + block + "\n" + README_END + tail)
  return True


def run_module(module: ModuleType, quick: bool, out: str, *args) -> dict:
  """``module.run(quick, *args)``, its plots written to ``out`` (paths
  relative to ``out`` under ``"plots"``)."""
  section = module.run(quick, *args)
  if hasattr(module, "plot"):
    section["plots"] = [
      os.path.relpath(p, out) for p in module.plot(section, out)
    ]
  return section


def main(
  argv: Sequence[str] | None,
  *,
  prog: str,
  sections: Sequence[str],
  run_section: Callable[[str, bool, dict, str], dict],
  description: str,
) -> int:
  """The CLI of a harness: ``python -m PROG [--quick] [--only NAME] [--out
  DIR]`` over ``sections``.

  ``run_section(name, quick, results, out)`` runs one section, writes its
  plots to ``out`` and returns it (``results``: the report so far, this
  run's sections that already ran included). A section that raises is
  recorded with its traceback and the run exits 1; the others still run.
  """
  parser = argparse.ArgumentParser(
    prog=f"python -m {prog}", description=description
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="tiny sizes for the CI smoke run (writes results/quick/)",
  )
  parser.add_argument(
    "--only",
    action="append",
    choices=tuple(sections),
    metavar="NAME",
    help=f"run only NAME (one of {tuple(sections)})",
  )
  parser.add_argument("--out", default=None, help="output directory")
  args = parser.parse_args(argv)
  out = args.out or os.path.join(RESULTS, "quick" if args.quick else "")
  out = os.path.normpath(out)
  os.makedirs(out, exist_ok=True)
  json_path = os.path.join(out, "latest.json")

  names = args.only or list(sections)
  # A run of every section of the report starts afresh; a part of it
  # (--only, or one harness's sections) merges into what is there.
  merge = set(names) != set(ORDER)
  results = {"sections": {}}
  if merge and os.path.exists(json_path):
    with open(json_path) as f:
      results = name_commands(json.load(f))
  command = (
    f"python -m {prog}"
    + (" --quick" if args.quick else "")
    + "".join(f" --only {n}" for n in args.only or [])
  )
  results.update(quick=args.quick, command=command, machine=machine())

  failed = []
  start = time.perf_counter()
  for name in ORDER:
    if name not in names:
      continue
    print(f"[benchmarks] {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
      section = run_section(name, args.quick, results, out)
    except Exception:  # noqa: BLE001  (recorded, and the run exits non-zero)
      failed.append(name)
      section = {"title": name, "error": traceback.format_exc()}
    section["seconds"] = time.perf_counter() - t0
    section["ran_on"] = {
      k: results["machine"][k]
      for k in (
        "date_utc",
        "platform",
        "device_kind",
        "device_count",
        "cpu_model",
        "cpu_count",
        "git_commit",
      )
    }
    section["ran_on"]["load_average_at_end"] = list(os.getloadavg())
    section["ran_on"]["command"] = command
    results["sections"][name] = section
    print(f"[benchmarks] {name} done in {section['seconds']:.0f} s", flush=True)
  results["machine"]["load_average_at_end"] = list(os.getloadavg())
  results["total_seconds"] = time.perf_counter() - start

  if merge and os.path.exists(json_path):
    # Another run may have written its sections while this one ran (a
    # section can take an hour): keep them, replace only ours.
    with open(json_path) as f:
      latest = json.load(f)
    for name, section in latest.get("sections", {}).items():
      if name not in names:
        results["sections"][name] = section
  with open(json_path, "w") as f:
    json.dump(results, f, indent=1, default=str)
  text = markdown(results)
  with open(os.path.join(out, "latest.md"), "w") as f:
    f.write(text)
  print(text)
  print(
    f"[benchmarks] wrote {json_path} and latest.md in"
    f" {results['total_seconds']:.0f} s"
  )
  if not args.quick and out == os.path.normpath(RESULTS):
    if update_readme(results):
      print("[benchmarks] updated the results block of benchmarks/README.md")
  if failed:
    print(f"[benchmarks] FAILED sections: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


def name_commands(results: dict) -> dict:
  """Records the report's command in the ``ran_on`` of each section that
  run wrote (its date is the report's) and that does not name its own, so
  the command survives the next merge, which replaces the report's."""
  machine = results.get("machine", {})
  for section in results.get("sections", {}).values():
    ran = section.get("ran_on", {})
    if "command" not in ran and ran.get("date_utc") == machine.get("date_utc"):
      ran["command"] = results.get("command")
  return results


def write_json(filename: str, data, *, quick: bool = False) -> str:
  """Writes ``data`` to ``benchmarks/results/filename`` (a quick run:
  ``results/quick/``, git-ignored) and returns the path."""
  directory = os.path.join(RESULTS, "quick") if quick else RESULTS
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, filename)
  with open(path, "w") as f:
    json.dump(data, f, indent=1, default=str)
  return path
