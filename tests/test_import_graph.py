"""The floors of src/shardopt (docs/layers.md) hold, and nothing imports in a
circle.

The graph has an edge for every ``import`` of a shardopt module, at the top
of a file or inside a function, and one for every parent package whose
``__init__`` Python runs to import it (``from shardopt.periodic import
schedules`` runs ``shardopt/periodic/__init__.py`` first; a parent of the
importing module itself is already being imported and adds nothing).
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

import shardopt

SRC = pathlib.Path(shardopt.__file__).parent
LAYERS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "layers.md"
RULE = (
  "a module imports only modules on its own floor or a lower one"
  " (docs/layers.md)"
)


def _modules() -> dict:
  out = {}
  for f in SRC.rglob("*.py"):
    parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = f
  return out


def _parents(name: str) -> list:
  """``a.b.c`` -> ``["a.b", "a"]``."""
  parts = name.split(".")
  return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def parent_edges(importer: str, target: str) -> list:
  """The packages whose ``__init__`` Python runs to import ``target`` from
  ``importer``: ``target``'s parents, less those that hold ``importer``
  (Python is already importing them)."""
  mine = set(_parents(importer)) | {importer}
  return [p for p in _parents(target) if p not in mine]


def imports(modules: dict | None = None) -> list:
  """``(importer, target, via, function, line)`` for every import of a
  shardopt module: ``target`` the module imported, or a parent package
  Python runs for ``via`` (else ``via`` is ``target``); ``function`` the
  name of the function the import sits in (``""`` at the top level).
  ``from shardopt.a import b`` imports ``shardopt.a.b`` if that is a
  module, else ``shardopt.a``."""
  modules = _modules() if modules is None else modules

  def resolve(name: str) -> str:
    while name and name not in modules:
      name = name.rsplit(".", 1)[0] if "." in name else ""
    return name

  out = []
  for m, f in modules.items():
    tree = ast.parse(f.read_text())
    functions = {}
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
          functions.setdefault(id(node), fn.name)
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [resolve(a.name) for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        base = node.module or ""
        for a in node.names:
          full = f"{base}.{a.name}"
          targets.append(full if full in modules else resolve(base))
      where = functions.get(id(node), "")
      for t in targets:
        if not t.startswith("shardopt") or t == m:
          continue
        out.append((m, t, t, where, node.lineno))
        out += [(m, p, t, where, node.lineno) for p in parent_edges(m, t)]
  return out


def import_graph(edges: list | None = None) -> dict:
  """Module -> the shardopt modules it imports (parent packages included)."""
  edges = imports() if edges is None else edges
  graph = {m: set() for m in _modules()}
  for m, t, *_ in edges:
    graph.setdefault(m, set()).add(t)
  return graph


def cycles(edges: dict) -> list:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


# ------------------------------------------------------------- the floors


def _table(name: str) -> list:
  """The rows (lists of cells) of docs/layers.md's ``name`` table."""
  text = LAYERS.read_text()
  body = re.search(rf"<!-- {name}:.*?-->\n(.*?)<!-- /{name} -->", text, re.S)
  assert body, f"docs/layers.md has no <!-- {name}: --> table"
  rows = [
    [c.strip() for c in line.strip().strip("|").split("|")]
    for line in body.group(1).splitlines()
    if line.startswith("|")
  ]
  return [r for r in rows[2:]]  # past the header and the |---| line


def _module(cell: str) -> str:
  """A name of docs/layers.md (relative to src/shardopt) as a module."""
  name = cell.strip("`")
  return "shardopt" if name == "__init__" else f"shardopt.{name}"


def floors() -> dict:
  """``{package or module: (floor number, floor name)}`` from
  docs/layers.md."""
  out = {}
  for number, name, names, _ in _table("floors"):
    for module in re.findall(r"`[\w.]+`", names):
      out[_module(module)] = (int(number), name)
  return out


def exceptions() -> set:
  """``{(importer, imported, function)}`` the exceptions table allows."""
  return {
    (_module(m), _module(t), fn.strip("`"))
    for m, t, fn, _ in _table("exceptions")
  }


def floor_of(module: str, table: dict):
  """The floor of ``module``: its own row, else its nearest package's (the
  root package's row holds its ``__init__`` alone)."""
  for name in [module, *_parents(module)[:-1]]:
    if name in table:
      return table[name]
  return None


def upward(edges: list, table: dict, allowed: set = frozenset()) -> list:
  """A message for every import of ``edges`` from a lower floor to a higher
  one that ``allowed`` does not excuse."""
  out = []
  for m, t, via, fn, line in edges:
    if (m, t, fn) in allowed:
      continue
    if floor_of(m, table) is None or floor_of(t, table) is None:
      continue  # test_every_module_of_src_is_on_a_floor names it
    (low, low_name), (high, high_name) = floor_of(m, table), floor_of(t, table)
    if high <= low:
      continue
    how = "" if via == t else f" (Python runs its __init__ to import {via})"
    inside = f" in {fn}()" if fn else ""
    out.append(
      f"{m} (floor {low}, {low_name}) imports {t} (floor {high},"
      f" {high_name}){how}, line {line}{inside}: {RULE}"
    )
  return out


def test_the_checker_finds_a_circle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
    ["a", "b", "c"]
  ]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_counts_the_parent_packages_python_runs():
  # shardopt.wire.x importing shardopt.periodic.schedules runs
  # shardopt/periodic/__init__.py (not shardopt/__init__.py: it is running).
  assert parent_edges("shardopt.wire.x", "shardopt.periodic.schedules") == [
    "shardopt.periodic"
  ]
  assert parent_edges("shardopt.wire.sparse", "shardopt.wire.blocks") == []
  assert parent_edges("shardopt", "shardopt.elastic.rows") == [
    "shardopt.elastic"
  ]


def test_the_checker_fails_an_upward_import_naming_both_modules_and_the_rule():
  table = {"p.low": (1, "bottom"), "p.high": (2, "top")}
  edges = [
    ("p.high.a", "p.low.b", "p.low.b", "", 3),  # downward: fine
    ("p.low.b", "p.high", "p.high.c", "", 7),  # its parent's __init__
    ("p.low.d", "p.high.c", "p.high.c", "f", 9),  # inside a function
  ]
  assert upward(edges, table) == [
    "p.low.b (floor 1, bottom) imports p.high (floor 2, top) (Python runs"
    f" its __init__ to import p.high.c), line 7: {RULE}",
    f"p.low.d (floor 1, bottom) imports p.high.c (floor 2, top), line 9 in"
    f" f(): {RULE}",
  ]
  assert upward(edges, table, {("p.low.d", "p.high.c", "f")}) == [
    upward(edges, table)[0]
  ]
  assert floor_of("p", table) is None  # the root holds no submodule


def test_every_module_of_src_is_on_a_floor():
  table = floors()
  assert [m for m in _modules() if floor_of(m, table) is None] == []
  assert [m for m in table if m not in _modules()] == [], (
    "docs/layers.md names a module that src/shardopt does not have"
  )


def test_no_import_reaches_up_a_floor():
  edges = imports()
  allowed = exceptions()
  problems = upward(edges, floors(), allowed)
  assert not problems, "\n" + "\n".join(problems)
  found = {(m, t, fn) for m, t, _, fn, _ in edges}
  assert allowed <= found, (
    f"docs/layers.md excuses imports that no longer exist: {allowed - found};"
    " remove their rows"
  )


def test_no_import_circle_in_src():
  allowed = exceptions()
  edges = [e for e in imports() if (e[0], e[1], e[3]) not in allowed]
  graph = import_graph(edges)
  assert "shardopt.wire.blocks" in graph["shardopt.wire.sparse"]
  assert "shardopt.periodic" in graph["shardopt.measure.hlo"]  # its __init__
  circles = cycles(graph)
  assert not circles, "import circles: " + "; ".join(map(" <-> ".join, circles))


@pytest.mark.parametrize("module", ["shardopt.wire", "shardopt._axes"])
def test_the_low_floors_import_nothing_of_the_measuring_floor(module):
  graph = import_graph([e for e in imports() if e[3] != "__getattr__"])
  reach, todo = set(), [module]
  while todo:
    for t in graph.get(todo.pop(), ()):
      if t not in reach:
        reach.add(t)
        todo.append(t)
  assert not {m for m in reach if m.startswith("shardopt.measure")}
  assert "shardopt.periodic" not in reach


# A finder that refuses the demo's extras, as if they were not installed.
_WITHOUT_EXTRAS = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("sklearn", "matplotlib", "tqdm"):
      raise ImportError(f"{name} is not installed (refused by the test)")
sys.meta_path.insert(0, Refuse())
import shardopt, shardopt.measure, shardopt.elastic
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"sklearn",
    "matplotlib", "tqdm", "benchmarks", "examples"})
print(loaded, sorted(m for m in sys.modules if m.startswith("shardopt")))
"""


def test_import_shardopt_needs_none_of_the_demo_extras():
  """``import shardopt`` in a fresh process where scikit-learn, matplotlib
  and tqdm cannot be imported: it works, and loads none of them (nor the
  repository's benchmarks or examples)."""
  proc = subprocess.run(
    [sys.executable, "-c", _WITHOUT_EXTRAS],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  loaded, _, modules = proc.stdout.partition("] ")
  assert loaded == "[", proc.stdout
  assert "shardopt.measure.hlo" in modules
