"""The built wheel installs without the source tree and works.

``python -m build`` makes the sdist and, from it, the wheel (so a file missing
from the sdist fails here too); ``twine check`` validates both. The wheel is
installed with ``--no-deps`` into a fresh virtual environment, not in editable
mode; a ``.pth`` file appends this interpreter's site-packages so the fresh
environment finds jax and optax without downloading them. The test checks that
``shardopt`` is imported from the fresh environment, that ``py.typed`` and the
version came along, and runs the docstring example of ``shardopt.reduce``.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

import shardopt

ROOT = pathlib.Path(__file__).resolve().parents[1]


# The fresh environment must not see this checkout's sources (PYTHONPATH=src
# during development): pip would call the wheel "already satisfied".
CLEAN_ENV = {
  k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")
}


def _run(cmd, env=None, **kwargs):
  result = subprocess.run(
    [str(c) for c in cmd],
    capture_output=True,
    text=True,
    timeout=300,
    env=env or CLEAN_ENV,
    **kwargs,
  )
  assert result.returncode == 0, (
    f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
  )
  return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
  # Built from a copy of what the sdist needs, so the checkout gets no build/
  # or egg-info, and two xdist workers never build in the same folder.
  source = tmp_path_factory.mktemp("source")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy2(ROOT / name, source / name)
  shutil.copytree(
    ROOT / "src",
    source / "src",
    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
  )
  out = tmp_path_factory.mktemp("dist")
  # --no-isolation: build with this environment's setuptools (the dev extra
  # pins setuptools>=77), no download.
  _run(
    [sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source]
  )
  return out


def test_version_has_one_source(dist):
  (wheel,) = dist.glob("*.whl")
  (sdist,) = dist.glob("*.tar.gz")
  assert wheel.name == f"shardopt-{shardopt.__version__}-py3-none-any.whl"
  assert sdist.name == f"shardopt-{shardopt.__version__}.tar.gz"
  assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_twine_check_passes(dist):
  out = _run(
    [
      sys.executable,
      "-m",
      "twine",
      "check",
      "--strict",
      *sorted(dist.iterdir()),
    ]
  )
  assert out.count("PASSED") == 2, out


def test_wheel_ships_py_typed_and_no_tests(dist):
  (wheel,) = dist.glob("*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "shardopt/py.typed" in names
  assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_runs_a_docstring_example(
  dist, tmp_path
):
  (wheel,) = dist.glob("*.whl")
  venv = tmp_path / "fresh"
  _run([sys.executable, "-m", "venv", "--without-pip", venv])
  python = venv / "bin" / "python"
  _run(
    [
      sys.executable,
      "-m",
      "pip",
      "--python",
      python,
      "install",
      "--quiet",
      "--no-deps",
      "--no-index",
      wheel,
    ]
  )
  fresh_site = pathlib.Path(
    _run(
      [
        python,
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
      ]
    ).strip()
  )
  # Dependencies (jax, optax, ...) from this interpreter's environment. A path
  # line in a .pth is appended to sys.path after the fresh site-packages, and
  # .pth files inside it (an editable shardopt install) are not processed.
  (fresh_site / "zz_dev_dependencies.pth").write_text(
    sysconfig.get_paths()["purelib"] + "\n"
  )

  script = textwrap.dedent("""
      import doctest, pathlib, sys
      import shardopt
      print(shardopt.__file__)
      print(shardopt.__version__)
      assert (pathlib.Path(shardopt.__file__).parent / "py.typed").exists()
      runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
      for test in doctest.DocTestFinder().find(shardopt.reduce, "reduce"):
        runner.run(test)
      print("attempted", runner.tries, "failed", runner.failures)
      sys.exit(1 if runner.failures or not runner.tries else 0)
  """)
  env = dict(CLEAN_ENV)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  out = _run([python, "-c", script], env=env, cwd=tmp_path)
  print(out)
  module_file, version = out.splitlines()[:2]
  assert pathlib.Path(module_file).is_relative_to(venv), module_file
  assert version == shardopt.__version__
  assert "failed 0" in out and "attempted 0" not in out, out
