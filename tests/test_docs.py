"""The docs site covers the API: every exported name has an entry.

``make docs`` builds the site with ``-W`` and ``nitpicky`` (CI runs it); these
tests catch, in the fast suite, what that build cannot: a name added to
``shardopt.__all__`` without an entry in ``docs/api/*.rst`` builds cleanly but
is missing from the reference.
"""

import pathlib
import re

import jax
import numpy as np
import pytest

import shardopt

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
DIRECTIVE = re.compile(
  r"^\.\. auto(?:function|class|exception|data)::\s+(?:shardopt\.)?([\w.]+)",
  re.M,
)
# Public subpackages, whose names are documented as "elastic.Island".
SUBPACKAGES = ("elastic", "measure", "wire")


def _exported() -> list:
  """shardopt.__all__'s names, a subpackage's as "subpackage.name"."""
  names = [n for n in shardopt.__all__ if n not in SUBPACKAGES]
  for sub in SUBPACKAGES:
    names += [f"{sub}.{n}" for n in getattr(shardopt, sub).__all__]
  return names


def _documented() -> dict:
  """Each name with an autodoc entry in docs/api/*.rst -> the files it is in."""
  found = {}
  for rst in sorted(API.glob("*.rst")):
    for name in DIRECTIVE.findall(rst.read_text()):
      found.setdefault(name, []).append(rst.name)
  return found


def _toctree(index_text: str) -> list:
  block = index_text.split(".. toctree::", 1)[1]
  lines = block.split("\n\n", 2)[1]  # after the options, before the next gap
  return [line.strip() for line in lines.splitlines() if line.strip()]


@pytest.mark.parametrize("name", sorted(_exported()))
def test_every_exported_name_has_an_api_entry(name):
  assert name in _documented(), (
    f"shardopt.{name} is exported but has no `.. autofunction:: {name}` (or"
    " autoclass/autoexception) in docs/api/*.rst; see"
    " docs/CONTRIBUTING-docs.md"
  )


def test_no_name_is_documented_twice_or_without_being_exported():
  documented = _documented()
  assert {n: f for n, f in documented.items() if len(f) > 1} == {}
  assert sorted(set(documented) - set(_exported())) == []


def test_every_api_page_is_in_the_api_toctree():
  pages = _toctree((API / "index.rst").read_text())
  assert sorted(pages) == sorted(
    p.stem for p in API.glob("*.rst") if p.stem != "index"
  )


GETTING_STARTED = ROOT / "docs" / "getting_started.md"


def _getting_started_blocks() -> list:
  return re.findall(r"```python\n(.*?)```", GETTING_STARTED.read_text(), re.S)


def test_getting_started_leads_with_jit_and_shard_map_then_pmap():
  first, *rest = _getting_started_blocks()
  for needle in (
    "jax.jit",
    "jax.shard_map",
    "shardopt.cross_shard_mean",
    "pcast",
  ):
    assert needle in first, f"getting_started.md's first example lacks {needle}"
  assert "pmap" not in first
  assert any("jax.pmap" in block for block in rest)


def test_getting_started_examples_run_and_replicas_agree():
  """Every example of the page runs, in order, in one namespace; each leaves
  `w` after one Adam step (lr 1e-2: every weight moves by ~+1e-2)."""
  namespace = {}
  for index, block in enumerate(_getting_started_blocks()):
    exec(
      compile(block, f"getting_started.md[python block {index}]", "exec"),
      namespace,
    )
    w = namespace["w"]
    rows = np.asarray(w).reshape(-1, 4)
    assert np.all(np.isfinite(rows))
    if index == 0:  # jit + shard_map: one replicated array, the P() params
      assert w.shape == (4,) and w.sharding.is_fully_replicated
    else:  # pmap: one row per device, all bit-identical
      assert rows.shape[0] == jax.local_device_count()
    np.testing.assert_array_equal(rows, np.broadcast_to(rows[0], rows.shape))
    np.testing.assert_allclose(rows[0], np.full(4, 1e-2), rtol=1e-3)


def test_getting_started_guard_inside_accumulate_skips_the_nan_period():
  """The recipe's run: period 1 is one Adam step on the mean gradient (as
  optax computes it on the whole batch), period 2 met a NaN on one replica and
  is skipped on every replica (`wg` unchanged, one non-finite step counted)."""
  import optax

  namespace = {}
  for index, block in enumerate(_getting_started_blocks()):
    exec(
      compile(block, f"getting_started.md[python block {index}]", "exec"),
      namespace,
    )
  assert "accumulate(" in _getting_started_blocks()[-1]
  loss, adam = namespace["loss"], optax.adam(1e-2)
  w = np.zeros(4, np.float32)
  grads = jax.grad(loss)(w, np.ones((256, 4), np.float32), np.ones(256))
  updates, _ = adam.update(grads, adam.init(w), w)
  want = optax.apply_updates(w, updates)
  wg = namespace["wg"]
  assert wg.sharding.is_fully_replicated
  np.testing.assert_allclose(np.asarray(wg), want, rtol=1e-6)
  total = optax.tree_utils.tree_get(namespace["state"], "total_notfinite")
  assert int(total) == 1
