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

Everything between the two markers is generated: edit the block's renderer
(or rerun the measurement), not the page. The first line inside names the
command, the date (UTC) and the commit that produced the numbers, read from
the results file (``command``; ``measured_utc``, ``date``, ``started_utc``
or ``date_utc``; ``commit`` or ``git_commit``); a file that does not record
its commit says so, and ``git log -- FILE`` tells which commit added it.

A renderer sits beside the script that writes its results file, in a module
named after it with ``_blocks`` added: ``benchmarks/perf/elastic.py``
writes ``elastic*.json``, ``benchmarks/perf/elastic_blocks.py`` renders
them. Each such module exports ``BLOCKS``, its :class:`Block` entries, and
imports no JAX (the scripts beside them do, some at import time);
:data:`MODULES` lists them, and :data:`BLOCKS` is their entries in that
order. :mod:`benchmarks._blocks_format` holds :class:`Block` and the
helpers every renderer shares (:func:`~benchmarks._blocks_format.table`,
:func:`~benchmarks._blocks_format.provenance`, ...). To add a table: write
the renderer (results file -> Markdown) in the ``_blocks`` module beside
the script (a new module goes into :data:`MODULES`), add a :class:`Block`
to its ``BLOCKS``, put the two markers (empty between them) where the table
goes, run ``python -m benchmarks.blocks``.

The same command checks (or rewrites) what :mod:`benchmarks._report`
writes from ``benchmarks/results/latest.json``: ``latest.md`` and the
results block at the end of benchmarks/README.md (its own markers).

The check reads only the results files and the pages (no git, no JAX, bar
the DiLoCo outer-step tables, which reuse
:mod:`benchmarks.studies.outer_defaults`'s renderers and so import it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import accelerator_blocks
from benchmarks._blocks_format import COMMAND
from benchmarks._blocks_format import LATEST
from benchmarks._blocks_format import ROOT
from benchmarks._blocks_format import Block
from benchmarks.perf import cost_guards_blocks
from benchmarks.perf import elastic_blocks
from benchmarks.perf import quantized_blocks
from benchmarks.perf import step_bytes_blocks
from benchmarks.studies import convergence_blocks
from benchmarks.studies import outer_defaults_blocks
from benchmarks.studies import outer_sweep_blocks
from benchmarks.studies import quality_per_byte_blocks
from benchmarks.studies import quantized_quality_blocks
from examples import demo_blocks

# The pages scanned for markers (a block in any other file is not checked).
PAGES = ("README.md", "benchmarks/README.md", "docs/*.md")
# Every module of renderers, each beside the script that writes its files.
MODULES = (
  demo_blocks,
  quality_per_byte_blocks,
  convergence_blocks,
  outer_defaults_blocks,
  outer_sweep_blocks,
  quantized_quality_blocks,
  cost_guards_blocks,
  elastic_blocks,
  quantized_blocks,
  step_bytes_blocks,
  accelerator_blocks,
)
BLOCKS: tuple[Block, ...] = tuple(b for m in MODULES for b in m.BLOCKS)

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
