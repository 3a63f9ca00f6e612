"""The README's Python examples run as written (8 forced CPU devices)."""

import pathlib
import re

import jax
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
  assert len(BLOCKS) >= 2


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
