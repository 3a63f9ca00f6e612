"""Every ``shardopt.<name>`` a page or a public docstring mentions exists.

A user who reads ``shardopt.quantize`` in a docstring and types it finds a
private module, not the public ``shardopt.quantized`` (issue 35). So: a public
name (no part starting with ``_``) must be in ``shardopt.__all__`` (or a
public subpackage's ``__all__``); a private one a page names on purpose (the
reliability page points into the implementation) must at least import.
"""

import importlib
import inspect
import pathlib
import re

import pytest

import shardopt
import shardopt.elastic

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(
  [ROOT / "README.md", *(ROOT / "docs").glob("*.md")],
  key=lambda p: p.name,
)
SUBPACKAGES = {
  "elastic": shardopt.elastic,
  "measure": shardopt.measure,
  "wire": shardopt.wire,
}
# The one internal door (shardopt.measure's docstring): the benchmarks' and
# the tests' HLO reader, named on purpose, not public API; a mention of it
# (or of one of its names) must import, as a private path must.
INTERNAL = ("measure.hlo",)
MENTION = re.compile(r"(?<![\w.])shardopt((?:\.[A-Za-z_]\w*)+)")


def _resolves(parts: list) -> bool:
  """Whether ``shardopt.<parts>`` imports (a module) or is an attribute."""
  obj = shardopt
  for i, part in enumerate(parts):
    if hasattr(obj, part):
      obj = getattr(obj, part)
      continue
    try:
      obj = importlib.import_module("shardopt." + ".".join(parts[: i + 1]))
    except ImportError:
      return False
  return True


def unknown_names(text: str) -> list:
  """The ``shardopt.<...>`` mentions of ``text`` that name no public (or,
  for a private path, no existing) object."""
  bad = []
  for match in MENTION.finditer(text):
    parts = match.group(1).split(".")[1:]
    internal = ".".join(parts[:2]) in INTERNAL
    if internal or any(p.startswith("_") for p in parts):
      if not _resolves(parts):
        bad.append(match.group(0))
      continue
    head = parts[0]
    if head not in shardopt.__all__ and head not in SUBPACKAGES:
      bad.append(match.group(0))
    elif head in SUBPACKAGES and len(parts) > 1:
      if parts[1] not in SUBPACKAGES[head].__all__:
        bad.append(match.group(0))
  return sorted(set(bad))


def _public_docstrings():
  """(qualified name, docstring) of every public object and its members."""
  for module in (shardopt, *SUBPACKAGES.values()):
    for name in module.__all__:
      obj = getattr(module, name)
      yield f"{module.__name__}.{name}", inspect.getdoc(obj) or ""
      if inspect.isclass(obj):
        for member, value in vars(obj).items():
          if not member.startswith("_") and callable(value):
            qual = f"{module.__name__}.{name}.{member}"
            yield qual, inspect.getdoc(value) or ""


def test_the_checker_flags_a_private_module_named_as_public():
  assert unknown_names("see ``shardopt.quantize``") == ["shardopt.quantize"]
  assert unknown_names("shardopt.quantized(jnp.int8)") == []
  assert unknown_names("shardopt.elastic.Island and shardopt.elastic.X") == [
    "shardopt.elastic.X"
  ]
  assert unknown_names("shardopt._no_such_module.f") == [
    "shardopt._no_such_module.f"
  ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_name_a_page_mentions_exists(page):
  assert unknown_names(page.read_text()) == [], page.name


def test_every_name_a_public_docstring_mentions_exists():
  bad = {q: b for q, doc in _public_docstrings() if (b := unknown_names(doc))}
  assert bad == {}


def test_no_public_signature_takes_a_private_keyword():
  """A keyword starting with ``_`` (``reduce(_error=)`` once changed the
  return type) is not part of a public signature."""
  offenders = []
  for module in (shardopt, *SUBPACKAGES.values()):
    for name in module.__all__:
      obj = getattr(module, name)
      if not callable(obj):
        continue
      try:
        params = inspect.signature(obj).parameters
      except (TypeError, ValueError):
        continue
      offenders += [f"{name}({p}=)" for p in params if p.startswith("_")]
  assert offenders == []
