"""The fast tier's recorded timing is current, and within its budget.

``python tests/fast_tier.py`` times ``make test-fast`` and writes
tests/fast_tier.json and README.md's fast-tier block. These tests fail when
the block was edited by hand (or the JSON without the block), when the tier
now holds a different number of tests than the JSON counted (a test was
added to or moved out of the tier since it was timed: time it again on a
quiet machine), or when the recorded run took over 3 minutes (move slow
tests to the slow tier, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shlex

import conftest
import fast_tier
import pytest


@pytest.fixture(scope="module")
def record():
  if os.environ.get(fast_tier.TIMING):
    pytest.skip("tests/fast_tier.py is timing the tier: it rewrites the record")
  if not fast_tier.RECORD.exists():
    pytest.fail(
      "tests/fast_tier.json is missing; run python tests/fast_tier.py"
    )
  return json.loads(fast_tier.RECORD.read_text())


def test_the_readme_block_is_what_the_json_renders(record):
  block = fast_tier.readme_block(fast_tier.README.read_text())
  assert block == fast_tier.render(record), (
    "README.md's fast-tier block differs from tests/fast_tier.json; fix:"
    " python tests/fast_tier.py --render (or time the tier again: python"
    " tests/fast_tier.py)"
  )


def test_the_recorded_run_passed_within_3_minutes(record):
  # tests/fast_tier.py writes only a run without failures or errors.
  assert 0 < record["passed"] <= record["tests"], record
  assert record["seconds"] <= fast_tier.BUDGET_S == 180, (
    f"tests/fast_tier.json: make test-fast took {record['seconds']} s, over"
    " the 3-minute budget; move slow tests to the slow tier"
    " (tests/conftest.py) and time it again (python tests/fast_tier.py)"
  )


def test_the_recorded_command_is_make_test_fasts(record):
  argv = fast_tier.command("python")
  assert argv[1:] == record["argv"], (argv, record["argv"])
  # The tier is the suite less the slow marker, on 2 workers.
  assert shlex.join(argv[1:]).endswith("-m 'not slow' tests"), argv
  assert argv[argv.index("-n") + 1] == "2", argv


def test_the_recorded_count_is_the_tiers_count_now(record, request):
  """conftest.py counts the tier when this run collected every test file
  (make test, make test-fast); otherwise a fresh process collects it."""
  now = request.config.stash.get(conftest.FAST_TIER_COUNT, None)
  if now is None:
    now = fast_tier.collected_now()
  assert record["tests"] == now, (
    f"make test-fast now runs {now} tests; tests/fast_tier.json timed"
    f" {record['tests']}. Time the tier again on a quiet machine: python"
    " tests/fast_tier.py"
  )


def test_the_summary_line_is_read_with_every_outcome():
  """The parser against pytest's summary lines written out here."""
  line = (
    "= 1031 passed, 2 skipped, 505 deselected, 1 xfailed, 3 warnings in"
    " 152.31s (0:02:32) ="
  )
  counts = fast_tier.outcomes("collected\n" + line + "\n")
  assert counts == {
    "passed": 1031,
    "skipped": 2,
    "deselected": 505,
    "xfailed": 1,
    "warnings": 3,
  }
  assert fast_tier.outcomes("= 1 failed, 1 error in 3.00s =") == {
    "failed": 1,
    "errors": 1,
  }
