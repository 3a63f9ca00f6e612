"""Hypothesis profiles for shardopt's property tests: ``ci`` and ``thorough``.

* ``ci`` (the default): every property draws the number of examples its test
  asks for (5 to 30), so ``make test`` stays fast. Derandomized: CI draws the
  same examples on every run.
* ``thorough``: every property draws at least ``THOROUGH_EXAMPLES`` (500)
  examples, from a fresh random seed on each run (``--hypothesis-seed=N``
  fixes it). A failure prints an ``@reproduce_failure(...)`` line: put it on
  the failing ``@given`` function to replay that example. ``make fuzz`` runs
  the property tests under it and writes a per-property table.

Select a profile with the environment variable ``HYPOTHESIS_PROFILE=thorough``
(read when ``tests/conftest.py`` imports this module) or pytest's own
``--hypothesis-profile=thorough``. A property sizes itself with
``settings_for(ci_examples)``.

Neither profile shrinks: a failing example is reported as it was generated
(the examples are small already, and shrinking one that compiles a new XLA
program per attempt can take minutes). Neither keeps an example database:
a failure worth keeping becomes an ``@example(...)`` regression in the test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import settings

CI = "ci"
THOROUGH = "thorough"
THOROUGH_EXAMPLES = 500
ENV_VAR = "HYPOTHESIS_PROFILE"

_COMMON = dict(
  deadline=None,  # the first example of a shape compiles
  database=None,
  phases=[Phase.explicit, Phase.generate],
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
  print_blob=True,
)

# max_examples of ``ci`` is only the default for a property that does not
# size itself with ``settings_for``: keep such properties cheap too.
settings.register_profile(CI, max_examples=10, derandomize=True, **_COMMON)
settings.register_profile(
  THOROUGH, max_examples=THOROUGH_EXAMPLES, derandomize=False, **_COMMON
)
settings.load_profile(os.environ.get(ENV_VAR, CI))


def current() -> str:
  """The name of the loaded profile (``ci`` unless one was selected)."""
  return settings.get_current_profile_name()


def examples(ci_examples: int) -> int:
  """How many examples a property whose CI size is ``ci_examples`` draws.

  Its own size under ``ci``; at least the profile's ``max_examples`` (500
  under ``thorough``) under any other profile.
  """
  if current() == CI:
    return ci_examples
  return max(ci_examples, settings.default.max_examples)


def settings_for(ci_examples: int) -> settings:
  """``@settings`` for a property: the loaded profile, sized by ``examples``."""
  return settings(settings.default, max_examples=examples(ci_examples))
