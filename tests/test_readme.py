"""The README's Python examples run as written (8 forced CPU devices)."""

import pathlib
import re

import jax
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
  assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_and_replicas_agree(index):
  namespace = {}
  exec(
    compile(BLOCKS[index], f"README.md[python block {index}]", "exec"),
    namespace,
  )
  w = np.asarray(namespace["w"])
  assert np.all(np.isfinite(w))
  if w.ndim == 2:  # pmap example: one row per device, all bit-identical
    assert w.shape[0] == jax.local_device_count()
    np.testing.assert_array_equal(w, np.broadcast_to(w[0], w.shape))
  # One Adam step of size lr=1e-2 moves each weight by ~+1e-2 (gradient is negative).
  np.testing.assert_allclose(w.reshape(-1, 4)[0], np.full(4, 1e-2), rtol=1e-3)


def _compared_section():
  text = README.read_text()
  start = text.index("## Compared with")
  end = text.index("\n## ", start + 1)
  return text[start:end]


def test_feature_table_names_every_public_name_and_only_real_ones():
  """The README's feature table lists every name shardopt exports, and every
  shardopt name in its shardopt column exists."""
  import shardopt

  section = _compared_section()
  mentioned = set(re.findall(r"`([A-Za-z_]\w*)", section))
  missing = [name for name in shardopt.__all__ if name not in mentioned]
  assert not missing, f"README's feature table does not mention {missing}"
  rows = [
    r for r in section.splitlines() if r.startswith("| ") and "---" not in r
  ]
  for row in rows[1:]:
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
    for token in re.findall(r"`([^`]*)`", cells[1]):
      if token.startswith("shardopt."):
        token = token[len("shardopt.") :]
      elif re.match(r"[A-Za-z_]\w*\.", token):
        continue  # another library's name (optax.MultiSteps)
      name = re.match(r"[A-Za-z_]\w*", token)
      if name is None or re.match(r"[A-Za-z_]\w*\s*=", token):
        continue  # a keyword argument (comm_dtype=...), not a public name
      assert hasattr(shardopt, name.group(0)), (
        f"README's feature table names shardopt.{name.group(0)}, which does"
        f" not exist (row: {row[:80]}...)"
      )
