"""Every docstring example in the package, in every module and submodule,
runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import shardopt

# Every module, the submodules of the packages (wire, periodic, elastic,
# measure) included.
MODULES = sorted(
  m.name
  for m in pkgutil.walk_packages(shardopt.__path__, "shardopt.")
  if m.name != "shardopt.__main__"
)


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
  module = importlib.import_module(module_name)
  result = doctest.testmod(
    module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.failed == 0, (
    f"{result.failed} doctest(s) failed in {module_name}"
  )
