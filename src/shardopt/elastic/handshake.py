"""The islands agree on their params before a round exchanges any byte.

A round's collective sends the params leaf by leaf: islands whose params
differ in tree structure, a shape or a dtype would send rows of different
lengths, and gloo aborts every process of the collective (SIGABRT, "op.
preamble.length <= op.nbytes") without naming the leaf or the island. So
every process publishes its params' *signature* (tree structure, and per
leaf its path, shape and dtype) in the coordination service's key-value
store before its round (``shardopt/params/<process>``, overwritten by each
incarnation: one key per process), and in every healing round (an island
joins; the job's start included) every member reads every member's
signature and compares it with the lowest member's. The members enter the
round's ``live_devices`` block only after publishing, and read the same
keys, so every one of them finds the same error, naming the island and the
leaf, before the collective, and ends with it (:class:`.island.Island`).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

PARAMS = "shardopt/params/"


def signature(params) -> str:
  """The params' tree structure and, per leaf, its path, shape and dtype
  (global shapes: a sharded leaf's whole array), as text."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  return json.dumps(
    {
      "tree": str(treedef),
      "leaves": [
        [jax.tree_util.keystr(path) or "<root>", list(np.shape(x)), _dtype(x)]
        for path, x in leaves
      ],
    }
  )


def _dtype(x) -> str:
  dtype = getattr(x, "dtype", None)
  return str(jnp.dtype(dtype)) if dtype is not None else type(x).__name__


def publish(store, me: int, text: str) -> None:
  """This process's signature (``text``: :func:`signature`)."""
  store.set(f"{PARAMS}{me}", text, overwrite=True)


def disagreement(store, processes, island_of, timeout_s: float, where: str):
  """None if every process of ``processes`` published the same signature
  as the lowest one, of floating-point leaves; else the error, the same on
  every process: a ``ValueError`` naming the first island and leaf that
  differ, or a ``TypeError`` naming the first leaf that is not floating
  point (the caller ends the job with it: :mod:`.island`)."""
  processes = sorted(processes)
  signatures = {
    p: json.loads(store.get(f"{PARAMS}{p}", timeout_s)) for p in processes
  }
  first = processes[0]
  want = signatures[first]
  for p in processes[1:]:
    why = _difference(
      signatures[p],
      want,
      f"island {island_of(p)} (process {p})",
      f"island {island_of(first)} (process {first})",
    )
    if why:
      return ValueError(
        f"{where}: the islands' params differ: {why}. Every island must"
        " build the same params (tree structure, shapes and dtypes): a"
        " round exchanges them leaf by leaf. Build them from the same code"
        " and config on every island."
      )
  for path, shape, dtype in want["leaves"]:
    if not _floating(dtype):
      return TypeError(
        f"{where}: the params' leaf at {path} ({dtype}{shape}) is not"
        " floating point; only floating-point params can be averaged"
        " across the islands. Keep integer leaves out of the params (in a"
        " tree of their own), or cast them to a float dtype."
      )
  return None


def _floating(dtype: str) -> bool:
  try:
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))
  except TypeError:
    return False


def _difference(got: dict, want: dict, a: str, b: str) -> str:
  """What differs between ``a``'s signature ``got`` and ``b``'s ``want``,
  in words ('' if nothing)."""
  mine = {path: (shape, dtype) for path, shape, dtype in got["leaves"]}
  theirs = {path: (shape, dtype) for path, shape, dtype in want["leaves"]}
  for path, (shape, dtype) in theirs.items():
    if path not in mine:
      return f"{a} has no leaf at {path} ({dtype}{shape} on {b})"
    if mine[path] != (shape, dtype):
      other_shape, other_dtype = mine[path]
      return (
        f"the leaf at {path} is {other_dtype}{other_shape} on {a} and"
        f" {dtype}{shape} on {b}"
      )
  for path, (shape, dtype) in mine.items():
    if path not in theirs:
      return f"{a} has a leaf at {path} ({dtype}{shape}) that {b} lacks"
  if got["tree"] != want["tree"]:
    return (
      f"the tree structure is {got['tree']} on {a} and {want['tree']} on {b}"
    )
  return ""
