"""Every command the docs quote resolves, as a user would type it.

README.md, docs/*.md and benchmarks/README.md quote commands in code blocks
and inline code: ``python -m MODULE ...``, ``python -c "..."``, ``python
PATH.py ...`` and ``make TARGET``; the benchmark results files
(``benchmarks/results/*.json``) name the command that wrote them. Each must
resolve today: the module can be found, the script exists, the make target
is in the Makefile, every ``import X`` / ``from X import Y`` of a ``-c``
snippet imports and has ``Y``, and a file a command is given
(``tests/test_x.py``) exists. Then
(``test_python_m_help_lists_every_quoted_option``) each distinct ``python
-m`` module's ``--help`` exits 0 in a fresh process and lists every
``--option`` the pages quote for it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(
  [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
  + list((ROOT / "docs").glob("*.md"))
)
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
# A fenced block whose commands are shell, not Python source.
SHELL_BLOCKS = ("", "text", "bash", "sh", "shell", "console")

_PYTHON = r"(?<![\w/.-])(?:[\w./-]*/)?python(?:3(?:\.\d+)?)?"
_M = re.compile(_PYTHON + r"\s+-m\s+([A-Za-z_][\w.]*)((?:[^\n#;|&`])*)")
_C = re.compile(_PYTHON + r"""\s+-c\s+(?:"((?:[^"\\]|\\.)*)"|'([^']*)')""")
_SCRIPT = re.compile(_PYTHON + r"\s+([\w./-]+\.py)\b")
_MAKE = re.compile(r"(?<![\w-])make\s+([a-z][\w-]*)")
_PATH_ARG = re.compile(
  r"(?<![\w/.-])((?:tests|benchmarks|examples|docs)/[\w./-]+)"
)


def _snippets(page: pathlib.Path) -> list[tuple[str, str]]:
  """(where, text) of every code span of a page: each line of a shell
  block, each inline code span (joined across a line break)."""
  text = page.read_text()
  name = page.relative_to(ROOT).as_posix()
  out = []
  fence = re.compile(r"^```([\w{}-]*)[^\n]*\n(.*?)^```", re.M | re.S)
  for block in fence.finditer(text):
    if block.group(1) in SHELL_BLOCKS:
      line0 = text.count("\n", 0, block.start(2)) + 1
      # Lines ending in a backslash continue the command.
      joined = block.group(2).replace("\\\n", " ")
      for i, line in enumerate(joined.splitlines()):
        out.append((f"{name}:{line0 + i}", line))
  prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
    line = prose.count("\n", 0, span.start()) + 1
    out.append((f"{name}:{line}", span.group(1).replace("\n", " ")))
  return out


def _result_commands() -> list[tuple[str, str]]:
  """(where, command) of every "command" a results file records."""
  out = []

  def walk(node, where):
    if isinstance(node, dict):
      for k, v in node.items():
        if k == "command" and isinstance(v, str):
          out.append((where, v))
        else:
          walk(v, where)
    elif isinstance(node, list):
      for v in node:
        walk(v, where)

  for path in RESULTS:
    walk(json.loads(path.read_text()), path.relative_to(ROOT).as_posix())
  return out


def _commands() -> dict[str, list]:
  """Every quoted command, by kind: "module" (name, args), "code",
  "script", "make", "path" (a file a command is given); each with where."""
  found = {k: [] for k in ("module", "code", "script", "make", "path")}
  snippets = [s for page in PAGES for s in _snippets(page)]
  for where, text in snippets + _result_commands():
    for m in _M.finditer(text):
      found["module"].append((where, m.group(1), m.group(2).strip()))
    for m in _C.finditer(text):
      code = m.group(1) if m.group(1) is not None else m.group(2)
      found["code"].append((where, code.replace('\\"', '"')))
    for m in _SCRIPT.finditer(text):
      found["script"].append((where, m.group(1)))
    if "python" in text or "pytest" in text:
      for m in _PATH_ARG.finditer(text):
        found["path"].append((where, m.group(1)))
  for where, text in snippets:
    for m in _MAKE.finditer(text):
      found["make"].append((where, m.group(1)))
  return found


COMMANDS = _commands()


def _make_targets() -> set:
  text = (ROOT / "Makefile").read_text()
  return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
  """`python -m benchmarks...` runs from the repository root."""
  monkeypatch.syspath_prepend(str(ROOT))
  monkeypatch.chdir(ROOT)


def test_the_pages_quote_commands_of_every_kind():
  """The extraction finds what the pages are known to quote (so that a
  broken pattern cannot make every other test here vacuous)."""
  modules = {m for _, m, _ in COMMANDS["module"]}
  assert {"benchmarks.run", "benchmarks.perf.elastic", "pytest"} <= modules
  assert any("cost.run" in code for _, code in COMMANDS["code"])
  assert "examples/elastic_launch.py" in {s for _, s in COMMANDS["script"]}
  assert {"demo", "test", "test-fast", "lint", "docs"} <= {
    t for _, t in COMMANDS["make"]
  }
  # A command split over two lines of inline code is joined.
  assert any(
    "benchmarks.run" == m and "--only quality_per_byte" in args
    for where, m, args in COMMANDS["module"]
    if where.startswith("README.md")
  )


@pytest.mark.parametrize(
  "module",
  sorted({m for _, m, _ in COMMANDS["module"]}),
)
def test_python_m_module_exists(module):
  where = [w for w, m, _ in COMMANDS["module"] if m == module]
  assert importlib.util.find_spec(module) is not None, (
    f"`python -m {module}` is quoted at {where}, but there is no such module"
  )


def _imports(code: str) -> list[tuple[str, str | None]]:
  """(module, name or None) of every import statement of ``code``."""
  out = []
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Import):
      out += [(alias.name, None) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      out += [(node.module, alias.name) for alias in node.names]
  return out


@pytest.mark.parametrize(
  "where, code",
  COMMANDS["code"],
  ids=[w for w, _ in COMMANDS["code"]],
)
def test_python_c_imports_resolve(where, code):
  imports = _imports(code)
  assert imports, f"{where}: `python -c` snippet imports nothing: {code!r}"
  for module, name in imports:
    try:
      imported = importlib.import_module(module)
    except ImportError as error:
      pytest.fail(f"{where}: `python -c {code!r}`: {error}")
    if name is not None and not hasattr(imported, name):
      # `from package import submodule` imports the submodule.
      try:
        importlib.import_module(f"{module}.{name}")
      except ImportError:
        pytest.fail(
          f"{where}: `python -c {code!r}`: cannot import name {name!r}"
          f" from {module!r}"
        )


def test_python_c_calls_name_real_functions_and_arguments():
  """`cost.run(quick=False, only_guards=True)`: the function exists and
  takes those keywords."""
  import inspect

  checked = 0
  for where, code in COMMANDS["code"]:
    namespace = {}
    for module, name in _imports(code):
      if name is None:
        namespace[module.split(".")[0]] = importlib.import_module(
          module.split(".")[0]
        )
      else:
        imported = importlib.import_module(module)
        namespace[name] = getattr(imported, name, None) or (
          importlib.import_module(f"{module}.{name}")
        )
    for node in ast.walk(ast.parse(code)):
      if not isinstance(node, ast.Call):
        continue
      try:
        function = eval(
          compile(ast.Expression(node.func), where, "eval"), namespace
        )
      except (NameError, AttributeError) as error:
        pytest.fail(f"{where}: `python -c {code!r}`: {error}")
      if not callable(function) or isinstance(function, type):
        continue
      try:
        parameters = inspect.signature(function).parameters
      except (TypeError, ValueError):  # a builtin without a signature
        continue
      for keyword in node.keywords:
        assert keyword.arg in parameters, (
          f"{where}: `python -c {code!r}`: {ast.unparse(node.func)} has no"
          f" argument {keyword.arg!r}"
        )
      checked += 1
  assert checked >= 1


@pytest.mark.parametrize("script", sorted({s for _, s in COMMANDS["script"]}))
def test_python_script_exists(script):
  where = [w for w, s in COMMANDS["script"] if s == script]
  assert (ROOT / script).is_file(), (
    f"`python {script}` is quoted at {where}, but {script} does not exist"
  )


def test_files_given_to_commands_exist():
  missing = [
    (where, path)
    for where, path in COMMANDS["path"]
    if not (ROOT / path).exists() and not (ROOT / path.rstrip(".")).exists()
  ]
  assert not missing, missing


def test_make_targets_exist():
  targets = _make_targets()
  missing = [(w, t) for w, t in COMMANDS["make"] if t not in targets]
  assert not missing, (
    f"quoted `make TARGET`s that the Makefile does not define: {missing}"
  )


# Every distinct `python -m` module, run once with --help in a fresh process:
# 11 modules, 8 s in all on a quiet 2-core machine (2026-11-27), so in the
# fast tier.
HELP_TIMEOUT_S = 120


@pytest.mark.parametrize(
  "module",
  sorted({m for _, m, _ in COMMANDS["module"]}),
)
def test_python_m_help_lists_every_quoted_option(module):
  """``--help`` exits 0, prints a usage, and lists every option the pages
  quote for the module (issue 52: a renamed ``--unequal`` went unnoticed
  while ``--help`` still ran)."""
  # This checkout's shardopt, whatever the environment has installed.
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
  }
  env.pop("XLA_FLAGS", None)  # as a user's shell: the module sets its own
  done = subprocess.run(
    [sys.executable, "-m", module, "--help"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=HELP_TIMEOUT_S,
  )
  assert done.returncode == 0, (
    f"`python -m {module} --help` exited {done.returncode}:\n"
    f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
  )
  assert "usage" in done.stdout.lower(), (
    f"`python -m {module} --help` printed no usage (does it parse its"
    f" arguments?):\n{done.stdout[-2000:]}"
  )
  quoted = {
    (flag, where)
    for where, m, args in COMMANDS["module"]
    if m == module
    for flag in _QUOTED_OPTION.findall(args)
  }
  missing = sorted(
    (flag, where)
    for flag, where in quoted
    if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", done.stdout)
  )
  assert not missing, (
    f"`python -m {module} --help` does not list options the pages quote"
    f" (option, where): {missing}\n{done.stdout[-3000:]}"
  )


_QUOTED_OPTION = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def _harness_sections() -> dict:
  """The sections `--only NAME` accepts, per harness module."""
  import benchmarks.perf.harness
  import benchmarks.run
  import benchmarks.studies.harness

  return {
    "benchmarks.run": benchmarks.run.SECTIONS,
    "benchmarks.perf": benchmarks.perf.harness.SECTIONS,
    "benchmarks.studies": benchmarks.studies.harness.SECTIONS,
  }


def test_only_names_a_section_of_its_harness():
  sections = _harness_sections()
  checked, wrong = 0, []
  for where, module, args in COMMANDS["module"]:
    if module not in sections:
      continue
    for name in re.findall(r"--only\s+([\w-]+)", args):
      if name.isupper():  # a placeholder: --only NAME
        continue
      checked += 1
      if name not in sections[module]:
        wrong.append((where, module, name))
  assert checked >= 3
  assert not wrong, (
    f"`--only NAME` quoted with a section the harness does not have: {wrong}"
  )
