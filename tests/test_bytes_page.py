"""docs/bytes.md's reference facts are the code's: the table of
``shardopt.measure.Traffic``'s fields, and the int8 wire's block size and
scale (the page's code blocks run in tests/test_traffic.py).

The int8 wire's bytes are checked against the page's own formula, with the
block size and the scale's dtype read from the page, for a step compiled
here: a page that named another block size or scale would count other
bytes than XLA's program moves.
"""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

import shardopt
from shardopt.measure.traffic import Collective
from shardopt.measure.traffic import Traffic

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "bytes.md").read_text()
N = 8


def _section(title: str) -> str:
  text = PAGE[PAGE.index(f"\n## {title}\n") + 1 :]
  return text[: text.index("\n## ")]


def test_the_traffic_table_lists_every_field_in_order():
  section = _section("What `Traffic` holds")
  rows = re.findall(r"^\| `(\w+)` \|", section, re.M)
  fields = [
    f.name for f in dataclasses.fields(Traffic) if not f.name.startswith("_")
  ]
  assert rows == fields, (
    "docs/bytes.md's table of Traffic's fields differs from"
    f" shardopt.measure.Traffic's: {rows} != {fields}"
  )
  # The collectives row names a Collective's fields, in order.
  row = next(r for r in section.splitlines() if r.startswith("| `collectives`"))
  named = re.findall(r"`(\w+)`", row.split("|")[2])
  assert named == list(Collective._fields), (named, Collective._fields)
  # And what the sentence after the table names is there.
  assert callable(Traffic.run) and callable(Traffic.table)
  assert isinstance(Traffic.widened, property)


def test_the_int8_wire_sends_the_block_size_and_scale_the_page_states():
  text = " ".join(PAGE.split())
  block = int(re.search(r"each chunk into blocks of (\d+) values", text)[1])
  scale = re.search(r"one (\w+) scale \((\d+) bytes\)", text)
  scale_bytes = int(scale[2])
  assert np.dtype(scale[1]).itemsize == scale_bytes
  assert "2 (g - 1) / g x (E + 4 b)" in text and scale_bytes == 4
  assert shardopt.quantized(jnp.int8).block_size == block

  # One leaf of 2 full blocks per chunk, one whose chunks (100 values) are
  # shorter than a block: one block each. Both share the two collectives.
  sizes = {"full": N * 2 * block, "short": N * 100}
  blocks = {"full": N * 2, "short": N}
  tx = shardopt.cross_shard_mean("i", comm_dtype=jnp.int8)
  step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")
  grads = {k: jnp.ones((N, size)) for k, size in sizes.items()}
  t = shardopt.measure.traffic(step, grads)
  wire = sum(sizes.values()) + scale_bytes * sum(blocks.values())
  assert t.per_step == 2 * (N - 1) / N * wire, t
  assert {d for op in t.collectives for d in op.dtypes} == {"uint8"}, t
