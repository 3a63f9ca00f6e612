"""A docs page's python blocks, run as a reader runs them: in order, in one
namespace (tests/test_guides.py and the method pages' own tests)."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def blocks(page: str) -> list:
  """The python code blocks of docs/<page>.md, in order."""
  text = (DOCS / f"{page}.md").read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_page(page: str) -> dict:
  """Runs every python block of docs/<page>.md in one namespace."""
  namespace = {}
  for index, block in enumerate(blocks(page)):
    code = compile(block, f"docs/{page}.md[python block {index}]", "exec")
    exec(code, namespace)
  return namespace
