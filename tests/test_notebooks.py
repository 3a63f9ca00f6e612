"""The notebooks match their jupytext sources, run top to bottom, and only
install packages on Colab.

Each notebook's source is ``notebooks/NN_name.py`` (jupytext ``py:percent``);
the ``.ipynb`` next to it, with stored outputs, is what Colab and the docs site
open. ``make notebooks`` writes every ``.ipynb`` from its source and executes
it. The sources are found by glob, so a new ``notebooks/04_*.py`` is checked
and executed here without editing this file.

Each notebook is executed on the CPU with nbclient in a fresh kernel that
runs *this* interpreter (a kernelspec written to a temporary directory, so a
fresh clone needs nothing but the project's virtual environment). The
kernel inherits XLA_FLAGS from conftest.py: 8 CPU devices.
"""

import pathlib
import sys
import types

import jupytext
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
SOURCES = sorted(
  p for p in NOTEBOOKS_DIR.glob("*.py") if not p.name.startswith("_")
)
CELL_TIMEOUT_S = 300
FIX = "edit the .py source, then run `make notebooks`"


def _cells(nb: nbformat.NotebookNode) -> list:
  """What the sync check compares: each cell's type and source, no outputs."""
  return [(c.cell_type, c.source) for c in nb.cells]


def _ids(paths):
  return [p.stem for p in paths]


def test_there_are_notebook_sources():
  assert SOURCES, f"no jupytext sources in {NOTEBOOKS_DIR}"


def test_every_ipynb_has_a_jupytext_source():
  orphans = [
    p.name
    for p in NOTEBOOKS_DIR.glob("*.ipynb")
    if not p.with_suffix(".py").exists()
  ]
  assert not orphans, (
    f"notebooks without a py:percent source: {orphans}; create one with"
    " `jupytext --to py:percent notebooks/NAME.ipynb`"
  )


@pytest.mark.parametrize("source", SOURCES, ids=_ids(SOURCES))
def test_ipynb_cells_match_their_jupytext_source(source):
  ipynb = source.with_suffix(".ipynb")
  assert ipynb.exists(), f"notebooks/{ipynb.name} is missing: {FIX}"
  want = _cells(jupytext.read(source))
  have = _cells(nbformat.read(str(ipynb), as_version=4))
  assert have == want, f"notebooks/{ipynb.name} is out of sync: {FIX}"


def test_sync_check_sees_an_edited_cell(tmp_path):
  source = SOURCES[0]
  edited = tmp_path / source.name
  edited.write_text(
    source.read_text().replace("import jax\n", "import jax  # edited\n", 1)
  )
  nb = nbformat.read(str(source.with_suffix(".ipynb")), as_version=4)
  assert _cells(jupytext.read(edited)) != _cells(nb)
  assert _cells(jupytext.read(source)) == _cells(nb)


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory):
  """A kernelspec named "shardopt-test" that starts this interpreter."""
  from ipykernel.kernelspec import write_kernel_spec  # pylint: disable=g-import-not-at-top

  kernels = tmp_path_factory.mktemp("kernels")
  write_kernel_spec(path=str(kernels / "shardopt-test"))
  return kernels


def _execute(
  nb: nbformat.NotebookNode, kernels: pathlib.Path
) -> nbformat.NotebookNode:
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
  from jupyter_client.manager import KernelManager  # pylint: disable=g-import-not-at-top
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top

  spec_manager = KernelSpecManager(kernel_dirs=[str(kernels)])
  km = KernelManager(
    kernel_name="shardopt-test", kernel_spec_manager=spec_manager
  )
  client = NotebookClient(
    nb,
    km=km,
    timeout=CELL_TIMEOUT_S,
    resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
  )
  client.execute()
  return nb


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=_ids(SOURCES))
def test_notebook_runs_top_to_bottom_on_8_cpu_devices(source, kernel_spec_dir):
  nb = _execute(jupytext.read(source), kernel_spec_dir)
  outputs = [
    o
    for cell in nb.cells
    if cell.cell_type == "code"
    for o in cell.get("outputs", [])
  ]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(
    o.get("text", "") for o in outputs if o.output_type == "stream"
  )
  assert "8 x cpu" in text.lower() or "8 x TFRT_CPU" in text, text[:500]
  if source.name.startswith("02"):  # the communication-vs-accuracy plot
    assert any("image/png" in o.get("data", {}) for o in outputs)


def _setup_cell(source: pathlib.Path) -> str:
  return next(
    c for c in jupytext.read(source).cells if c.cell_type == "code"
  ).source


@pytest.mark.parametrize("source", SOURCES, ids=_ids(SOURCES))
def test_first_cell_installs_only_on_colab_and_picks_devices(
  source, monkeypatch
):
  setup = _setup_cell(source)
  assert "!" not in setup.split("\n")[0]  # valid Python, no shell magics
  calls = []
  monkeypatch.setattr("subprocess.run", lambda cmd, **kwargs: calls.append(cmd))
  monkeypatch.delenv("SHARDOPT_PIP_SPEC", raising=False)

  namespace = {}
  exec(compile(setup, f"{source.name}[setup]", "exec"), namespace)  # no Colab
  assert calls == []
  assert len(namespace["DEVICES"]) == 8


@pytest.mark.parametrize("source", SOURCES, ids=_ids(SOURCES))
def test_colab_installs_the_uploaded_wheel_or_the_spec_it_is_given(
  source, monkeypatch, tmp_path, capsys
):
  setup = _setup_cell(source)
  calls = []
  monkeypatch.setattr("subprocess.run", lambda cmd, **kwargs: calls.append(cmd))
  monkeypatch.setitem(
    sys.modules, "google.colab", types.ModuleType("google.colab")
  )
  monkeypatch.delenv("SHARDOPT_PIP_SPEC", raising=False)
  monkeypatch.chdir(tmp_path)
  code = compile(setup, f"{source.name}[setup]", "exec")

  with pytest.raises(FileNotFoundError, match="SHARDOPT_PIP_SPEC"):
    exec(code, {})  # neither a wheel nor a spec: says what to do
  assert calls == []

  wheel = "shardopt-0.1.0-py3-none-any.whl"
  (tmp_path / wheel).write_bytes(b"")
  exec(code, {})
  assert calls[-1] == [sys.executable, "-m", "pip", "install", "-q", wheel]
  assert f"Installing shardopt from {wheel}" in capsys.readouterr().out

  repo = "git+https://example.invalid/shardopt.git"
  monkeypatch.setenv("SHARDOPT_PIP_SPEC", repo)
  exec(code, {})
  assert calls[-1] == [sys.executable, "-m", "pip", "install", "-q", repo]
  assert len(calls) == 2
