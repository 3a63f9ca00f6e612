"""benchmarks/README.md section 8b's tables, from the files
:mod:`benchmarks.studies.outer_sweep` writes.

:data:`BLOCKS` registers them with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import provenance
from benchmarks._blocks_format import table

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


BLOCKS = (
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
)
