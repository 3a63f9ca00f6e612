"""Writes the intersphinx inventories in this folder (run it from anywhere).

The docs are built without a network (developers' machines and CI reach no
documentation site), so intersphinx cannot download ``objects.inv`` from
Python, NumPy, JAX and optax. These hand-written inventories list only the
external objects the shardopt docs reference, each with the address of its
real page, so the links in the built site go where the projects' own
inventories would send them. ``make docs`` fails (nitpicky) when a docstring
references an external name that is not here: add it below and rerun::

    .venv/bin/python docs/_inventories/make_inventories.py
"""

from __future__ import annotations

import pathlib

import sphobjinv as soi

HERE = pathlib.Path(__file__).resolve().parent

# project -> (version, [(name, role, uri)]); a uri ending in "$" means
# "<uri without $><name>", as in Sphinx's own inventories.
INVENTORIES = {
  "python": (
    "3",
    [
      ("typing.Any", "data", "library/typing.html#$"),
      ("typing.NamedTuple", "class", "library/typing.html#$"),
      ("collections.abc.Callable", "class", "library/collections.abc.html#$"),
      ("int", "class", "library/functions.html#$"),
      ("float", "class", "library/functions.html#$"),
      ("str", "class", "library/stdtypes.html#$"),
      ("tuple", "class", "library/stdtypes.html#$"),
      ("bool", "class", "library/functions.html#$"),
      ("ValueError", "exception", "library/exceptions.html#$"),
      ("TypeError", "exception", "library/exceptions.html#$"),
      ("NameError", "exception", "library/exceptions.html#$"),
    ],
  ),
  "numpy": (
    "stable",
    [
      ("numpy.ndarray", "class", "reference/generated/numpy.ndarray.html#$"),
      ("numpy.bool", "class", "reference/arrays.scalars.html#$"),
      ("numpy.number", "class", "reference/arrays.scalars.html#$"),
      ("numpy.dtype", "class", "reference/generated/numpy.dtype.html#$"),
    ],
  ),
  "jax": (
    "latest",
    [
      ("jax.Array", "class", "_autosummary/jax.Array.html#$"),
      ("jax.pmap", "function", "_autosummary/jax.pmap.html#$"),
      ("jax.shard_map", "function", "_autosummary/jax.shard_map.html#$"),
      ("jax.lax.psum", "function", "_autosummary/jax.lax.psum.html#$"),
      ("jax.lax.pmean", "function", "_autosummary/jax.lax.pmean.html#$"),
      ("jax.lax.cond", "function", "_autosummary/jax.lax.cond.html#$"),
    ],
  ),
  "optax": (
    "latest",
    [
      ("optax.GradientTransformation", "class", "api/transformations.html#$"),
      (
        "optax.GradientTransformationExtraArgs",
        "class",
        "api/transformations.html#$",
      ),
      ("optax.clip_by_global_norm", "function", "api/transformations.html#$"),
      ("optax.chain", "function", "api/generated/optax.chain.html#$"),
      ("optax.MultiSteps", "class", "api/optimizer_wrappers.html#$"),
      ("optax.apply_if_finite", "function", "api/optimizer_wrappers.html#$"),
      ("optax.masked", "function", "api/optimizer_wrappers.html#$"),
      ("optax.adam", "function", "api/optimizers.html#$"),
      ("optax.sgd", "function", "api/optimizers.html#$"),
    ],
  ),
}


def main() -> None:
  for project, (version, objects) in INVENTORIES.items():
    inventory = soi.Inventory()
    inventory.project = project
    inventory.version = version
    for name, role, uri in objects:
      inventory.objects.append(
        soi.DataObjStr(
          name=name, domain="py", role=role, priority="1", uri=uri, dispname="-"
        )
      )
    text = inventory.data_file(contract=True)
    soi.writebytes(HERE / f"{project}.inv", soi.compress(text))
    print(f"{project}.inv: {len(objects)} objects")


if __name__ == "__main__":
  main()
