"""Sphinx configuration for the shardopt docs site (``make docs``).

The build is strict: ``-W`` turns every warning into an error and
``nitpicky`` makes every unresolved cross-reference one, so a docstring that
names a function that does not exist fails the build.

Intersphinx without a network: the machines that build these docs (developers'
and CI's) reach no documentation site, so the inventories for Python, NumPy,
JAX and optax are files in ``docs/_inventories/``. They hold only the objects
the shardopt docs reference, each pointing at its real page on the project's
site, and are written by ``docs/_inventories/make_inventories.py``. When a
docstring references a new external name, add it there and rerun the script.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT / "src"))

import shardopt  # noqa: E402  (after the sys.path entry above)

project = "shardopt"
author = "the shardopt authors"
copyright = "2026, the shardopt authors"
version = shardopt.__version__
release = shardopt.__version__

extensions = [
  "myst_nb",  # markdown pages (myst-parser) and notebooks
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.intersphinx",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

exclude_patterns = [
  "_build",
  "_inventories",
  "CONTRIBUTING-docs.md",
  "**.ipynb_checkpoints",
]
nitpicky = True
suppress_warnings = []
# The one private type a public signature names: quantized()'s return value,
# a small frozen record of (dtype, block_size) that users pass on, never
# build. It has no page of its own (only exported names do).
nitpick_ignore = [
  ("py:class", "shardopt.wire.blocks.QuantizedSpec"),
  ("py:class", "shardopt.wire.sparse.TopKSpec"),
]

# Google-style docstrings, as optax writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "count, index"}
autosummary_generate = False  # the tables link to entries on the same page
add_module_names = False
# "sync_count" in the on-page contents, not "PeriodicState.sync_count".
toc_object_entries_show_parents = "hide"

# Notebooks are rendered from the outputs stored in notebooks/*.ipynb (written
# by `make notebooks`); the docs build never executes them.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

intersphinx_mapping = {
  name: (url, str(DOCS / "_inventories" / f"{name}.inv"))
  for name, url in {
    "python": "https://docs.python.org/3/",
    "numpy": "https://numpy.org/doc/stable/",
    "jax": "https://docs.jax.dev/en/latest/",
    "optax": "https://optax.readthedocs.io/en/latest/",
  }.items()
}
intersphinx_timeout = 1

html_theme = "sphinx_book_theme"
html_title = f"shardopt {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
  "use_download_button": True,
}


def _copy_notebooks(app) -> None:
  """Copies notebooks/*.ipynb into docs/notebooks/ (git-ignored) to render."""
  target = DOCS / "notebooks"
  shutil.rmtree(target, ignore_errors=True)
  target.mkdir()
  for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copy2(notebook, target / notebook.name)


def _hide_private_parameters(
  app, what, name, obj, options, signature, return_annotation
):
  """Drops parameters whose name starts with ``_`` from signatures.

  ``reduce(..., _transform=...)`` is internal plumbing (which transform's name
  the errors carry), not part of the API a user calls.
  """
  if signature and ", _" in signature:
    signature = re.sub(r", _\w+(: [^,=)]+)?(=[^,)]+)?", "", signature)
  return signature, return_annotation


# Where type hints name a class by the private module that defines it.
_PRIVATE_PATHS = {
  "optax._src.base.": "optax.",
  "jax.jaxlib._jax.": "jax.",
  "jaxlib._jax.": "jax.",
  "jaxlib.xla_extension.": "jax.",
}


def _public_path(app, env, node, contnode):
  """Resolves a type hint's private path (``optax._src.base.X``) as ``optax.X``."""
  target = node.get("reftarget", "")
  for private, public in _PRIVATE_PATHS.items():
    if target.startswith(private):
      from sphinx.ext import intersphinx  # pylint: disable=g-import-not-at-top

      node["reftarget"] = public + target[len(private) :]
      return intersphinx.missing_reference(app, env, node, contnode)
  return None


def _public_name(app, env, node, contnode):
  """Resolves ``shardopt.<module>.<name>`` to the public ``shardopt.<name>``.

  The API pages document each function once, under the name users import
  (``shardopt.tower``), while a module docstring rendered on its page refers to
  its neighbours by their short names (``:func:`tower``` inside
  ``shardopt.tower``), which Sphinx looks up as ``shardopt.tower.tower``.
  """
  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"].split(".")[-1]
  module = node.get("py:module") or ""
  if not module.startswith("shardopt.") or target not in shardopt.__all__:
    return None
  domain = env.get_domain("py")
  node["reftarget"] = f"shardopt.{target}"
  return domain.resolve_xref(
    env,
    node["refdoc"],
    app.builder,
    node["reftype"],
    f"shardopt.{target}",
    node,
    contnode,
  )


def setup(app):
  app.connect("builder-inited", _copy_notebooks)
  app.connect("autodoc-process-signature", _hide_private_parameters)
  app.connect("missing-reference", _public_name)
  app.connect("missing-reference", _public_path, priority=400)
