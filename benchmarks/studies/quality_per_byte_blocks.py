"""The tables of section 8 (:mod:`benchmarks.studies.quality_per_byte`,
the byte-level LM) in README.md and benchmarks/README.md, from
``benchmarks/results/latest.json``.

:data:`BLOCKS` registers them with :mod:`benchmarks.blocks`; :data:`LM_ROWS`
(the README's words for section 8's methods) also names the rows of the
accelerator's frontier (:mod:`benchmarks.accelerator_blocks`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from benchmarks._blocks_format import LATEST
from benchmarks._blocks_format import Block
from benchmarks._blocks_format import fraction
from benchmarks._blocks_format import section_provenance
from benchmarks._blocks_format import table

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


def frontier_table(rows: Sequence[Sequence]) -> str:
  """The LM's methods, one row each: words, MB sent, the fraction of
  sync's bytes, final val bits/byte, the change against sync (README's
  table of section 8, and of the accelerator's run of the same LM)."""
  return table(
    ["method", "MB sent", "vs sync", "val bits/byte", "Δ vs sync"],
    rows,
    "lrrrr",
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
    + frontier_table(rows)
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
      counted = re.search(r"\((\d+) rows\): ", note)
      rows = int(counted.group(1)) if counted else note.count("--only")
      plural = "s" if rows != 1 else ""
      parts.append(f"{date} {time} UTC, commit {commit}, {rows} row{plural}")
  if not parts:
    return ""
  return (
    " Rows added later by `python -m benchmarks.studies.quality_per_byte"
    " --only LABEL --add-to benchmarks/results/latest.json` (or `--merge"
    " SECTION_JSON`, rows run apart; the commands in section 8's notes): "
    + "; ".join(parts)
    + "."
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


BLOCKS = (
  Block("lm-frontier", (LATEST,), render_lm_frontier, ("README.md",)),
  Block(
    "lm-what-breaks",
    (LATEST,),
    render_lm_what_breaks,
    ("benchmarks/README.md",),
  ),
)
