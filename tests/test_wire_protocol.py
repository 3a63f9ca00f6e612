"""The wire protocol: every wire is a ``shardopt.wire.Wire``, canonicalised
once, and callers ask it what it can do instead of testing its class."""

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import shardopt
from shardopt import wire

SRC = pathlib.Path(shardopt.__file__).parent
WIRE_CLASSES = {"Dense", "Blocks", "Sparse", "Wire", "Base"}
COMM_DTYPES = [
  None,
  jnp.bfloat16,
  jnp.float16,
  jnp.int8,
  shardopt.quantized(jnp.int4, block_size=64),
  shardopt.topk(4, chunk_size=16),
]


@pytest.mark.parametrize("comm_dtype", COMM_DTYPES, ids=repr)
def test_every_wire_is_a_wire_and_canonical_once(comm_dtype):
  on_wire = wire.of(comm_dtype)
  assert isinstance(on_wire, wire.Wire)
  assert wire.of(on_wire) is on_wire
  assert isinstance(on_wire.rest, wire.Wire)
  assert not on_wire.rest.runs_own_collective


def test_dense_wire_carries_no_leaf_and_is_its_own_rest():
  bf16 = wire.of(jnp.bfloat16)
  assert not bf16.runs_own_collective
  assert not bf16.carries_leaf(1024, every_axis=True)
  assert bf16.rest is bf16


def test_quantized_wire_carries_every_nonempty_leaf():
  int8 = wire.of(jnp.int8)
  assert int8.carries_leaf(3, every_axis=False)
  assert not int8.carries_leaf(0, every_axis=True)
  assert int8.rest == wire.of(None)


def test_sparse_wire_carries_only_leaves_with_an_error_buffer():
  top = wire.of(shardopt.topk(4, chunk_size=16))
  assert top.carries_leaf(3, every_axis=True)
  assert not top.carries_leaf(3, every_axis=False)
  assert top.rest == wire.of(None)


def test_dense_wire_casts_around_an_opaque_collective():
  x = jnp.asarray([1.0, 2.0, 3.0], jnp.float32)
  out = wire.of(jnp.bfloat16).reduce(x, lambda y: y * 2, 2, "mean")
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), [1.0, 2.0, 3.0])


@pytest.mark.parametrize(
  "comm_dtype, says",
  [(jnp.int8, "a quantized wire"), (shardopt.topk(4), "the top-k wire")],
  ids=["quantized", "topk"],
)
def test_opaque_collective_refuses_a_wire_with_its_own(comm_dtype, says):
  with pytest.raises(NotImplementedError, match=says):
    wire.of(comm_dtype).reduce(jnp.ones(3), lambda y: y, 2, "mean")


def test_chunks_is_refused_by_the_quantized_wire():
  with pytest.raises(ValueError, match="chunks=.*shardopt.topk"):
    wire.of(jnp.int8).all_reduce(
      [jnp.ones(8)],
      "i",
      None,
      8,
      divisor=8,
      invariant_result=False,
      chunks=(4,),
    )


def _class_tests(path: pathlib.Path) -> list:
  """``isinstance(..., <a wire class>)`` calls in ``path``, as lines."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Name)
      and node.func.id == "isinstance"
      and len(node.args) == 2
    ):
      names = {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(node.args[1])
        if isinstance(n, (ast.Attribute, ast.Name))
      }
      if names & WIRE_CLASSES:
        found.append(f"{path.relative_to(SRC)}:{node.lineno}")
  return found


def test_no_caller_outside_the_wire_tests_a_wires_class():
  found = [
    line
    for path in sorted(SRC.rglob("*.py"))
    if "wire" not in path.relative_to(SRC).parts
    for line in _class_tests(path)
  ]
  assert found == [], f"isinstance on a wire's class outside wire/: {found}"
