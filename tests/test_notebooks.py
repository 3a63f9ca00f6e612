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
import signal
import sys
import time
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
NOTEBOOK_TIMEOUT_S = 900  # the whole notebook, enforced by the test
STACKS_WAIT_S = 10  # for the stacks of a kernel that hung, then it is killed
# Run by the kernel at start (an IPython startup file): on SIGUSR1 it writes
# every thread's Python stack to a file the test reads. Not to its stderr:
# ipykernel forwards fd 2 through a thread of its own.
_STACKS_ON_SIGUSR1 = """
import faulthandler, os, signal
_shardopt_stacks = open(os.environ["SHARDOPT_KERNEL_STACKS"], "w")
faulthandler.register(signal.SIGUSR1, file=_shardopt_stacks, all_threads=True)
"""
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


_RUNNER = """
import json, os, sys
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

source, target, kernels, pid_file, cell_timeout, path = sys.argv[1:]
nb = nbformat.read(source, as_version=4)
km = KernelManager(
  kernel_name="shardopt-test",
  kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels]),
)
def kernel_started(notebook):  # the kernel's pid, for the test's kill
  with open(pid_file, "w") as f:
    f.write(str(km.provisioner.pid))
client = NotebookClient(
  nb,
  km=km,
  timeout=int(cell_timeout),
  resources={"metadata": {"path": path}},
  on_notebook_start=kernel_started,
)
client.execute()
nbformat.write(nb, target)
"""


def _execute(
  nb: nbformat.NotebookNode,
  kernels: pathlib.Path,
  timeout_s: float | None = None,
) -> nbformat.NotebookNode:
  """Runs ``nb`` in a child process (and its kernel) and returns it with its
  outputs. nbclient's cell timeout bounds the wait for a cell's reply, not
  for its outputs: a kernel stuck in native code would leave it waiting
  forever. So the test bounds the whole run (``timeout_s``, by default
  NOTEBOOK_TIMEOUT_S as the module holds it when called) and, past it,
  has the kernel write every thread's Python stack (SIGUSR1, to a file,
  :data:`_STACKS_ON_SIGUSR1`), kills the child's process group and the
  kernel itself, and raises with the stacks: a hang says where it hung."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  if timeout_s is None:
    timeout_s = NOTEBOOK_TIMEOUT_S
  with tempfile.TemporaryDirectory() as tmp:
    source, target = (
      os.path.join(tmp, "in.ipynb"),
      os.path.join(tmp, "out.ipynb"),
    )
    pid_file = os.path.join(tmp, "kernel.pid")
    stacks = os.path.join(tmp, "kernel_stacks.txt")
    startup = pathlib.Path(tmp, "ipython", "profile_default", "startup")
    startup.mkdir(parents=True)
    (startup / "00_stacks_on_sigusr1.py").write_text(_STACKS_ON_SIGUSR1)
    nbformat.write(nb, source)
    env = dict(
      os.environ,
      IPYTHONDIR=os.path.join(tmp, "ipython"),
      SHARDOPT_KERNEL_STACKS=stacks,
    )
    child = subprocess.Popen(
      [
        sys.executable,
        "-c",
        _RUNNER,
        source,
        target,
        str(kernels),
        pid_file,
        str(CELL_TIMEOUT_S),
        str(NOTEBOOKS_DIR),
      ],
      start_new_session=True,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
    )
    try:
      log, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      _signal_kernel(pid_file, signal.SIGUSR1)
      deadline = time.monotonic() + STACKS_WAIT_S
      while time.monotonic() < deadline and not _written(stacks):
        time.sleep(0.2)
      time.sleep(0.5)  # the rest of the dump
      _kill(child.pid, pid_file)
      child.communicate()
      where = (
        _main_thread_first(pathlib.Path(stacks).read_text())
        if _written(stacks)
        else "(the kernel wrote no stacks)"
      )
      raise TimeoutError(
        f"the notebook did not finish within {timeout_s} s; its runner and"
        " kernel were killed. The kernel's threads when it was stopped"
        f" (Python stacks, most recent call first):\n{where[:8000]}"
      ) from None
    finally:
      _kill(child.pid, pid_file)
    assert child.returncode == 0, log[-4000:]
    return nbformat.read(target, as_version=4)


def _kernel_pid(pid_file: str) -> int | None:
  import os  # pylint: disable=g-import-not-at-top

  if os.path.exists(pid_file):
    with open(pid_file) as f:
      text = f.read().strip()
    if text.isdigit():
      return int(text)
  return None


def _signal_kernel(pid_file: str, signum: int) -> None:
  import os  # pylint: disable=g-import-not-at-top

  pid = _kernel_pid(pid_file)
  if pid is not None:
    try:
      os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
      pass


def _main_thread_first(dump: str) -> str:
  """faulthandler's dump with the thread that received the signal (the
  kernel's main thread, which runs the cells) first."""
  current = dump.find("Current thread")
  if current <= 0:
    return dump
  return dump[current:] + "\n" + dump[:current]


def _written(path: str) -> bool:
  import os  # pylint: disable=g-import-not-at-top

  return os.path.exists(path) and os.path.getsize(path) > 0


def _kill(runner_pid: int, pid_file: str) -> None:
  """SIGKILLs the runner's process group and the kernel (its own session),
  whatever state they are in; nothing that is already gone is an error."""
  import os  # pylint: disable=g-import-not-at-top

  try:
    os.killpg(runner_pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  _signal_kernel(pid_file, signal.SIGKILL)


@pytest.mark.slow
def test_a_hung_notebook_is_reported_with_where_its_kernel_hung(
  kernel_spec_dir,
):
  """A cell that never returns: the test's bound ends the run, and the error
  shows the kernel's Python stack, down to the function that hung."""
  nb = nbformat.v4.new_notebook()
  nb.cells = [
    nbformat.v4.new_code_cell("print('started', flush=True)"),
    nbformat.v4.new_code_cell(
      "import time\n\ndef stuck_in_this_cell():\n  time.sleep(600)\n\n"
      "stuck_in_this_cell()"
    ),
  ]
  with pytest.raises(TimeoutError) as error:
    _execute(nb, kernel_spec_dir, timeout_s=30)
  message = str(error.value)
  assert "within 30 s" in message, message
  assert "stuck_in_this_cell" in message, message


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


@pytest.mark.slow
def test_a_stuck_notebook_fails_within_the_bound_and_its_kernel_is_killed(
  kernel_spec_dir, monkeypatch
):
  """A cell that never returns ends the test with a TimeoutError after
  NOTEBOOK_TIMEOUT_S, not a hang (nbclient's own timeout does not cover a
  kernel stuck in native code)."""
  import time

  monkeypatch.setattr(sys.modules[__name__], "NOTEBOOK_TIMEOUT_S", 20)
  nb = nbformat.v4.new_notebook()
  nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(600)")]
  start = time.monotonic()
  with pytest.raises(TimeoutError, match="did not finish within 20 s"):
    _execute(nb, kernel_spec_dir)
  assert time.monotonic() - start < 60
