"""A pytest plugin that writes a per-property table of a hypothesis run.

``tests/conftest.py`` registers it when ``FUZZ_REPORT=PATH`` is set (``make
fuzz`` sets it). For every test that ran hypothesis (directly, or through an
inner ``@given`` function as ``tests/test_properties.py`` does) it records,
from hypothesis's own run statistics:

* examples: test cases hypothesis generated and ran to the end (valid or
  failing);
* discarded: draws hypothesis threw away before they became a test case
  (``assume``/``filter`` rejections, and "overruns": choice sequences its
  generator cut short; these cost no test body run);
* failures: failing examples found (hypothesis stops at the first one, as
  neither profile shrinks);
* time: the test's wall time (setup of shared state included);

and writes them as a markdown table to PATH when the session ends (under
``pytest-xdist`` the workers send their figures to the controller with the
test reports). The statistics come from ``hypothesis.statistics.collector``,
the hook behind ``--hypothesis-show-statistics``.
"""

from __future__ import annotations

import datetime
import os
import platform
import time

import pytest

_KEY = "hypothesis_fuzz"


class FuzzReport:
  """Collects hypothesis statistics per test; writes the table at the end."""

  def __init__(self, path: str):
    self.path = path
    self.rows = {}
    self.started = time.time()

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_call(self, item):
    from hypothesis.statistics import collector

    runs = []
    with collector.with_value(runs.append):
      yield
    if runs:
      cases = [
        case
        for run in runs
        for case in run.get("generate-phase", {}).get("test-cases", [])
      ]
      statuses = [case["status"] for case in cases]
      item.user_properties.append(
        (
          _KEY,
          {
            "examples": sum(s in ("valid", "interesting") for s in statuses),
            "discarded": sum(s in ("invalid", "overrun") for s in statuses),
            "failures": sum(s == "interesting" for s in statuses),
            "stopped": "; ".join(
              sorted({run.get("stopped-because", "") for run in runs} - {""})
            ),
          },
        )
      )

  def pytest_runtest_logreport(self, report):
    if report.when == "call":
      for key, figures in report.user_properties:
        if key == _KEY:
          self.rows[report.nodeid] = dict(
            figures, outcome=report.outcome, seconds=report.duration
          )
    if report.failed and report.nodeid not in self.rows:
      # No statistics came back: a failure outside hypothesis's run, or an
      # xdist worker that died. It must show in the table, not vanish.
      first = str(report.longrepr).strip().splitlines()
      self.rows[report.nodeid] = dict(
        examples=0,
        discarded=0,
        failures=1,
        stopped="",
        seconds=report.duration,
        outcome=f"failed ({report.when}: {first[-1] if first else '?'})"[:160],
      )

  def pytest_sessionfinish(self, session):
    if hasattr(session.config, "workerinput"):  # an xdist worker
      return
    from hypothesis import settings

    profile = settings.get_current_profile_name()
    examples = settings.default.max_examples
    rows = sorted(self.rows.items())
    total_s = time.time() - self.started
    lines = [
      f"# Fuzz results (hypothesis profile `{profile}`,"
      f" max_examples {examples})",
      "",
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC},"
      f" {platform.node()}, {os.cpu_count()} CPUs;"
      f" {len(rows)} properties, {sum(r['examples'] for _, r in rows)}"
      f" examples, {sum(r['failures'] for _, r in rows)} failures,"
      f" wall {total_s:.0f} s.",
      "",
      "| Property | Examples | Discarded | Failures | Time (s) | Outcome |"
      " Stopped because |",
      "|---|---:|---:|---:|---:|---|---|",
    ]
    for nodeid, r in rows:
      lines.append(
        f"| `{nodeid}` | {r['examples']} | {r['discarded']} |"
        f" {r['failures']} | {r['seconds']:.1f} | {r['outcome']} |"
        f" {r['stopped'] or '-'} |"
      )
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    with open(self.path, "w") as f:
      f.write("\n".join(lines) + "\n")
    session.config.get_terminal_writer().line(
      f"\nfuzz report ({len(rows)} properties) written to {self.path}"
    )
