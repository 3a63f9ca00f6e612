"""Which leaves form each Streaming DiLoCo fragment, as a user prints it.

``shardopt.periodic.fragments.fragment_of`` and ``describe_fragments`` must
name the fragments ``diloco(..., num_fragments=F)`` really syncs: checked
here against what the transform does (under ``jax.pmap`` on 2 replicas with
different gradients, the leaves, or rows of a stacked leaf, that the
replicas share after step ``t`` are those of the fragment that synced at
``t``, by the schedule docs/diloco.md states), and against byte counts made
in numpy from the shapes alone.
"""

import doctest
import re

import jax
import numpy as np
import optax
import pytest

import shardopt
from shardopt.periodic import fragments as fragments_module
from shardopt.periodic.describe import describe_fragments
from shardopt.periodic.fragments import fragment_of

R = 2  # replicas
LEAVES = {  # bytes 12, 80, 8, 84, 16, 40: contiguous fragments by bytes
  "a": (3,),
  "b": (5, 4),
  "c": (2,),
  "d": (7, 3),
  "e": (4,),
  "f": (10,),
}


def _params(shapes, dtype=np.float32):
  rng = np.random.default_rng(0)
  return {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}


def _synced_at(t, period, num_fragments, offset=0):
  """The fragment that syncs after step t, by docs/diloco.md's rule:
  fragment f after step t iff t % H == (f H // F + offset) % H."""
  for f in range(num_fragments):
    if t % period == ((f * period) // num_fragments + offset) % period:
      return f
  return None


def _run_diloco(params, steps, **kwargs):
  """Params on each replica after every step of diloco(sgd) under pmap,
  each replica with its own random gradients; numpy, leading axis R."""
  tx = shardopt.diloco(optax.sgd(0.1), "r", **kwargs)
  devices = jax.devices()[:R]

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  init = jax.pmap(tx.init, axis_name="r", devices=devices)
  step = jax.pmap(step, axis_name="r", devices=devices)
  p = jax.tree.map(lambda x: np.stack([x] * R), params)
  state = init(p)
  rng = np.random.default_rng(1)
  out = []
  for _ in range(steps):
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), p)
    p, state = step(p, state, grads)
    out.append(jax.tree.map(np.asarray, p))
  return out


def _gap(x, axis=None):
  """max |replica 0 - replica 1|, over everything or per index of ``axis``
  (an axis of one replica's leaf)."""
  diff = np.abs(x[0].astype(np.float64) - x[1])
  if axis is None:
    return diff.max()
  return np.moveaxis(diff, axis, 0).reshape(diff.shape[axis], -1).max(1)


def test_the_module_docstring_examples_print_what_they_say():
  result = doctest.testmod(fragments_module, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 4 and result.failed == 0, result


def test_whole_leaf_fragments_are_the_leaves_diloco_syncs_together():
  params, period, num_fragments = _params(LEAVES), 6, 3
  assignment = fragment_of(params, num_fragments)
  assert list(assignment) == sorted(LEAVES)  # jax.tree.leaves order
  # Contiguous, every fragment non-empty, in order.
  assert sorted(assignment.values()) == list(assignment.values())
  assert set(assignment.values()) == set(range(num_fragments))
  history = _run_diloco(
    params, period, sync_period=period, num_fragments=num_fragments
  )
  seen = set()
  for t, p in enumerate(history, start=1):
    gaps = {k: _gap(v) for k, v in p.items()}
    # Every leaf is clearly together (pulled onto the center, to a few ulp)
    # or clearly apart (different gradients on the two replicas).
    assert all(g < 1e-6 or g > 1e-3 for g in gaps.values()), (t, gaps)
    together = {k for k, g in gaps.items() if g < 1e-6}
    f = _synced_at(t, period, num_fragments)
    want = {k for k, frag in assignment.items() if frag == f}
    assert together == want, (t, f, gaps, assignment)
    seen |= together
  assert seen == set(LEAVES)  # every fragment synced once in the period


def test_layer_fragments_are_the_rows_diloco_syncs_together():
  """With layer_axes: layer l of a stacked leaf in fragment l % F, the other
  leaves whole; and sync_offset moves the steps as describe_fragments says."""
  shapes = {"emb": (6, 4), "stack": (8, 3), "norm": (3,)}
  params, period, num_fragments, offset = _params(shapes), 4, 4, 1
  layer_axes = {"emb": None, "stack": 0, "norm": None}
  assignment = fragment_of(params, num_fragments, layer_axes)
  assert assignment["stack"] == tuple(layer % 4 for layer in range(8))
  history = _run_diloco(
    params,
    period,
    sync_period=period,
    num_fragments=num_fragments,
    layer_axes=layer_axes,
    sync_offset=offset,
  )
  text = describe_fragments(
    params,
    num_fragments,
    layer_axes,
    sync_period=period,
    sync_offset=offset,
  )
  said = {
    int(f): int(t)
    for f, t in re.findall(r"fragment (\d+): syncs after step (\d+)", text)
  }
  for t, p in enumerate(history, start=1):
    f = _synced_at(t, period, num_fragments, offset)
    assert said[f] == t, text
    rows = _gap(p["stack"], axis=0)
    assert all(g < 1e-6 or g > 1e-3 for g in rows), (t, rows)
    together = [layer for layer, g in enumerate(rows) if g < 1e-6]
    assert together == [
      layer for layer, frag in enumerate(assignment["stack"]) if frag == f
    ], (t, rows)
    assert f"layers {', '.join(map(str, together))} of axis 0" in text
    for k in ("emb", "norm"):
      assert (_gap(p[k]) < 1e-6) == (assignment[k] == f), (t, k)


@pytest.mark.parametrize(
  "num_fragments, layer_axes",
  [
    (1, None),
    (2, None),
    (4, None),
    (6, None),
    (2, 0),
    (4, {"x": 0, "y": None}),
  ],
  ids=["F1", "F2", "F4", "F6", "all-stacked", "mixed"],
)
def test_the_table_bytes_add_up_to_the_leaves_it_names(
  num_fragments, layer_axes
):
  """Each fragment's bytes in the table equal a numpy count of what
  fragment_of assigns to it, and they sum to the params' bytes."""
  shapes = (
    LEAVES
    if layer_axes is None
    else {"x": (8, 5), "y": (3,), "z": (4, 2)}
    if isinstance(layer_axes, dict)
    else {"x": (4, 5), "z": (8, 2)}
  )
  params = _params(shapes, np.float16)
  if isinstance(layer_axes, dict):
    layer_axes = {**layer_axes, "z": None}
  assignment = fragment_of(params, num_fragments, layer_axes)
  text = describe_fragments(params, num_fragments, layer_axes)
  # Shapes and dtypes are enough (no arrays needed).
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  assert fragment_of(abstract, num_fragments, layer_axes) == assignment
  assert describe_fragments(abstract, num_fragments, layer_axes) == text
  said = [
    int(b.replace(",", ""))
    for b in re.findall(r"^fragment \d+: ([\d,]+) bytes$", text, re.M)
  ]
  want = [0] * num_fragments
  for k, frag in assignment.items():
    nbytes = params[k].nbytes
    if isinstance(frag, int):
      want[frag] += nbytes
    else:
      for f in frag:
        want[f] += nbytes // len(frag)
  assert said == want, text
  assert sum(said) == sum(x.nbytes for x in params.values())
  # Every leaf appears in the table, with its shape and dtype.
  for k, x in params.items():
    assert re.search(
      rf"^  {k}\s+\({', '.join(map(str, x.shape))},?\)\s+"
      rf"float16",
      text,
      re.M,
    ), (k, text)


def test_bad_fragment_counts_say_what_to_change():
  params = _params({"a": (3,), "b": (4,)})
  with pytest.raises(ValueError, match="num_fragments <= 2"):
    fragment_of(params, 3)
  for bad in (0, -1, 1.5, True, None):
    with pytest.raises(ValueError, match="num_fragments"):
      fragment_of(params, bad)
  with pytest.raises(ValueError, match="sync_period=1"):
    describe_fragments(params, 2, sync_period=1)


def test_docs_diloco_printout_is_what_the_page_shows(capsys):
  """docs/diloco.md's "Coming from torchft" snippet prints the text block
  under it, with the page's params (its first block's)."""
  import pathlib

  page = (
    pathlib.Path(__file__).resolve().parents[1] / "docs" / "diloco.md"
  ).read_text()
  first = re.findall(r"```python\n(.*?)```", page, re.S)[0]
  setup = [
    line
    for line in first.splitlines()
    if line.startswith(("rng = ", "params = "))
  ]
  assert len(setup) == 2, setup
  found = re.search(
    r"```python\n([^`]*describe_fragments[^`]*)```\n\n```text\n(.*?)```",
    page,
    re.S,
  )
  assert found, "docs/diloco.md has no describe_fragments block + output"
  namespace = {"np": np}
  exec("\n".join(setup) + "\n" + found.group(1), namespace)
  assert capsys.readouterr().out == found.group(2)
  assert namespace["assignment"] == {"b": 0, "w": 1}
