"""Every generated results table matches the committed file it comes from.

``python -m benchmarks.blocks --check``, in process: each marked block of
README.md, docs/*.md and benchmarks/README.md must be exactly what its
renderer gives from its results file, so a table edited by hand, or a
results file rerun without rewriting the pages, fails here naming the block.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import blocks  # noqa: E402
from benchmarks.perf import elastic_blocks  # noqa: E402
from benchmarks.studies import outer_sweep_blocks  # noqa: E402

BY_NAME = {b.name: b for b in blocks.BLOCKS}


def test_every_block_matches_its_results_file():
  problems = blocks.check()
  assert not problems, (
    "results blocks out of date (fix: python -m benchmarks.blocks):\n"
    + "\n".join(problems)
  )


def test_every_blocks_module_is_registered():
  """Each ``*_blocks.py`` beside a script is in :data:`blocks.MODULES`
  (a module left out would render nothing, and its markers would fail the
  check as unknown)."""
  found = {
    path.relative_to(ROOT).as_posix()
    for folder in ("benchmarks", "examples")
    for path in (ROOT / folder).rglob("*_blocks.py")
  }
  registered = {
    Path(m.__file__).resolve().relative_to(ROOT).as_posix()
    for m in blocks.MODULES
  }
  assert found == registered, (found - registered, registered - found)


def test_the_check_imports_no_jax():
  """The renderers live beside scripts that import JAX (some set XLA_FLAGS
  at import time); the registry imports only the renderers, so loading it
  in a fresh process loads no JAX."""
  code = "import sys, benchmarks.blocks; print('jax' in sys.modules)"
  proc = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == "False", proc.stdout


def test_every_results_file_and_page_of_the_registry_exists():
  for block in blocks.BLOCKS:
    for source in block.sources:
      assert (ROOT / source).is_file(), (block.name, source)
    for page in block.pages:
      assert (ROOT / page).is_file(), (block.name, page)
      text = (ROOT / page).read_text()
      assert text.count(block.begin()) == 1, (block.name, page)
      assert text.count(block.end()) == 1, (block.name, page)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_each_block_names_command_date_and_commit(name):
  """The first line inside a block says what produced its numbers."""
  block = BY_NAME[name]
  first = block.render(block.load()).strip().splitlines()[0]
  assert first.startswith("_") and first.endswith("._"), first
  assert "`python " in first, first  # the command
  assert " UTC" in first, first  # the date
  assert "commit " in first, first  # the commit, or where to find it
  for source in block.sources:
    assert Path(source).name in first, (source, first)


def test_a_changed_results_file_changes_the_block():
  """The renderer reads the numbers: change one, and the block changes."""
  block = BY_NAME["demo"]
  (data,) = block.load()
  before = block.text([data])
  changed = copy.deepcopy(data)
  sync = next(m for m in changed["methods"] if m["method"] == "sync")
  assert f"{sync['test_accuracy']:.1%}" in before
  sync["test_accuracy"] = 0.123
  after = block.text([changed])
  assert after != before
  assert "| 12.3% |" in after and "| 12.3% |" not in before
  changed["commit"] = "abcdef0"
  assert "commit abcdef0" in " ".join(block.text([changed]).split())


def test_the_guard_table_reads_every_run():
  """A ratio of the second run shows in the README's lowest-highest range."""
  block = BY_NAME["guards"]
  (data,) = block.load()
  changed = copy.deepcopy(data)
  floor = next(
    c
    for c in changed["runs"][1]["comparisons"].values()
    if c["group"] == "floor" and not c["donated"]
  )
  floor["ratio"] = 9.87
  assert "-9.87 /" in block.text([changed])
  assert "-9.87 /" not in block.text([data])


def _copy_tree(tmp_path: Path) -> Path:
  """The pages and results files the blocks read, under ``tmp_path``."""
  paths = {"benchmarks/results/latest.md"}
  for block in blocks.BLOCKS:
    paths.update(block.sources, block.pages)
  for path in paths:
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / path, tmp_path / path)
  return tmp_path


def test_the_check_names_a_stale_block_and_the_writer_fixes_it(tmp_path):
  root = _copy_tree(tmp_path)
  assert blocks.check(root) == []
  source = root / elastic_blocks.ROUND_BYTES
  data = json.loads(source.read_text())
  data["round_bytes_per_island"]["4"] += 1000
  stale = f"{data['round_bytes_per_island']['4']:,.0f}"  # what is written
  source.write_text(json.dumps(data))
  problems = blocks.check(root)
  assert len(problems) == 1, problems
  assert "'elastic-round-bytes'" in problems[0]
  assert "docs/elastic.md" in problems[0]
  # The writer rewrites that block in place, and nothing else.
  page = root / "docs" / "elastic.md"
  before = page.read_text()
  assert blocks.run(root, write=True) == []
  after = page.read_text()
  assert stale in after and stale not in before
  assert before.count("\n") == after.count("\n")
  assert blocks.check(root) == []


def test_the_check_names_a_hand_edited_block_and_stray_markers(tmp_path):
  root = _copy_tree(tmp_path)
  readme = root / "README.md"
  text = readme.read_text()
  readme.write_text(text.replace("| sync (`cross_shard`) |", "| sync |", 1))
  (root / "docs" / "extra.md").write_text(
    "<!-- results:nonesuch (x) -->\n\n<!-- /results:nonesuch -->\n"
    "<!-- results:demo (x) -->\n<!-- /results:demo -->\n"
  )
  problems = blocks.check(root)
  assert any("README.md: block 'demo' differs" in p for p in problems)
  assert any("unknown block 'nonesuch'" in p for p in problems)
  assert any(
    "docs/extra.md: block 'demo' is not registered" in p for p in problems
  )


def test_main_check_exits_nonzero_naming_the_block(
  tmp_path, monkeypatch, capsys
):
  root = _copy_tree(tmp_path)
  page = root / "docs" / "diloco.md"
  page.write_text(page.read_text().replace("| 16 |", "| 17 |", 1))
  monkeypatch.setattr(blocks, "ROOT", root)
  assert blocks.main(["--check"]) == 1
  err = capsys.readouterr().err
  assert "docs/diloco.md: block 'outer-lm' differs" in err, err
  assert page.read_text().count("| 17 |") == 1  # --check wrote nothing
  assert blocks.main([]) == 0  # the writer puts it back
  assert blocks.main(["--check"]) == 0
  assert "| 17 |" not in page.read_text()


def test_the_check_covers_the_report_of_latest_json(tmp_path):
  """latest.md and benchmarks/README.md's results block (python -m
  benchmarks.run writes both) must be what latest.json gives, too."""
  root = _copy_tree(tmp_path)
  md = root / "benchmarks" / "results" / "latest.md"
  md.write_text(md.read_text().replace("|", "| ", 1))
  page = root / "benchmarks" / "README.md"
  text = page.read_text()
  end = text.index("<!-- RESULTS:END -->")
  page.write_text(text[:end] + "a hand edit\n" + text[end:])
  problems = blocks.check(root)
  assert len(problems) == 2, problems
  assert "latest.md: differs" in problems[0]
  assert "the results block (RESULTS:BEGIN) differs" in problems[1]
  assert blocks.run(root, write=True) == []
  assert blocks.check(root) == []
  assert "a hand edit" not in page.read_text()


def test_an_outer_sweep_file_without_its_command_gets_it_rebuilt():
  """Older outer_sweep files record no command: the block rebuilds it from
  their settings (flags only where they differ from the defaults, --name
  from the file), and a recorded command wins."""
  (sweep,) = BY_NAME["outer-sweep"].load()
  command = outer_sweep_blocks.outer_sweep_command
  assert command(sweep, outer_sweep_blocks.OUTER_SWEEP) == (
    "python -m benchmarks.studies.outer_sweep --seeds 2 --end-fraction 0.1"
  )
  batch4, batch16 = BY_NAME["outer-batch"].load()
  assert command(batch16, outer_sweep_blocks.OUTER_BATCH[1]) == (
    "python -m benchmarks.studies.outer_sweep --periods 16"
    ' --outer "0.7,0.9;1,0" --batch-per-replica 16 --name outer_sweep_batch16'
  )
  recorded = dict(batch4, command="python -m benchmarks.studies.outer_sweep X")
  assert command(recorded, "any") == recorded["command"]


def test_the_outer_sweep_table_reads_each_run():
  block = BY_NAME["outer-sweep"]
  (data,) = block.load()
  changed = copy.deepcopy(data)
  plain = changed["runs"]["diloco H=64, outer lr 1.0 momentum 0.0"]
  plain["final_mean"] = 9.876
  assert "| 9.876 ± 0.035 |" in block.text([changed])
  assert "9.876" not in block.text([data])
