"""What every results block's renderer uses: :class:`Block` and the
formatting helpers.

A renderer sits beside the script that writes its results file
(``benchmarks/perf/elastic_blocks.py`` beside ``benchmarks/perf/elastic.py``)
and builds its table with these: :func:`provenance` (or
:func:`top_provenance`, :func:`section_provenance`) for the block's first
line, :func:`table` for the Markdown table, :func:`fraction`,
:func:`spread` and :func:`when` for the cells. :mod:`benchmarks.blocks`
collects the blocks and writes (or checks) the pages. Nothing here imports
JAX: ``python -m benchmarks.blocks --check`` stays cheap.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m benchmarks.blocks"
WIDTH = 100  # the pages' prose width
# The report :mod:`benchmarks.run` writes; several blocks read its sections.
LATEST = "benchmarks/results/latest.json"


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
