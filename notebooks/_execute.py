"""Writes each notebooks/NN_name.ipynb from its jupytext source and executes it.

The ``.py`` files (jupytext ``py:percent``) are the notebooks' source; the
``.ipynb`` files carry the outputs that Colab shows on opening and that the
docs site renders (it does not execute notebooks). Run after editing a source::

    make notebooks            # or: .venv/bin/python notebooks/_execute.py [NAME.py ...]

Cell ids are numbered (``cell-00``, ...) so rewriting a notebook does not churn
the file. Execution uses this interpreter's ``python3`` kernel on 8 CPU devices
(the notebooks' setup cell sets the XLA flag).
"""

from __future__ import annotations

import pathlib
import sys

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
METADATA = {
  "kernelspec": {
    "display_name": "Python 3",
    "language": "python",
    "name": "python3",
  },
  "language_info": {"name": "python"},
  "colab": {"provenance": []},
}


def write(source: pathlib.Path, execute: bool = True) -> pathlib.Path:
  nb = jupytext.read(source)
  nb.metadata = dict(METADATA)
  for i, cell in enumerate(nb.cells):
    cell["id"] = f"cell-{i:02d}"
  if execute:
    NotebookClient(
      nb,
      timeout=600,
      kernel_name="python3",
      resources={"metadata": {"path": str(HERE)}},
    ).execute()
    nb.metadata = dict(METADATA)  # drop what the kernel added (versions)
  nbformat.validate(nb)
  target = source.with_suffix(".ipynb")
  nbformat.write(nb, str(target))
  return target


def main(argv: list[str]) -> None:
  execute = "--no-execute" not in argv
  names = [a for a in argv if not a.startswith("--")]
  sources = (
    [pathlib.Path(n).resolve() for n in names]
    if names
    else sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))
  )
  for source in sources:
    print(f"wrote {write(source, execute).relative_to(HERE.parent)}")


if __name__ == "__main__":
  main(sys.argv[1:])
