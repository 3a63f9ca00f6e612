"""The docs site covers the API: every exported name has an entry.

``make docs`` builds the site with ``-W`` and ``nitpicky`` (CI runs it); these
tests catch, in the fast suite, what that build cannot: a name added to
``shardopt.__all__`` without an entry in ``docs/api/*.rst`` builds cleanly but
is missing from the reference.
"""

import pathlib
import re

import pytest

import shardopt

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
DIRECTIVE = re.compile(
  r"^\.\. auto(?:function|class|exception|data)::\s+(?:shardopt\.)?(\w+)", re.M
)


def _documented() -> dict:
  """Each name with an autodoc entry in docs/api/*.rst -> the files it is in."""
  found = {}
  for rst in sorted(API.glob("*.rst")):
    for name in DIRECTIVE.findall(rst.read_text()):
      found.setdefault(name, []).append(rst.name)
  return found


def _toctree(index_text: str) -> list:
  block = index_text.split(".. toctree::", 1)[1]
  lines = block.split("\n\n", 2)[1]  # after the options, before the next gap
  return [line.strip() for line in lines.splitlines() if line.strip()]


@pytest.mark.parametrize("name", sorted(shardopt.__all__))
def test_every_exported_name_has_an_api_entry(name):
  assert name in _documented(), (
    f"shardopt.{name} is exported but has no `.. autofunction:: {name}` (or"
    " autoclass/autoexception) in docs/api/*.rst; see"
    " docs/CONTRIBUTING-docs.md"
  )


def test_no_name_is_documented_twice_or_without_being_exported():
  documented = _documented()
  assert {n: f for n, f in documented.items() if len(f) > 1} == {}
  assert sorted(set(documented) - set(shardopt.__all__)) == []


def test_every_api_page_is_in_the_api_toctree():
  pages = _toctree((API / "index.rst").read_text())
  assert sorted(pages) == sorted(
    p.stem for p in API.glob("*.rst") if p.stem != "index"
  )


def test_getting_started_shows_the_readmes_first_example():
  first_block = re.compile(r"```python\n(.*?)```", re.S)
  readme = first_block.search((ROOT / "README.md").read_text()).group(1)
  page = first_block.search(
    (ROOT / "docs" / "getting_started.md").read_text()
  ).group(1)
  assert page == readme, (
    "docs/getting_started.md must show README.md's first python example"
    " verbatim (copy it over)"
  )
