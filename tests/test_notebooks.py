"""The notebooks are what the generator writes, run top to bottom, and only
install packages on Colab.

Each notebook is executed on the CPU with nbclient in a fresh kernel that
runs *this* interpreter (a kernelspec written to a temporary directory, so a
fresh clone needs nothing but the project's virtual environment). The
kernel inherits XLA_FLAGS from conftest.py: 8 CPU devices.
"""

import pathlib
import sys
import types

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = ("01_cross_shard_pmap.ipynb", "02_agn_local_steps.ipynb",
             "03_tower_sharded_state.ipynb")
CELL_TIMEOUT_S = 300


def _generator():
  sys.path.insert(0, str(NOTEBOOKS_DIR))
  try:
    import _make_notebooks  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(NOTEBOOKS_DIR))
  return _make_notebooks


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory):
  """A kernelspec named "shardopt-test" that starts this interpreter."""
  from ipykernel.kernelspec import write_kernel_spec  # pylint: disable=g-import-not-at-top
  kernels = tmp_path_factory.mktemp("kernels")
  write_kernel_spec(path=str(kernels / "shardopt-test"))
  return kernels


def _execute(path: pathlib.Path, kernels: pathlib.Path) -> nbformat.NotebookNode:
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
  from jupyter_client.manager import KernelManager  # pylint: disable=g-import-not-at-top
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top

  nb = nbformat.read(str(path), as_version=4)
  spec_manager = KernelSpecManager(kernel_dirs=[str(kernels)])
  km = KernelManager(kernel_name="shardopt-test",
                     kernel_spec_manager=spec_manager)
  client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S,
                          resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
  client.execute()
  return nb


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_on_8_cpu_devices(name, kernel_spec_dir):
  nb = _execute(NOTEBOOKS_DIR / name, kernel_spec_dir)
  outputs = [o for cell in nb.cells if cell.cell_type == "code"
             for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "8 x cpu" in text.lower() or "8 x TFRT_CPU" in text, text[:500]
  if name.startswith("02"):  # the communication-vs-accuracy plot was drawn
    assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_files_match_their_generator(name, tmp_path):
  _generator().main(tmp_path)
  want = nbformat.read(str(tmp_path / name), as_version=4)
  have = nbformat.read(str(NOTEBOOKS_DIR / name), as_version=4)
  assert [(c.cell_type, c.source) for c in have.cells] == [
      (c.cell_type, c.source) for c in want.cells], (
          f"notebooks/{name} is out of date: run"
          " `.venv/bin/python notebooks/_make_notebooks.py`")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_cell_installs_only_on_colab_and_picks_devices(name, monkeypatch):
  nb = nbformat.read(str(NOTEBOOKS_DIR / name), as_version=4)
  setup = next(c for c in nb.cells if c.cell_type == "code").source
  assert "!" not in setup.split("\n")[0]  # valid Python, no shell magics
  calls = []
  monkeypatch.setattr("subprocess.run",
                      lambda cmd, **kwargs: calls.append(cmd))

  namespace = {}
  exec(compile(setup, f"{name}[setup]", "exec"), namespace)  # not on Colab
  assert calls == []
  assert len(namespace["DEVICES"]) == 8

  monkeypatch.setitem(sys.modules, "google.colab",
                      types.ModuleType("google.colab"))
  exec(compile(setup, f"{name}[setup]", "exec"), {})  # on Colab
  assert len(calls) == 1
  assert calls[0][:4] == [sys.executable, "-m", "pip", "install"]
