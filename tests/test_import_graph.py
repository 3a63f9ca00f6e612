"""No import circle in src/shardopt: every ``import`` of a shardopt module,
at the top of a file or inside a function, forms an acyclic graph."""

import ast
import pathlib

import shardopt

SRC = pathlib.Path(shardopt.__file__).parent


def _modules() -> dict:
  out = {}
  for f in SRC.rglob("*.py"):
    parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = f
  return out


def import_graph() -> dict:
  """Module -> the shardopt modules it imports (``from shardopt.a import b``
  imports ``shardopt.a.b`` if that is a module, else ``shardopt.a``)."""
  modules = _modules()

  def resolve(name: str) -> str:
    while name and name not in modules:
      name = name.rsplit(".", 1)[0] if "." in name else ""
    return name

  edges = {m: set() for m in modules}
  for m, f in modules.items():
    for node in ast.walk(ast.parse(f.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [resolve(a.name) for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        base = node.module or ""
        for a in node.names:
          full = f"{base}.{a.name}"
          targets.append(full if full in modules else resolve(base))
      edges[m] |= {t for t in targets if t.startswith("shardopt") and t != m}
  return edges


def cycles(edges: dict) -> list:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges[v]):
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


def test_the_checker_finds_a_circle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
    ["a", "b", "c"]
  ]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_src():
  graph = import_graph()
  assert "shardopt.wire.blocks" in graph["shardopt.wire.sparse"]
  assert cycles(graph) == []
