"""Results tables generated from committed results files.

``python -m benchmarks.blocks`` rewrites, in place, every results block of
README.md, docs/*.md and benchmarks/README.md from the file under
``benchmarks/results/`` its numbers are in; ``python -m benchmarks.blocks
--check`` rewrites nothing and exits 1, naming each block that differs from
what its file gives (``tests/test_results_blocks.py`` runs the check). A
block in a page::

  <!-- results:NAME (python -m benchmarks.blocks; from benchmarks/results/FILE.json) -->

  _`the command that measured the numbers`, its date, its commit; ..._

  | the table |

  <!-- /results:NAME -->

Everything between the two markers is generated: edit the renderer in
:data:`BLOCKS` (or rerun the measurement), not the page. The first line
inside names the command, the date (UTC) and the commit that produced the
numbers, read from the results file (``command``; ``measured_utc``,
``date``, ``started_utc`` or ``date_utc``; ``commit`` or ``git_commit``);
a file that does not record its commit says so, and ``git log -- FILE``
tells which commit added it. To add a table: write the renderer (results
file -> Markdown), add a :class:`Block` to :data:`BLOCKS`, put the two
markers (empty between them) where the table goes, run ``python -m
benchmarks.blocks``.

The same command checks (or rewrites) what :mod:`benchmarks._report`
writes from ``benchmarks/results/latest.json``: ``latest.md`` and the
results block at the end of benchmarks/README.md (its own markers).

The check reads only the results files and the pages (no git, no JAX, bar
the DiLoCo outer-step tables, which reuse
:mod:`benchmarks.studies.outer_defaults`'s renderers and so import it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m benchmarks.blocks"
WIDTH = 100  # the pages' prose width
# The pages scanned for markers (a block in any other file is not checked).
PAGES = ("README.md", "benchmarks/README.md", "docs/*.md")


@dataclasses.dataclass(frozen=True)
class Block:
  """One generated table: its results files, renderer and pages.

  ``render(data)`` gets the loaded JSON of each of ``sources`` (in order)
  and returns the Markdown between the markers, provenance line included.
  """

  name: str
  sources: tuple[str, ...]  # relative to the repository root
  render: Callable[[Sequence[dict]], str]
  pages: tuple[str, ...]

  def begin(self) -> str:
    return (
      f"<!-- results:{self.name} ({COMMAND}; from"
      f" {', '.join(self.sources)}) -->"
    )

  def end(self) -> str:
    return f"<!-- /results:{self.name} -->"

  def load(self, root: Path | None = None) -> list[dict]:
    root = ROOT if root is None else root
    return [json.loads((root / s).read_text()) for s in self.sources]

  def text(self, data: Sequence[dict]) -> str:
    """The whole block, markers included; prose wrapped at :data:`WIDTH`."""
    body = "\n\n".join(
      p
      if p.startswith("|")
      else textwrap.fill(
        " ".join(p.split()),
        WIDTH,
        break_long_words=False,
        break_on_hyphens=False,
      )
      for p in self.render(data).strip("\n").split("\n\n")
    )
    return f"{self.begin()}\n\n{body}\n\n{self.end()}"


# ---------------------------------------------------------------- helpers


def when(value: str | None) -> str:
  """``2026-11-25T17:42:27+00:00`` -> ``2026-11-25 17:42 UTC``."""
  if not value:
    return "date not recorded"
  stamp = datetime.datetime.fromisoformat(value)
  if stamp.tzinfo is not None:
    stamp = stamp.astimezone(datetime.timezone.utc)
  return stamp.strftime("%Y-%m-%d %H:%M UTC")


def provenance(
  source: str,
  *,
  command: str | None,
  date: str | None,
  commit: str | None,
  extra: str = "",
) -> str:
  """The block's first line: command, date, commit, file (and ``extra``)."""
  commit_text = (
    f"commit {commit}"
    if commit and commit != "unknown"
    else f"commit not recorded (see `git log -- {source}`)"
  )
  command_text = f"`{command.strip()}`" if command else "command not recorded"
  return (
    f"_{command_text}, {when(date)}, {commit_text}; numbers from"
    f" `{source}`{extra}._"
  )


def top_provenance(data: dict, source: str, extra: str = "") -> str:
  """:func:`provenance` from a results file's top-level keys."""
  date = next(
    (
      data[k]
      for k in ("measured_utc", "date", "started_utc", "date_utc")
      if data.get(k)
    ),
    None,
  )
  return provenance(
    source,
    command=data.get("command"),
    date=date,
    commit=data.get("commit") or data.get("git_commit"),
    extra=extra,
  )


def table(columns: Sequence[str], rows: Sequence[Sequence], align="") -> str:
  """A Markdown table; ``align`` one letter per column (``r``: right)."""
  lines = ["| " + " | ".join(columns) + " |"]
  lines.append(
    "|"
    + "".join(
      "---:|" if (align[i : i + 1] == "r") else "---|"
      for i in range(len(columns))
    )
  )
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def fraction(ratio: float) -> str:
  """Bytes as a fraction of sync's: ``1``, ``1/2``, ``1/3.9``, ``1/123``."""
  if abs(ratio - 1) < 1e-9:
    return "1"
  text = f"{ratio:.1f}" if ratio < 10 else f"{ratio:,.0f}"
  return "1/" + (text[:-2] if text.endswith(".0") else text)


def spread(values: Sequence[float], digits: int = 2) -> str:
  """``1.10`` when every value rounds the same, else ``min-max``."""
  lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
  return lo if lo == hi else f"{lo}-{hi}"


# ------------------------------------------------------------------ demo

DEMO = "benchmarks/results/demo.json"


def render_demo(data: Sequence[dict]) -> str:
  """README's ``make demo`` table: accuracy and bytes of the four methods."""
  (d,) = data
  labels = {
    "sync": "sync (`cross_shard`)",
    "powersgd": "`powersgd`, rank 2",
    "diloco": f"`diloco`, H = {d['sync_period']}",
    "streaming": (
      f"streaming `diloco`, 2 fragments, {d['outer_dtype']} outer gradient"
    ),
  }
  sync = next(m for m in d["methods"] if m["method"] == "sync")
  rows = [
    [
      labels.get(m["method"], m["method"]),
      f"{m['test_accuracy']:.1%}",
      f"{m['bytes_per_replica'] / 1e6:,.2f} MB",
      fraction(sync["bytes_per_replica"] / m["bytes_per_replica"]),
    ]
    for m in d["methods"]
  ]
  return (
    top_provenance(
      d,
      DEMO,
      f"; {d['devices']} {d['platform'].upper()} devices, {d['steps']} steps per"
      " method",
    )
    + "\n\n"
    + table(
      ["method", "test accuracy", "bytes sent per replica", "vs sync"], rows
    )
  )


# ---------------------------------------------- section 8: quality per byte

LATEST = "benchmarks/results/latest.json"
# README's rows: section 8's method label -> the README's words.
LM_ROWS = {
  "cross_shard(adamw) [sync]": "sync `cross_shard(adamw)`",
  "chain(cross_shard_mean(int8+EF), adamw)": (
    "`cross_shard_mean`, int8 wire + error feedback"
  ),
  "local_sgd(adamw, H=2)": "`local_sgd` H = 2",
  "diloco(muon, H=16)": "`diloco(muon)` H = 16 (MuLoCo)",
  "diloco(muon, H=64)": "`diloco(muon)` H = 64 (MuLoCo)",
  "local_sgd(adamw, H=16, int4+EF)": "`local_sgd` H = 16, int4 + error feedback",
  "diloco(adamw, H=4, topk 64/4096 2-bit+EF, outer sgd(1))": (
    "`diloco` H = 4, top-k outer gradient + error feedback (SparseLoCo)"
  ),
  "chain(decoupled_momentum(k=32, chunk=64, decay=0.999), sign step)": (
    "`decoupled_momentum` (DeMo), the paper's defaults"
  ),
}
LM_SYNC = "cross_shard(adamw) [sync]"


def section_provenance(results: dict, name: str, source: str) -> str:
  """:func:`provenance` of one section of a report (``latest.json``)."""
  ran = results["sections"][name]["ran_on"]
  command = ran.get("command")
  if command is None and ran["date_utc"] == results["machine"]["date_utc"]:
    command = results["command"]  # the run that wrote the section last
  return provenance(
    source,
    command=command,
    date=ran["date_utc"],
    commit=ran.get("git_commit"),
    extra=f", section {name}",
  )


def render_lm_frontier(data: Sequence[dict]) -> str:
  """README's byte-level LM table: chosen rows of section 8."""
  (results,) = data
  section = results["sections"]["quality_per_byte"]
  d = section["data"]
  columns = section["table"]["columns"]
  final = columns.index("final val bits/byte")
  by_label = {row[0]: row for row in section["table"]["rows"]}
  sync_bytes = d["methods"][LM_SYNC]["total_bytes"]
  rows = []
  for label, words in LM_ROWS.items():
    total = d["methods"][label]["total_bytes"]
    verdict = d["verdicts"].get(label)
    rows.append(
      [
        words,
        f"{total / 1e6:,.1f}",
        fraction(sync_bytes / total),
        by_label[label][final],
        "-" if verdict is None else f"{verdict['relative_delta_vs_sync']:+.1%}",
      ]
    )
  on_frontier = [
    i + 1 for i, label in enumerate(LM_ROWS) if label in d["frontier"]
  ]
  flat = d["sync_flattening"]
  seeds = d["seeds"]
  config = d["config"]
  return (
    section_provenance(results, "quality_per_byte", LATEST)
    + "\n\n"
    + table(
      ["method", "MB sent", "vs sync", "val bits/byte", "Δ vs sync"],
      rows,
      "lrrrr",
    )
    + "\n\n"
    + f"{d['params']:,} params, {d['replicas']} replicas,"
    f" {config['steps']} steps, {len(seeds)} seeds ({', '.join(map(str, seeds))});"
    f" sync's last {1 - flat['from_step'] / config['steps']:.0%} of steps"
    f" gained {flat['relative_gain']:.2%}. Rows {_ranges(on_frontier)} are on"
    f" the Pareto frontier of the {len(d['methods'])} methods."
    + _added(d.get("added", []))
    + (
      f" Moonshot, against the best synchronous run"
      f" ({d['moonshot']['reference']}): "
      + ("reached." if d["moonshot"]["reached"] else "not reached.")
      if "reference" in d.get("moonshot", {})
      else ""
    )
  )


def _added(notes: Sequence[str]) -> str:
  """Section 8's rows run later (``--add-to``), in a few words each: when,
  at which commit, how many (the full command is in section 8's notes)."""
  parts = []
  for note in notes:
    found = re.match(
      r"Rows added (\S+?)T(\d\d:\d\d).*? at commit (\S+) by", note
    )
    if found:
      date, time, commit = found.groups()
      rows = note.count("--only")
      plural = "s" if rows != 1 else ""
      parts.append(f"{date} {time} UTC, commit {commit}, {rows} row{plural}")
  if not parts:
    return ""
  return (
    " Rows added later by `python -m benchmarks.studies.quality_per_byte"
    " --only LABEL --add-to benchmarks/results/latest.json` (the commands in"
    " section 8's notes): " + "; ".join(parts) + "."
  )


def _ranges(numbers: Sequence[int]) -> str:
  """``[2, 4, 5, 6, 7]`` -> ``2 and 4-7``."""
  parts, start = [], None
  for i, n in enumerate(numbers):
    if start is None:
      start = n
    if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
      parts.append(str(n) if n == start else f"{start}-{n}")
      start = None
  if not parts:
    return "none"
  return (
    parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
  )


# benchmarks/README.md section 8a: (what the rows isolate, the method's
# words, section 8's labels); a row of several labels joins each cell's
# values with " / ".
WHAT_BREAKS = (
  (
    "the wire alone, every step",
    "`cross_shard_mean` int8 + EF",
    ("chain(cross_shard_mean(int8+EF), adamw)",),
  ),
  (
    "a sparse wire every step (DeMo's density)",
    "`cross_shard_mean` top-k 32/4096 + EF",
    ("chain(cross_shard_mean(topk 32/4096 2-bit+EF decay 1), adamw)",),
  ),
  ("local steps alone", "`local_sgd` H = 2", ("local_sgd(adamw, H=2)",)),
  (
    "",
    "`local_sgd` H = 4 / 8 / 16",
    (
      "local_sgd(adamw, H=4)",
      "local_sgd(adamw, H=8)",
      "local_sgd(adamw, H=16)",
    ),
  ),
  (
    "DiLoCo's new default vs the paper's",
    "`diloco` H = 16, Nesterov 0.8 / 0.2",
    ("diloco(adamw, H=16)",),
  ),
  (
    "",
    "`diloco` H = 16, the paper's 0.7 / 0.9",
    ("diloco(adamw, H=16, paper outer 0.7/0.9)",),
  ),
  (
    "SparseLoCo (top-k 64/4096 outer gradient + EF, outer `sgd(1)`)",
    "`diloco` H = 2 / 4 / 16",
    tuple(
      f"diloco(adamw, H={h}, topk 64/4096 2-bit+EF, outer sgd(1))"
      for h in (2, 4, 16)
    ),
  ),
  ("MuLoCo (Muon inside)", "Muon's own sync", ("cross_shard(muon) [sync]",)),
  (
    "",
    "`diloco(muon)` H = 16 / 64",
    ("diloco(muon, H=16)", "diloco(muon, H=64)"),
  ),
  (
    "best at ≥ 100x fewer bytes",
    "`local_sgd` H = 16, int4 + EF",
    ("local_sgd(adamw, H=16, int4+EF)",),
  ),
)


def render_lm_what_breaks(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 8a: chosen rows of section 8, grouped by
  what they isolate."""
  (results,) = data
  section = results["sections"]["quality_per_byte"]
  d = section["data"]
  final = section["table"]["columns"].index("final val bits/byte")
  by_label = {row[0]: row for row in section["table"]["rows"]}
  sync_bytes = d["methods"][LM_SYNC]["total_bytes"]

  def joined(labels, cell) -> str:
    return " / ".join(cell(label) for label in labels)

  def sent(labels) -> str:
    mb = joined(
      labels, lambda k: f"{d['methods'][k]['total_bytes'] / 1e6:,.1f}"
    )
    of_sync = joined(
      labels, lambda k: fraction(sync_bytes / d["methods"][k]["total_bytes"])
    )
    return f"{mb} ({of_sync})"

  rows = [
    [
      what,
      words,
      sent(labels),
      by_label[labels[0]][final]
      if len(labels) == 1
      else joined(labels, lambda k: f"{d['methods'][k]['final_mean']:.3f}"),
      joined(
        labels, lambda k: f"{d['verdicts'][k]['relative_delta_vs_sync']:+.1%}"
      ),
    ]
    for what, words, labels in WHAT_BREAKS
  ]
  return (
    section_provenance(results, "quality_per_byte", LATEST)
    + "\n\n"
    + table(
      [
        "what it isolates",
        "method",
        "MB sent (vs sync)",
        "final val bits/byte",
        "Δ vs sync",
      ],
      rows,
      "llrrr",
    )
  )


# ---------------------------------------------------------------- elastic

ELASTIC = "benchmarks/results/elastic.json"
ROUND_BYTES = "benchmarks/results/elastic_round_bytes.json"


def render_elastic_round_costs(data: Sequence[dict]) -> str:
  """docs/elastic.md: an elastic round against today's sync."""
  (d,) = data
  costs = d["round_costs"]
  m = costs["median_s"]
  rows = [
    ["inner step (island-local, 2 devices)", m["inner_step"]],
    [
      "elastic round (`island.sync`: `live_devices`, one collective program, commit)",
      m["elastic_round"],
    ],
    [
      "today's `diloco` step over all 6 devices, without a sync",
      m["plain_local"],
    ],
    ["today's `diloco` step over all 6 devices, with a sync", m["plain_sync"]],
    ["today's sync (the difference)", costs["todays_sync_s"]],
  ]
  return (
    top_provenance(
      d, ELASTIC, f"; median of {costs['repeats']} interleaved repeats"
    )
    + "\n\n"
    + table(["what", "seconds"], [[w, f"{s:.4f}"] for w, s in rows], "lr")
    + "\n\n"
    + f"An elastic round cost {costs['round_vs_todays_sync']:.2f}x today's"
    f" sync, and an inner step plus a round"
    f" {costs['step_plus_round_vs_todays_sync_step']:.2f}x today's step with a"
    f" sync; today's step without a sync was"
    f" {m['plain_local'] / m['inner_step']:.1f}x the island-local step."
  )


def render_elastic_detection(data: Sequence[dict]) -> str:
  """docs/elastic.md: seconds from the kill to the failed round and to the
  commit without the killed island, both survivors."""
  (d,) = data
  rows, between = [], sum(1 for w, _ in d["detection"] if w == "between")
  seen = 0
  for where, run in d["detection"]:
    survivors = [run[k] for k in sorted(run) if k.startswith("p")]
    if where == "between":
      seen += 1
      label = "between syncs" + (f" (run {seen})" if between > 1 else "")
    else:
      label = "inside a round"
    rows.append(
      [
        label,
        spread([s["failed_after_s"] for s in survivors]),
        spread([s["committed_without_it_after_s"] for s in survivors]),
      ]
    )
  return (
    top_provenance(d, ELASTIC)
    + "\n\n"
    + table(
      ["killed", "survivors' round failed", "committed without it"],
      rows,
      "lrr",
    )
  )


def render_elastic_round_bytes(data: Sequence[dict]) -> str:
  """docs/elastic.md: one island's bytes per plain round."""
  (d,) = data
  payload = d["payload_bytes"]
  two, gather = d["round_bytes_per_island"], d["all_gather_bytes_per_island"]
  rows = [
    [
      n,
      f"{two[n]:,.0f}",
      f"{two[n] / payload:.2f}",
      f"{gather[n]:,.0f}",
      f"{gather[n] / payload:.2f}",
    ]
    for n in sorted(two, key=int)
  ]
  return (
    top_provenance(d, ROUND_BYTES, f"; payload {payload:,} bytes")
    + "\n\n"
    + table(
      [
        "islands",
        "two-phase round (bytes)",
        "/ payload",
        "one `all_gather` of the rows, before (bytes)",
        "/ payload",
      ],
      rows,
      "rrrrr",
    )
  )


MODEL_PARALLEL = "benchmarks/results/elastic_model_parallel.json"
UNEQUAL = "benchmarks/results/elastic_unequal.json"


def render_elastic_unequal(data: Sequence[dict]) -> str:
  """docs/elastic.md: islands of unequal speed, clock vs steps."""
  (d,) = data
  speeds = "/".join(f"{v:g}" for v in d["speeds_s"])
  rows = [
    [
      label,
      ", ".join(f"{v:.0%}" for v in r["goodput"].values()),
      ", ".join(f"{v:,}" for v in r["inner_steps"].values()),
      r["rounds"],
      f"{r['final_loss']:.5f}",
      ", ".join(sorted({str(c) for c in r["exit_codes"].values()})),
    ]
    for label, r in d["runs"].items()
  ]
  return (
    top_provenance(
      d,
      UNEQUAL,
      f"; 3 islands x 2 CPU devices, {speeds} s per inner step (equal"
      f" islands: the fastest's), {d['seconds']:g} s of training each",
    )
    + "\n\n"
    + table(
      [
        "run",
        "goodput per island",
        "inner steps per island",
        "rounds",
        "center's held-out loss at the end",
        "exit codes",
      ],
      rows,
      "lllrrl",
    )
  )


CHAOS = "benchmarks/results/elastic_chaos.json"


def render_elastic_model_parallel(data: Sequence[dict]) -> str:
  """docs/elastic.md: bytes per device of a model-parallel island."""
  (d,) = data

  def held(r: dict) -> int:
    return r["params_bytes_per_device"] + r["state_bytes_per_device"]

  base = held(d["by_m"]["1"])
  rows = []
  for m, r in d["by_m"].items():
    rows.append(
      [
        m,
        f"{r['params_bytes_per_device']:,}",
        f"{r['state_bytes_per_device']:,}",
        f"{r['plain_round_rows_bytes_per_device']:,}",
        f"{r['healing_row_bytes_per_device']:,}",
        f"{held(r) / base:.3f}",
      ]
    )
  return (
    top_provenance(
      d,
      MODEL_PARALLEL,
      f"; {d['layers']} layers of width {d['width']}, {d['devices']} CPU"
      " devices per island",
    )
    + "\n\n"
    + table(
      [
        "M (model-parallel)",
        "params / device (bytes)",
        "state / device",
        "a plain round's rows",
        "a healing round's row",
        "params + state vs M = 1",
      ],
      rows,
      "rrrrrr",
    )
  )


def render_elastic_chaos(data: Sequence[dict]) -> str:
  """docs/elastic.md: the chaos run's report."""
  (d,) = data
  st = d["settings"]
  stall = d["stall_after_kill_s"]
  codes = sorted(set(d["exit_codes"].values()), key=str)
  rows = [
    [
      "kills",
      f"{d['kills']} ({d['kills_of_every_island']} of every island at once)",
    ],
    [
      "rounds committed",
      f"{d['rounds_committed']} ({d['failed_attempts']} failed attempts)",
    ],
    ["rounds lost", f"{len(d['rounds_lost'])}"],
    ["rounds whose bits differ", f"{len(d['rounds_with_other_bits'])}"],
    [
      "goodput (inner steps that reached a committed center)",
      f"{d['goodput']:.1%} ({d['inner_steps_in_committed_rounds']:,} of {d['inner_steps']:,})",
    ],
    [
      "stall from a kill to the next committed round",
      f"median {stall['median']:.1f} s, max {stall['max']:.1f} s"
      f" ({stall['count']} kills with survivors)",
    ],
    ["exit codes", ", ".join(map(str, codes))],
    ["wall time", f"{d['wall_s']:.0f} s"],
  ]
  return (
    top_provenance(
      d,
      CHAOS,
      f"; {st['islands']} islands x {st['devices_per_process']} CPU devices"
      f" and a dedicated coordinator, H = {st['sync_period']},"
      f" {st['step_seconds']} s per inner step, a kill every"
      f" {st['kill_every_s'][0]:g}-{st['kill_every_s'][1]:g} s, back after"
      f" {st['back_after_s'][0]:g}-{st['back_after_s'][1]:g} s, seed {st['seed']}",
    )
    + "\n\n"
    + table(["what", "measured"], rows, "lr")
  )


# ------------------------------------------------------------ finite guards

GUARDS = "benchmarks/results/cost_guards.json"
# (group, a substring of the comparison's name) -> which comparison.
FREE = "apply_if_finite(adam, 5, axis_name=None)"
FLAG = "apply_if_finite(cross_shard(adam)"
TOWER = "apply_if_finite(tower(adam)"
FLOOR = "finite check"


def _comparisons(d: dict, group: str, key: str, donated: bool) -> list[dict]:
  """The comparison ``(group, key)`` of every run, in run order."""
  out = []
  for run in d["runs"]:
    found = [
      v
      for name, v in run["comparisons"].items()
      if v["group"] == group and key in name and v["donated"] == donated
    ]
    if len(found) != 1:
      raise ValueError(
        f"{GUARDS}: {len(found)} comparisons ({group!r}, {key!r},"
        f" donated={donated}) in a run, expected 1"
      )
    out.append(found[0])
  return out


def guard_ratios(d: dict, group: str, key: str, fmt=spread) -> str:
  """``not donated / donated``, each over the runs, e.g. ``1.10 / 1.12-1.13``."""
  return " / ".join(
    fmt([c["ratio"] for c in _comparisons(d, group, key, donated)])
    for donated in (False, True)
  )


def _each(values: Sequence[float]) -> str:
  """Every run's value: ``1.107, 1.111``."""
  return ", ".join(f"{v:.3f}" for v in values)


def _copied(copies: dict) -> str:
  total = copies["top"] + sum(copies["conditional"].values())
  return "0" if total == 0 else f"{total / 1e6:.3g}"


def guard_copies(d: dict, group: str, key: str, baseline: bool = False) -> str:
  """Copied MB/step of the first run, ``not donated / donated``."""
  field = "baseline_copied_bytes" if baseline else "copied_bytes"
  return " / ".join(
    _copied(_comparisons(d, group, key, donated)[0][field])
    for donated in (False, True)
  )


def guards_conditions(d: dict) -> str:
  """The runs' dates, loads, spreads and workload, as one sentence."""
  runs = d["runs"]
  spreads = [
    c["iqr_rel"] * 50 for run in runs for c in run["comparisons"].values()
  ]
  sizes = runs[0]["sizes"]
  starts = ", ".join(when(r["started_utc"])[11:16] for r in runs)
  loads = ", ".join(f"{r['load_average_at_start'][0]:.1f}" for r in runs)
  rounds = re.search(r"median of (\d+) interleaved", runs[0]["notes"][0])
  return (
    f"{len(runs)} runs, started {starts} UTC (load average {loads} at the"
    f" start, {d['machine']['cpu_count']} cores; spreads"
    f" ±{min(spreads):.0f}-{max(spreads):.0f}%); MLP {sizes}"
    f" ({runs[0]['params'] / 1e6:.2f}M params), Adam,"
    f" {d['machine']['device_count']} {d['machine']['platform'].upper()}"
    " devices,"
    f" median of {rounds.group(1) if rounds else '?'} interleaved rounds"
  )


def render_guards_readme(data: Sequence[dict]) -> str:
  """README's guard table: step time over the unguarded step, and over
  optax's guard in the same place; not donated / donated, over the runs."""
  (d,) = data
  rows = [
    [
      "already reduced (`cross_shard_mean`)",
      "`chain(cross_shard_mean(axis), apply_if_finite(adam, n, axis_name=None))`",
      "none",
      guard_ratios(d, "guard", FREE),
      guard_ratios(d, "vs optax guard", FREE),
    ],
    [
      "per replica (`cross_shard`)",
      "`apply_if_finite(cross_shard(adam), n, axis_name=axis)`",
      "a 4-byte flag, combined with the gradient's all-reduce",
      guard_ratios(d, "guard", FLAG),
      guard_ratios(d, "vs optax guard", FLAG),
    ],
    [
      "per replica (`tower`)",
      "`apply_if_finite(tower(adam), n, axis_name=axis)`",
      "a 4-byte flag",
      guard_ratios(d, "guard", TOWER),
      "deadlocks",
    ],
    [
      "floor: the check alone, deciding nothing",
      "-",
      "-",
      guard_ratios(d, "floor", FLOOR),
      "-",
    ],
  ]
  return (
    top_provenance(d, GUARDS, f"; {guards_conditions(d)}")
    + "\n\n"
    + table(
      [
        "where the gradients are",
        "guard",
        "collectives it adds",
        "step time",
        "vs `optax.apply_if_finite` there",
      ],
      rows,
    )
  )


def render_guards_benchmarks(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 9c: every run's ratio, and the copies."""
  (d,) = data
  rows = [
    [
      "floor: `chain(cross_shard_mean, adam + all_finite(grads))`, deciding"
      " nothing",
      guard_ratios(d, "floor", FLOOR, _each),
      "-",
      guard_copies(d, "floor", FLOOR),
    ],
    [
      "free guard `chain(cross_shard_mean, apply_if_finite(adam, 5,"
      " axis_name=None))`",
      guard_ratios(d, "guard", FREE, _each),
      guard_ratios(d, "vs optax guard", FREE, _each),
      f"{guard_copies(d, 'guard', FREE)} (optax's:"
      f" {guard_copies(d, 'vs optax guard', FREE, baseline=True)})",
    ],
    [
      "flag `apply_if_finite(cross_shard(adam), 5, axis_name=axis)`",
      guard_ratios(d, "guard", FLAG, _each),
      guard_ratios(d, "vs optax guard", FLAG, _each),
      f"{guard_copies(d, 'guard', FLAG)} (optax's:"
      f" {guard_copies(d, 'vs optax guard', FLAG, baseline=True)})",
    ],
    [
      "flag `apply_if_finite(tower(adam), 5, axis_name=axis)`",
      guard_ratios(d, "guard", TOWER, _each),
      "- (optax's deadlocks)",
      f"{guard_copies(d, 'guard', TOWER)} (unguarded tower:"
      f" {guard_copies(d, 'guard', TOWER, baseline=True)})",
    ],
  ]
  return (
    top_provenance(d, GUARDS, f"; {guards_conditions(d)}")
    + "\n\n"
    + table(
      [
        "step",
        "vs unguarded",
        "vs `optax.apply_if_finite` in the same place",
        "copied MB/step (HLO, not donated / donated)",
      ],
      rows,
    )
  )


def render_guards_reliability(data: Sequence[dict]) -> str:
  """docs/reliability.md's table: which guard each transform needs, what it
  adds and (where timed) what it costs; every run's ratio."""
  (d,) = data
  rows = [
    [
      "`cross_shard_mean` then anything, e.g. `chain(cross_shard_mean(axis),"
      " adam)`",
      "free: `chain(cross_shard_mean(axis), apply_if_finite(adam, n,"
      " axis_name=None))`",
      "none: the compiled step has exactly one all-reduce, the gradient's"
      " (`tests/test_finite.py::test_free_guard_step_has_exactly_one_all_reduce`)",
      guard_ratios(d, "guard", FREE, _each),
      guard_ratios(d, "vs optax guard", FREE, _each),
    ],
    [
      "`cross_shard(inner)`",
      "flag: `apply_if_finite(cross_shard(inner), n, axis_name=axis)`, or the"
      " free guard after `cross_shard_mean`",
      "the 4-byte flag, which XLA combines with the gradient's all-reduce: one"
      " all-reduce of 4 bytes more"
      " (`tests/test_finite.py::"
      "test_the_guard_adds_only_the_4_byte_flag_to_the_inner_collectives`)",
      guard_ratios(d, "guard", FLAG, _each),
      guard_ratios(d, "vs optax guard", FLAG, _each)
      + " (optax's deadlocks under pmap on a one-replica NaN)",
    ],
    [
      "`tower(inner)` (each replica updates its own slice)",
      "flag: `apply_if_finite(tower(inner), n, axis_name=axis)`",
      "one 4-byte all-reduce",
      guard_ratios(d, "guard", TOWER, _each),
      "- (deadlocks)",
    ],
    [
      "`powersgd` (each replica keeps its own error)",
      "flag: `apply_if_finite(chain(powersgd(axis), opt), n, axis_name=axis)`",
      "one 4-byte all-reduce",
      "not timed",
      "-",
    ],
    [
      "`accumulate(inner, k)`",
      "flag inside: `accumulate(apply_if_finite(inner, n, axis_name=axis), k)`",
      "the 4-byte all-reduce, at emit steps only (see below)",
      "not timed",
      "-",
    ],
    [
      "`agn`, `local_sgd`, `diloco`, `hierarchical_local_sgd`",
      "none needed for the sync: a non-finite replica is left out of its"
      " group's average",
      "-",
      "-",
      "-",
    ],
    [
      "the floor: `chain(cross_shard_mean(axis), adam)` plus"
      " `all_finite(grads)` deciding nothing (one more read of the gradients)",
      "-",
      "-",
      guard_ratios(d, "floor", FLOOR, _each),
      "-",
    ],
  ]
  return (
    top_provenance(d, GUARDS, f"; {guards_conditions(d)}; each cell: every run")
    + "\n\n"
    + table(
      [
        "transform",
        "guard",
        "collectives the guard adds",
        "step time vs unguarded (not donated / donated)",
        "vs `optax.apply_if_finite` in the same place (not donated / donated)",
      ],
      rows,
    )
  )


# ------------------------------------------------- DiLoCo's outer-step sweep

OUTER_DIGITS = "benchmarks/results/outer_defaults.json"
OUTER_LM = (
  "benchmarks/results/outer_defaults_lm.json",
  "benchmarks/results/outer_defaults_lm_seed1.json",
  "benchmarks/results/outer_defaults_lm_low_momentum.json",
)


def render_outer_lm(data: Sequence[dict]) -> str:
  """docs/diloco.md: section 8's LM, each outer step vs plain averaging
  (:func:`benchmarks.studies.outer_defaults.lm_table` of the three files)."""
  from benchmarks.studies import outer_defaults  # noqa: PLC0415

  text = outer_defaults.lm_table(outer_defaults.lm_finals_of(data))
  runs = "; ".join(
    f"`{Path(s).name}` {when(d.get('date'))}, seed"
    + ("s" if d["seeds"] > 1 else "")
    + " "
    + ", ".join(str(d.get("first_seed", 0) + i) for i in range(d["seeds"]))
    for s, d in zip(OUTER_LM, data, strict=True)
  )
  return (
    f"_`python -m benchmarks.studies.outer_sweep` runs ({runs}), commit not"
    " recorded (see `git log -- benchmarks/results/outer_defaults_lm.json`);"
    " merged by `outer_defaults --lm-report`._\n\n" + text
  )


def outer_digits_command(d: dict) -> str:
  """The file's command, or (an older file) the command its settings give:
  ``--outer`` less the plain step the script appends, other flags only
  where they differ from the defaults."""
  if d.get("command"):
    return d["command"]
  outer = [tuple(o) for o in d["outer_steps"]]
  if outer[-1] == (1.0, 0.0):
    outer = outer[:-1]
  parts = ["python -m benchmarks.studies.outer_defaults"]
  if d["steps"] != 512:
    parts.append(f"--steps {d['steps']}")
  if d["seeds"] != 3:
    parts.append(f"--seeds {d['seeds']}")
  periods = ",".join(d["runs"])
  if periods != "4,8,16,32,64,128":
    parts.append(f"--periods {periods}")
  parts.append('--outer "' + ";".join(f"{a:g},{b:g}" for a, b in outer) + '"')
  return " ".join(parts)


def render_outer_digits(data: Sequence[dict]) -> str:
  """docs/diloco.md: the digits MLP, every outer step
  (:func:`benchmarks.studies.outer_defaults.table`)."""
  from benchmarks.studies import outer_defaults  # noqa: PLC0415

  (d,) = data
  recorded = bool(d.get("command"))
  return (
    provenance(
      OUTER_DIGITS,
      command=outer_digits_command(d),
      date=d.get("date"),
      commit=d.get("commit"),
      extra=("" if recorded else " (the command rebuilt from its settings)")
      + f"; {d['steps']} steps, {d['seeds']} seeds, mean ± std",
    )
    + "\n\n"
    + outer_defaults.table(d)
  )


OUTER_SWEEP = "benchmarks/results/outer_sweep.json"
OUTER_BATCH = (
  "benchmarks/results/outer_sweep_batch4.json",
  "benchmarks/results/outer_sweep_batch16.json",
)
# benchmarks.studies.outer_sweep's defaults (batch and end fraction: section
# 8's FULL config), for a file that does not record its command.
OUTER_SWEEP_DEFAULTS = {
  "steps": 384,
  "seeds": 1,
  "periods": "16,64",
  "outer": "0.7,0.9;0.7,0.5;1,0.5;1,0",
  "batch_per_replica": 4,
  "end_fraction": 0.0,
}
_SWEEP_RUN = re.compile(r"diloco H=(\d+), outer lr ([\d.]+) momentum ([\d.]+)")
SWEEP_SYNC = "sync cross_shard(adamw)"


def _sweep_runs(d: dict) -> dict[str, tuple[int, float, float]]:
  """Each DiLoCo run of an outer_sweep file: label -> (H, outer lr, momentum)."""
  out = {}
  for label in d["runs"]:
    m = _SWEEP_RUN.fullmatch(label)
    if m:
      out[label] = (int(m.group(1)), float(m.group(2)), float(m.group(3)))
  return out


def outer_sweep_command(d: dict, source: str) -> str:
  """The file's command, or (an older file) the command its settings give:
  flags only where they differ from the defaults, ``--name`` from the file."""
  if d.get("command"):
    return d["command"]
  runs = _sweep_runs(d).values()
  config = d["config"]
  given = {
    "steps": config["steps"],
    "seeds": d["seeds"],
    "periods": ",".join(dict.fromkeys(str(h) for h, _, _ in runs)),
    "outer": ";".join(dict.fromkeys(f"{lr:g},{m:g}" for _, lr, m in runs)),
    "batch_per_replica": config["batch_per_replica"],
    "end_fraction": config["end_fraction"],
  }
  parts = ["python -m benchmarks.studies.outer_sweep"]
  for key, value in given.items():
    if value != OUTER_SWEEP_DEFAULTS[key]:
      text = (
        f'"{value}"'
        if key == "outer"
        else value
        if isinstance(value, str)
        else f"{value:g}"
      )
      parts.append(f"--{key.replace('_', '-')} {text}")
  name = Path(source).stem
  if name != "outer_sweep":
    parts.append(f"--name {name}")
  return " ".join(parts)


def _sweep_provenance(
  sources: Sequence[str], data: Sequence[dict], extra: str = ""
) -> str:
  """:func:`provenance` of each outer_sweep file, in one line."""
  parts = [
    provenance(
      s,
      command=outer_sweep_command(d, s),
      date=d.get("date"),
      commit=d.get("commit"),
      extra=""
      if d.get("command")
      else " (the command rebuilt from its settings)",
    )[1:-2]  # without the italics' underscores and the full stop
    for s, d in zip(sources, data, strict=True)
  ]
  return "_" + "; ".join(parts) + f"{extra}._"


def _outer_words(lr: float, momentum: float) -> str:
  words = f"outer lr {lr:.1f}, momentum {momentum:g}"
  if (lr, momentum) == (0.7, 0.9):
    return words + " (the paper's)"
  if (lr, momentum) == (1.0, 0.0):
    return words + " (plain averaging, `local_sgd`)"
  return words


def render_outer_sweep(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 8b: each outer step against sync."""
  (d,) = data
  sync = d["runs"][SWEEP_SYNC]["final_mean"]

  def cells(label: str) -> list[str]:
    r = d["runs"][label]
    spread = f" ± {r['final_std']:.3f}" if d["seeds"] > 1 else ""
    delta = "-" if label == SWEEP_SYNC else f"{r['final_mean'] / sync - 1:+.1%}"
    return [f"{r['final_mean']:.3f}{spread}", delta]

  rows = [["sync `cross_shard(adamw)`", *cells(SWEEP_SYNC)]] + [
    [f"`diloco` H = {h}, {_outer_words(lr, m)}", *cells(label)]
    for label, (h, lr, m) in _sweep_runs(d).items()
  ]
  first = d.get("first_seed", 0)
  seeds = ", ".join(str(first + i) for i in range(d["seeds"]))
  return (
    _sweep_provenance(
      [OUTER_SWEEP],
      data,
      f"; {d['config']['steps']} steps, outer steps Nesterov SGD, mean ± std"
      f" over seeds {seeds}",
    )
    + "\n\n"
    + table(["method", "final val bits/byte", "Δ vs sync"], rows, "lrr")
  )


def render_outer_batch(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 8b: the same sweep at two local batches,
  one file per batch; a column per outer step."""
  finals = [
    {
      (lr, m): d["runs"][k]["final_mean"]
      for k, (_, lr, m) in _sweep_runs(d).items()
    }
    for d in data
  ]
  outer = list(dict.fromkeys(s for f in finals for s in f))
  rows = []
  for d, by_outer in zip(data, finals, strict=True):
    sync = d["runs"][SWEEP_SYNC]["final_mean"]
    batch = d["config"]["batch_per_replica"]
    default = batch == OUTER_SWEEP_DEFAULTS["batch_per_replica"]
    rows.append(
      [f"{batch} (section 8's)" if default else str(batch), f"{sync:.3f}"]
      + [f"{by_outer[s]:.3f} ({by_outer[s] / sync - 1:+.1%})" for s in outer]
    )
  columns = [
    "plain averaging (1.0 / 0)"
    if s == (1.0, 0.0)
    else f"`diloco` {s[0]:g} / {s[1]:g}"
    for s in outer
  ]
  return (
    _sweep_provenance(OUTER_BATCH, data)
    + "\n\n"
    + table(["windows per replica per step", "sync", *columns], rows, "lrrr")
  )


# ------------------------------------------------ quantized wire on digits

QUANTIZED_QUALITY = "benchmarks/results/quantized_quality.json"


def render_quantized_quality(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 10b: the study's own table (its rows as
  :mod:`benchmarks.studies.quantized_quality` formatted them from ``data``)."""
  (d,) = data
  seeds = d["seeds"]
  return (
    top_provenance(
      d,
      QUANTIZED_QUALITY,
      f"; {d['replicas']} replicas, {d['steps']} steps, mean ± std over"
      f" {len(seeds)} seeds ({', '.join(map(str, seeds))})",
    )
    + "\n\n"
    + table(d["table"]["columns"], d["table"]["rows"])
  )


# ------------------------------------------------------------- digits

CONVERGENCE_SYNC = "cross_shard(adam) [sync]"
DIGITS_ROWS = {
  CONVERGENCE_SYNC: "sync `cross_shard(adam)`",
  "local_sgd(adam, period=8)": "`local_sgd` H = 8",
  "diloco(adam, H=16)": "`diloco` H = 16",
}


def render_digits_convergence(data: Sequence[dict]) -> str:
  """docs/diloco.md: DiLoCo on the digits MLP (sections 5 and 5b of the
  latest report): accuracy per step, and streaming DiLoCo against DiLoCo."""
  (results,) = data
  sections = results["sections"]
  convergence = sections["convergence"]["data"]
  target = convergence["target"]
  summary = convergence["summary"]
  per_step = table(
    ["method", "all-reduces", "final test accuracy", f"steps to {target:.0%}"],
    [
      [
        words,
        f"{summary[key]['rounds_total']:,}",
        f"{summary[key]['final_accuracy']:.3f}"
        f" ± {summary[key]['final_accuracy_std']:.3f}",
        "never"
        if summary[key]["steps_to_target"] is None
        else f"{summary[key]['steps_to_target']:,}",
      ]
      for key, words in DIGITS_ROWS.items()
    ],
    "lrrr",
  )
  schedules = sections["schedule_convergence"]["table"]
  column = {name: i for i, name in enumerate(schedules["columns"])}
  streaming = table(
    [
      "method",
      "mean kB/step",
      "peak kB/step",
      "final test accuracy",
      "final test loss",
    ],
    [
      [
        f"`{row[column['method']]}`",
        row[column["mean kB/step"]],
        row[column["peak kB/step"]],
        row[column["final test acc (replica mean)"]],
        row[column["final test loss"]],
      ]
      for row in schedules["rows"]
      if row[column["comparison"]] == "streaming"
    ],
    "lrrrr",
  )
  verdicts = [
    note
    for note in sections["schedule_convergence"]["notes"]
    if note.startswith("**streaming diloco")
  ]
  steps = convergence["total_steps"]
  seeds = len(convergence["seeds"])
  replicas = sections["convergence"]["ran_on"]["device_count"]
  return "\n\n".join(
    [
      section_provenance(results, "convergence", LATEST),
      f"{steps:,} steps, {replicas} replicas, mean ± std over {seeds} seeds:",
      per_step,
      section_provenance(results, "schedule_convergence", LATEST),
      streaming,
      *(f"- {v}" for v in verdicts),
    ]
  )


QUANTIZED = "benchmarks/results/quantized.json"
QUANTIZED_BEFORE = "benchmarks/results/quantized_2026-11-25.json"
# Section 10's rows: the results file's label -> the table's.
QUANTIZED_ROWS = {
  "float32 wire": "float32",
  "bfloat16 wire": "bfloat16",
  "int8": "int8",
  "int8 + error feedback": "int8 + error feedback",
  "float8_e4m3fn": "float8_e4m3fn",
  "float8_e4m3fn + error feedback": "float8_e4m3fn + error feedback",
  "int4": "int4",
  "int4 + error feedback": "int4 + error feedback",
  "topk(64) + error feedback": (
    "`topk(64)` + error feedback (64 of every 4096, 2-bit values)"
  ),
  "float32 wire + an error buffer's read and write": (
    "**floor**: float32 wire + an error buffer's read and write"
  ),
}


def _pays_off(label: str, row: dict) -> str:
  """The link speed below which the wire is faster than float32's."""
  if label.startswith("float32 wire"):
    return "-"
  per_second = row.get("break_even_bytes_per_s")
  return "always" if per_second is None else f"{per_second * 8 / 1e9:.1f} Gb/s"


def _times(ratio: float) -> str:
  """A step-time ratio: ``1.498``, or ``29.5`` from 10 up."""
  return f"{ratio:.1f}" if ratio >= 10 else f"{ratio:.3f}"


def render_quantized(data: Sequence[dict]) -> str:
  """benchmarks/README.md section 10: each wire's step time over the
  float32 wire's, beside the run before issue 33's changes."""
  now, before = data
  rows = []
  for label, words in QUANTIZED_ROWS.items():
    r = now["rows"][label]
    old = before["rows"].get(label)
    rows.append(
      [
        words,
        f"{r['bytes_per_replica'] / 1e6:.3g} MB",
        _times(r["ratio"]),
        "-" if old is None else _times(old["ratio"]),
        _pays_off(label, r),
        r["fusions"],
        r["sorts"],
        r["topk_calls"],
      ]
    )
  return (
    top_provenance(
      now,
      QUANTIZED,
      f"; a {now['params'] / 1e6:.2f}M-parameter MLP, interleaved medians of"
      f" {now['repeats']}",
    )
    + " "  # one paragraph: the block's first line names both files
    + top_provenance(
      before,
      QUANTIZED_BEFORE,
      f" ({before['saved_from']}): the column 'before'",
    )
    + "\n\n"
    + table(
      [
        "wire",
        "bytes per replica per step",
        "step time vs float32 wire",
        f"before ({when(before['date'])})",
        "pays off on links below",
        "fusions",
        "full sorts",
        "TopK calls",
      ],
      rows,
      "lrrrrrrr",
    )
  )


# ----------------------------------------------------------- accelerator

ACCELERATOR = "benchmarks/results/accelerator_h100.json"
ACCELERATOR_FRONTIER = "benchmarks/results/accelerator_h100_frontier.json"


def _device(d: dict) -> str:
  """The device a results file names: its runtime's words (device kind,
  platform version, NVIDIA driver) where the run wrote them."""
  if d.get("device"):  # the 2026-11-27 files, written before provenance()
    return d["device"]
  if "device_kind" not in d:
    return d["sections"]["backend"]["device_kind"]
  driver = d.get("driver") or {}
  words = [f"{d['device_kind']} ({d['platform']}"]
  if driver.get("platform_version"):
    words.append(f", runtime {driver['platform_version']}")
  if driver.get("nvidia_driver"):
    words.append(f", {driver['nvidia_driver']}")
  return "".join(words) + f", JAX {d['jax']})"


def render_accelerator_frontier(data: Sequence[dict]) -> str:
  """The section 8 LM on one GPU, 8 vmap replicas (``frontier`` section)."""
  (d,) = data
  f = d["sections"]["frontier"]
  rows_in = f["rows"]
  sync = rows_in[LM_SYNC]
  rows = []
  for label, r in rows_in.items():
    if "val_bits_per_byte" not in r:
      continue
    bits, sent = r["val_bits_per_byte"], r["bytes_per_replica"]
    rows.append(
      [
        LM_ROWS.get(label, f"`{label}`"),
        f"{sent / 1e6:,.1f}",
        fraction(sync["bytes_per_replica"] / sent),
        f"{bits:.3f}",
        "-"
        if label == LM_SYNC
        else f"{bits / sync['val_bits_per_byte'] - 1:+.1%}",
      ]
    )
  config = f["config"]
  skipped = f.get("skipped", [])
  return (
    top_provenance(d, ACCELERATOR_FRONTIER, f"; {_device(d)}")
    + "\n\n"
    + table(
      ["method", "MB sent", "vs sync", "val bits/byte", "Δ vs sync"],
      rows,
      "lrrrr",
    )
    + "\n\n"
    + f"{f['params']:,} params, {f['replicas']} replicas under `jax.vmap`"
    f" on the one device, {config['steps']} steps of"
    f" {config['batch_per_replica']} x {config['context']} bytes per"
    f" replica, one seed; each method's training took"
    f" {min(r['train_seconds'] for r in rows_in.values() if 'train_seconds' in r):.0f}-"
    f"{max(r['train_seconds'] for r in rows_in.values() if 'train_seconds' in r):.0f} s"
    f" and its compiles"
    f" {min(r['compile_seconds'] for r in rows_in.values() if 'compile_seconds' in r):.0f}-"
    f"{max(r['compile_seconds'] for r in rows_in.values() if 'compile_seconds' in r):.0f} s."
    + (
      f" Not run (the section's time ran out): {', '.join(f'`{k}`' for k in skipped)}."
      if skipped
      else ""
    )
  )


def _first_line(text: str) -> str:
  """An error's first line, without JAX's invitation to file a request."""
  line = text.strip().splitlines()[0]
  return line.replace(" Please open a feature request!", "")


def _table_with_notes(columns, rows, align) -> str:
  """:func:`table` whose last column (notes) goes where no row has one."""
  if any(row[-1] for row in rows):
    return table(columns, rows, align)
  return table(columns[:-1], [row[:-1] for row in rows], align[:-1])


def _measured_rows(rows: dict, key: str, cells, width: int, why) -> list:
  """Table rows ``name, *cells(r), ""`` (``width`` cells) for the rows that
  hold ``key``; dashes and ``why(r)`` for the others (failed, skipped,
  unsupported)."""
  return [
    [f"`{k}`"] + (cells(r) + [""] if key in r else ["-"] * width + [why(r)])
    for k, r in rows.items()
  ]


def render_accelerator(data: Sequence[dict]) -> str:
  """The accelerator command's transforms, wires and overhead sections."""
  (d,) = data
  sec = d["sections"]
  t = sec["transforms"]
  transforms = _measured_rows(
    t["rows"],
    "max_abs_diff",
    lambda r: [
      f"{r['max_abs_diff']:.2e}",
      f"{r['moved']:.3g}",
      f"{r['replica_spread']:.2e}",
    ],
    3,
    lambda r: _first_line(r.get("error") or r["unsupported"]),
  )
  w = sec["wires"]
  wires = _measured_rows(
    w["rows"],
    "gbps",
    lambda r: [
      f"{r['gbps']:,.0f}",
      f"{r['ratio_to_copy']:.2f}",
      f"{r['share_of_step']:.1%}",
    ],
    3,
    lambda r: r.get("error") or r.get("skipped", ""),
  )
  o = sec["overhead"]
  overhead = [
    [f"`{k}`", f"{r['seconds'] * 1e3:.3f}", f"{r['ratio']:.2f}"]
    + _overhead_bytes(r, "bytes_accessed" in r)
    for k, r in o["rows"].items()
    if "ratio" in r
  ]
  both = any("bytes_accessed" in r for r in o["rows"].values())
  m = w["model_step"]
  return (
    top_provenance(
      d,
      ACCELERATOR,
      f"; {_device(d)}; {d['seconds']:.0f} s in all",
    )
    + "\n\n"
    + f"**Transforms**: {t['steps']} steps of {t['replicas']} replicas under"
    f" `jax.vmap` on the GPU against the same run on the machine's CPU"
    f" backend (matmuls at `{t['matmul_precision']}` precision); moved: the"
    f" largest change of a param; spread: the largest difference between"
    f" replicas (0 for a reduced step, nonzero for a local method's replicas"
    f" between syncs)."
    + "\n\n"
    + _table_with_notes(
      ["transform", "max abs diff vs CPU", "moved", "replica spread", ""],
      transforms,
      "lrrrl",
    )
    + "\n\n"
    + f"**Wires**: `cross_shard_mean`'s encode + mean + decode over the vmapped"
    f" axis of {w['replicas']}, {w['floats_per_replica']:,} float32 per replica;"
    f" GB/s of float32 input, against the device's copy (`x + 1`:"
    f" {w['copy_gbps']:,.0f} GB/s in the same unit); the share of a step is one"
    f" replica's wire against the forward and backward pass of the LM at"
    f" {m['params']:,} params ({m['batch']} x {m['context']} bytes,"
    f" {m['seconds'] * 1e3:.2f} ms)."
    + "\n\n"
    + _table_with_notes(
      ["wire", "GB/s", "/ copy", "share of a step", ""], wires, "lrrrl"
    )
    + "\n\n"
    + f"**Overhead**: a step that syncs nothing against plain `optax.adam`,"
    f" {o['replicas']} vmap replicas of {o['params_per_replica']:,} params,"
    f" donated, interleaved medians."
    + (
      " Each schedule both ways: host-scheduled (`sync=0`, the program"
      " `shardopt.due` picks; goal: at most"
      f" {o['goal']}x its floor, Adam or for `agn` Adam plus an accumulator"
      " add) and in-graph (the schedule's `lax.cond` in the step); XLA's"
      " bytes accessed and the bytes of `copy` instructions of each"
      " compiled step (in branches: on the steps that take them)."
      if both
      else ""
    )
    + "\n\n"
    + (
      table(
        ["step", "ms", "/ optax adam", "/ floor", "MB accessed", "MB copied"],
        overhead,
        "lrrrrr",
      )
      if both
      else table(["step", "ms", "/ optax adam"], overhead, "lrr")
    )
  )


def _overhead_bytes(row: dict, measured: bool) -> list:
  """The accelerator overhead row's floor ratio and bytes (files since
  issue 54), or nothing (the 2026-11-27 file)."""
  if not measured:
    return []
  branches = sum((row.get("copied_bytes_in_branches") or {}).values())
  return [
    f"{row['ratio_to_floor']:.2f}" if "ratio_to_floor" in row else "-",
    f"{row['bytes_accessed'] / 1e6:,.1f}",
    f"{row['copied_bytes'] / 1e6:,.1f}"
    + (f" + {branches / 1e6:,.1f} in branches" if branches else ""),
  ]


# ------------------------------------------------- step bytes (issue 54)

STEP_BYTES = "benchmarks/results/step_bytes.json"
# The three programs of a row, in the table's order (step_bytes.PROGRAMS).
STEP_PROGRAMS = ("in-graph", "host sync=0", "host sync=1")


def _mb(value: float) -> str:
  return f"{value / 1e6:,.2f}"


def step_bytes_table(d: dict) -> str:
  """:mod:`benchmarks.perf.step_bytes`'s floors line and table."""
  floors = d["floors"]
  rows = []
  for row in d["rows"]:
    if "refused" in row:
      rows.append(
        [row["transform"], row["wire"], f"refused: {row['refused']}"] + [""] * 6
      )
      continue
    programs = [row[p] for p in STEP_PROGRAMS]
    rows.append(
      [
        row["transform"],
        row["wire"],
        _mb(floors[row["floor"]]["bytes_accessed"]),
        *(
          f"{_mb(p['bytes_accessed'])} ({p['ratio_to_floor']:.3f})"
          for p in programs
        ),
        " / ".join(str(p["conditionals"]) for p in programs),
        " / ".join(str(p["collectives"]) for p in programs),
        " / ".join(_mb(p["copied_bytes"]) for p in programs),
      ]
    )
  floor_text = "; ".join(
    f"{name}: {_mb(f['bytes_accessed'])} MB accessed, {f['conditionals']}"
    f" conditionals, {f['collectives']} collectives, {_mb(f['copied_bytes'])}"
    " MB copied"
    for name, f in floors.items()
  )
  return (
    f"MLP {d['mlp']} ({d['params']:,} params), {d['replicas']} replicas of"
    f" {d['per_replica_batch']} examples, donated `jax.jit` +"
    " `shard_map(check_vma=False)` step, compiled and read, not run; MB ="
    f" 1e6 bytes, XLA's `bytes accessed`. Floors: {floor_text}."
    + "\n\n"
    + table(
      [
        "transform",
        "wire",
        "floor MB",
        "in-graph MB (/ floor)",
        "host sync=0 MB (/ floor)",
        "host sync=1 MB (/ floor)",
        "conditionals (in-graph / 0 / 1)",
        "collectives (in-graph / 0 / 1)",
        "copied MB (in-graph / 0 / 1)",
      ],
      rows,
      "llrrrrrrr",
    )
  )


def render_step_bytes(data: Sequence[dict]) -> str:
  """benchmarks/README.md's step-bytes table (issue 54)."""
  (d,) = data
  return (
    top_provenance(
      d,
      STEP_BYTES,
      f"; {d['device_kind']} ({d['platform']}), JAX {d['jax']},"
      f" {d['seconds']:.0f} s",
    )
    + "\n\n"
    + step_bytes_table(d)
  )


# --------------------------------------------------------------- registry

BLOCKS = (
  Block("demo", (DEMO,), render_demo, ("README.md",)),
  Block("lm-frontier", (LATEST,), render_lm_frontier, ("README.md",)),
  Block("guards", (GUARDS,), render_guards_readme, ("README.md",)),
  Block(
    "guards-each-run",
    (GUARDS,),
    render_guards_benchmarks,
    ("benchmarks/README.md",),
  ),
  Block(
    "guards-which",
    (GUARDS,),
    render_guards_reliability,
    ("docs/reliability.md",),
  ),
  Block(
    "elastic-round-costs",
    (ELASTIC,),
    render_elastic_round_costs,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-detection",
    (ELASTIC,),
    render_elastic_detection,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-round-bytes",
    (ROUND_BYTES,),
    render_elastic_round_bytes,
    ("docs/elastic.md",),
  ),
  Block("outer-lm", OUTER_LM, render_outer_lm, ("docs/diloco.md",)),
  Block(
    "elastic-model-parallel",
    (MODEL_PARALLEL,),
    render_elastic_model_parallel,
    ("docs/elastic.md",),
  ),
  Block("elastic-chaos", (CHAOS,), render_elastic_chaos, ("docs/elastic.md",)),
  Block(
    "elastic-unequal",
    (UNEQUAL,),
    render_elastic_unequal,
    ("docs/elastic.md",),
  ),
  Block(
    "accelerator",
    (ACCELERATOR,),
    render_accelerator,
    ("benchmarks/README.md",),
  ),
  Block(
    "accelerator-frontier",
    (ACCELERATOR_FRONTIER,),
    render_accelerator_frontier,
    ("README.md", "benchmarks/README.md"),
  ),
  Block(
    "outer-digits", (OUTER_DIGITS,), render_outer_digits, ("docs/diloco.md",)
  ),
  Block(
    "lm-what-breaks",
    (LATEST,),
    render_lm_what_breaks,
    ("benchmarks/README.md",),
  ),
  Block(
    "outer-sweep",
    (OUTER_SWEEP,),
    render_outer_sweep,
    ("benchmarks/README.md",),
  ),
  Block(
    "outer-batch",
    OUTER_BATCH,
    render_outer_batch,
    ("benchmarks/README.md",),
  ),
  Block(
    "digits-convergence",
    (LATEST,),
    render_digits_convergence,
    ("docs/diloco.md",),
  ),
  Block(
    "quantized",
    (QUANTIZED, QUANTIZED_BEFORE),
    render_quantized,
    ("benchmarks/README.md",),
  ),
  Block(
    "step-bytes",
    (STEP_BYTES,),
    render_step_bytes,
    ("benchmarks/README.md",),
  ),
  Block(
    "quantized-quality",
    (QUANTIZED_QUALITY,),
    render_quantized_quality,
    ("benchmarks/README.md",),
  ),
)

_FOUND = re.compile(
  r"<!-- results:([\w-]+) .*?-->\n.*?<!-- /results:\1 -->", re.DOTALL
)
_BEGIN = re.compile(r"<!-- results:([\w-]+)[ >]")


def pages(root: Path | None = None) -> list[Path]:
  root = ROOT if root is None else root
  out = []
  for pattern in PAGES:
    out += sorted(root.glob(pattern))
  return out


def _spans(text: str) -> dict[str, list[re.Match]]:
  spans: dict[str, list[re.Match]] = {}
  for m in _FOUND.finditer(text):
    spans.setdefault(m.group(1), []).append(m)
  return spans


def run(
  root: Path | None = None,
  *,
  write: bool,
  blocks: Sequence[Block] = BLOCKS,
) -> list[str]:
  """Checks (``write=False``) or rewrites every block of ``blocks``; returns
  the problems (for a check: every block that differs from its file, and
  every marker that is unknown, unclosed, repeated or on a page its block
  does not name)."""
  root = ROOT if root is None else root
  problems = []
  by_name = {b.name: b for b in BLOCKS}
  rendered = {b.name: b.text(b.load(root)) for b in blocks}
  for page in pages(root):
    rel = page.relative_to(root).as_posix()
    text = page.read_text()
    spans = _spans(text)
    for name in _BEGIN.findall(text):
      if name not in spans:
        problems.append(f"{rel}: block {name!r} has no end marker")
    for name, found in spans.items():
      block = by_name.get(name)
      if block is None:
        problems.append(f"{rel}: unknown block {name!r} (not in BLOCKS)")
      elif rel not in block.pages:
        problems.append(f"{rel}: block {name!r} is not registered for it")
      elif len(found) > 1:
        problems.append(f"{rel}: block {name!r} appears {len(found)} times")
    new = text
    for block in blocks:
      if rel not in block.pages:
        continue
      found = spans.get(block.name, [])
      if not found:
        problems.append(f"{rel}: block {block.name!r} is missing")
        continue
      if found[0].group(0) != rendered[block.name]:
        if write:
          new = new.replace(found[0].group(0), rendered[block.name])
        else:
          problems.append(
            f"{rel}: block {block.name!r} differs from what"
            f" {', '.join(block.sources)} gives (run {COMMAND})"
          )
    if write and new != text:
      page.write_text(new)
      print(f"{COMMAND}: rewrote {rel}")
  for block in blocks:
    for page in block.pages:
      if not (root / page).exists():
        problems.append(f"{page}: page of block {block.name!r} not found")
  if blocks is BLOCKS:
    problems += report(root, write=write)
  return problems


def report(root: Path | None = None, *, write: bool) -> list[str]:
  """The whole report :mod:`benchmarks._report` writes from ``latest.json``:
  ``latest.md`` and the results block at the end of benchmarks/README.md
  (its own markers), checked (or rewritten) the same way."""
  from benchmarks import _report  # noqa: PLC0415

  root = ROOT if root is None else root
  results = json.loads((root / LATEST).read_text())
  problems = []
  md = root / "benchmarks" / "results" / "latest.md"
  expected = _report.markdown(results)
  if md.read_text() != expected:
    if write:
      md.write_text(expected)
    else:
      problems.append(
        f"{md.relative_to(root).as_posix()}: differs from what {LATEST}"
        f" gives (run {COMMAND})"
      )
  page = root / "benchmarks" / "README.md"
  text = page.read_text()
  if _report.README_BEGIN not in text or _report.README_END not in text:
    return [*problems, "benchmarks/README.md: the results block is missing"]
  head, rest = text.split(_report.README_BEGIN, 1)
  body, tail = rest.split(_report.README_END, 1)
  block = _report.markdown(results, image_prefix="results/", heading="##")
  if body != f"\n\n{block}\n":
    if write:
      page.write_text(
        f"{head}{_report.README_BEGIN}\n\n{block}\n{_report.README_END}{tail}"
      )
    else:
      problems.append(
        "benchmarks/README.md: the results block (RESULTS:BEGIN) differs"
        f" from what {LATEST} gives (run {COMMAND})"
      )
  return problems


def check(
  root: Path | None = None, blocks: Sequence[Block] = BLOCKS
) -> list[str]:
  """Every problem :func:`run` finds, changing nothing."""
  return run(root, write=False, blocks=blocks)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog=f"{COMMAND}", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument(
    "--check",
    action="store_true",
    help="rewrite nothing; exit 1 naming every block that differs from its"
    " results file",
  )
  args = parser.parse_args(argv)
  problems = run(write=not args.check)
  for p in problems:
    print(p, file=sys.stderr)
  if not problems:
    print(
      f"{COMMAND}: {len(BLOCKS)} blocks, latest.md and the report block of"
      " benchmarks/README.md match their results files"
    )
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
