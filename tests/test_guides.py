"""The guides on the docs site run as written, and say what they show.

Every ```python block of a guide runs, in order, in one namespace (8 forced
CPU devices, see conftest.py), as a reader who pastes them one after the
other would run them. Each test then checks a property the page claims:
replicas agree, a restored run equals the straight run bit for bit, a
transform gives the numbers of its reference. docs/getting_started.md is
checked in tests/test_docs.py.
"""

import re

import jax
import numpy as np
import pytest
from _docs_pages import DOCS
from _docs_pages import blocks
from _docs_pages import run_page
from jax.sharding import PartitionSpec as P

GUIDES = ("coming_from_ddp", "diloco", "checkpointing", "noloco", "eager")


def _toctree(caption: str) -> list:
  """The entries of docs/index.md's toctree with this caption."""
  text = (DOCS / "index.md").read_text()
  for body in re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S):
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if f":caption: {caption}" in lines:
      return [line for line in lines if not line.startswith(":")]
  raise AssertionError(f"docs/index.md has no toctree captioned {caption!r}")


@pytest.mark.parametrize(
  "page", ("getting_started", *GUIDES, "model_parallel", "vmap")
)
def test_every_guide_is_in_the_guides_toctree_and_has_code(page):
  entries = _toctree("Guides")
  assert any(e == page or e.endswith(f"<{page}>") for e in entries), (
    f"docs/{page}.md is not in the Guides toctree of docs/index.md"
  )
  assert blocks(page), f"docs/{page}.md has no ```python block to run"


def test_coming_from_ddp():
  ns = run_page("coming_from_ddp")
  spread = ns["spread"]
  # DDP: replicas bit-identical, and equal to Adam on the whole batch.
  assert spread(ns["ddp"]) == 0.0
  for k, v in ns["single"].items():
    np.testing.assert_allclose(ns["ddp"][k][0], v, rtol=1e-5, atol=1e-6)
  assert np.abs(ns["ddp"]["w"][0] - ns["params"]["w"]).max() > 1e-2  # it moved
  # no_sync: 8 steps of accumulate(k=4) are 2 Adam steps on the mean gradient
  # of each group of 4.
  assert spread(ns["accumulated"]) == 0.0
  import optax

  multi = optax.MultiSteps(optax.adam(1e-2), 4)
  ref, state = ns["params"], multi.init(ns["params"])
  for x, y in zip(ns["xs"], ns["ys"]):
    grads = jax.grad(ns["loss"])(ref, x, y)
    updates, state = multi.update(grads, state, ref)
    ref = optax.apply_updates(ref, updates)
  for k, v in ref.items():
    np.testing.assert_allclose(ns["accumulated"][k][0], v, rtol=1e-5, atol=1e-6)
  # bf16 wire: in sync, close to float32, not equal.
  assert spread(ns["bf16"]) == 0.0
  diff = np.abs(ns["bf16"]["w"][0] - ns["ddp"]["w"][0]).max()
  assert 0.0 < diff < 4 * 1e-2  # within a few Adam steps of lr 1e-2
  # int8 + error feedback: in sync, close to float32, not equal.
  assert spread(ns["int8_ef"]) == 0.0
  diff = np.abs(ns["int8_ef"]["w"][0] - ns["ddp"]["w"][0]).max()
  assert 0.0 < diff < 4 * 1e-2
  assert spread(ns["low_rank"]) == 0.0
  assert np.isfinite(ns["low_rank"]["w"]).all()
  # local SGD: apart between averagings, together (to rounding) after.
  local = ns["local"]
  assert [spread(p) > 1e-3 for p in local] == [True] * 3 + [False] + [
    True
  ] * 3 + [False]
  assert spread(local[3]) < 1e-6 and spread(local[7]) < 1e-6
  # Hierarchical: pairs agree after step 6 (a pair step), the pairs do not;
  # everyone agrees after step 8.
  pairs = ns["pairs"]
  assert max(np.abs(v[:, 0] - v[:, 1]).max() for v in pairs.values()) < 1e-6
  assert spread(ns["hier"][5]) > 1e-3
  assert spread(ns["hier"][7]) < 1e-6
  # ZeRO: each replica holds 1/8 of Adam's moments; same numbers as DDP.
  assert ns["specs"][0].mu["w"] == P("data")
  assert ns["moments"][0].mu["w"].shape == (16, 8)  # 8 blocks of (2, 8)
  sharded = ns["sharded"]
  assert spread(sharded) == 0.0
  for k, v in ns["ddp"].items():
    np.testing.assert_allclose(sharded[k], v, rtol=1e-6, atol=1e-7)
  # GradScaler: every replica skipped step 3, as if it had not been there.
  assert spread(ns["guarded"]) == 0.0
  assert np.isfinite(ns["guarded"]["w"]).all()
  for k in ns["params"]:
    np.testing.assert_allclose(
      ns["guarded"][k], ns["without_step_3"][k], rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
      ns["free_guard"][k], ns["guarded"][k], rtol=1e-6, atol=1e-7
    )
  assert spread(ns["free_guard"]) == 0.0


@pytest.fixture(scope="module")
def diloco_page():
  return run_page("diloco")


def test_diloco(diloco_page):
  ns = diloco_page
  # An outer Adam's first step moves the center by -lr * sign(g), g = -3.5
  # (to Adam's epsilon).
  np.testing.assert_allclose(
    np.asarray(ns["adam_state"].center), 0.1, rtol=1e-5
  )
  # Islands apart between outer steps, together (to rounding) after 4 and 8.
  gaps = [g["w"] for g in ns["gaps"]]
  assert all(gaps[t] > 1e-3 for t in (0, 1, 2, 4, 5, 6)), gaps
  assert gaps[3] < 1e-6 and gaps[7] < 1e-6, gaps
  assert int(ns["state"].sync_count) == 2
  # The loop the host schedules: the same numbers to float32 rounding (the
  # in-graph step routes this example's updates through the sync's cond),
  # the same counters.
  for got, want in zip(
    jax.tree.leaves((ns["host_p"], ns["host_state"])),
    jax.tree.leaves((ns["p"], ns["state"])),
  ):
    np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7
    )
  assert int(ns["host_state"].count) == 8
  assert int(ns["host_state"].sync_count) == 2
  center = np.asarray(ns["state"].center["w"])
  np.testing.assert_allclose(
    np.asarray(ns["p"]["w"]).reshape(2, 16, 8),
    np.stack([center] * 2),
    atol=1e-6,
  )
  # The outer step by hand.
  np.testing.assert_allclose(
    np.asarray(ns["center"]), 0.8 * (3.5 + 0.2 * 3.5), rtol=1e-6
  )
  # Streaming: "b" (fragment 0) meets after steps 4 and 8, "w" after 2 and 6.
  together = [
    [t for t, g in enumerate(ns["streaming"], 1) if g[k] < 1e-6]
    for k in ("b", "w")
  ]
  assert together == [[4, 8], [2, 6]], ns["streaming"]
  # int8 wire: the islands meet after the sync, apart before it.
  assert ns["int8_gaps"][-2]["w"] > 1e-3
  assert ns["int8_gaps"][-1]["w"] < 1e-6
  assert np.isfinite(np.asarray(ns["int8_state"].center["w"])).all()


# A restore that raises leaves orbax reads in flight: as they finish they
# print "Event loop is closed" tracebacks, and coroutines never awaited are
# reported when collected. So the page compares shapes instead, and the
# restore that raises runs here in a fresh process (the page's blocks 0 and
# 2: the checkpoint after step 6 and the 4-replica target).
_RAISING_RESTORE = """
try:
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.restore(os.path.join(directory, "6"),
                       abstract({"params": p4, "opt_state": init4(params)}))
  print("restored onto 4 replicas")
except ValueError:
  print("restoring onto 4 replicas raised ValueError")
"""


def test_checkpointing():
  import subprocess
  import sys

  ns = run_page("checkpointing")
  resumed, straight = ns["resumed"], ns["straight"]
  assert jax.tree.structure(resumed) == jax.tree.structure(straight)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(straight[1].count) == 8 and int(straight[1].sync_count) == 2
  # Replicated state: restored onto the 4-replica mesh, the same values.
  mu = ns["dp_state4"][0].mu["w"]
  assert mu.shape == (16, 8) and dict(mu.sharding.mesh.shape) == {"data": 4}
  # The shapes that differ on 4 replicas are exactly the per-replica leaves
  # (P("data") in the 4-replica state's specs, and the params).
  per_replica = {
    "opt_state/" + jax.tree_util.keystr(path, simple=True, separator="/")
    for path, spec in jax.tree_util.tree_flatten_with_path(
      ns["specs4"], is_leaf=lambda x: isinstance(x, P)
    )[0]
    if spec == P("data")
  } | {"params/b", "params/w"}
  assert set(ns["mismatched"]) == per_replica, ns["mismatched"]
  for saved, target in ns["mismatched"].values():
    assert saved[0] == 2 * target[0] and saved[1:] == target[1:]
  # ... and restoring them onto 4 replicas raises.
  page = blocks("checkpointing")
  assert "build(tx, 4)" in page[2]
  done = subprocess.run(
    [sys.executable, "-c", page[0] + page[2] + _RAISING_RESTORE],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert "restoring onto 4 replicas raised ValueError" in done.stdout, (
    done.stdout[-2000:] + done.stderr[-3000:]
  )
  # Regrouped DiLoCo state: the center and counters carried over (2 outer
  # steps after step 8); a third outer step at step 12 brings the 4 replicas
  # together.
  state4 = ns["state4"]
  assert int(state4.count) == 12 and int(state4.sync_count) == 3
  w4 = ns["w4"]
  assert np.abs(w4 - w4[0]).max() < 1e-6
  assert np.abs(w4[0] - np.asarray(straight[1].center["w"])).max() > 1e-4
  old = ns["old"]["opt_state"]
  for a, b in zip(
    jax.tree.leaves(old.center), jax.tree.leaves(straight[1].center)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert old.local_state[0].mu["w"].shape == (8 * 16, 8)


def test_diloco_streaming_sections(diloco_page):
  """Layer fragments, overlap, warm start and error feedback as the DiLoCo
  guide shows them."""
  ns = diloco_page
  # Fragment 1 (rows 1, 5, 9, 13 of w: layer l in fragment l % 4) synced
  # after step 5; the others took local steps since their syncs.
  assert ns["met"] == [1, 5, 9, 13]
  assert ns["assignment"] == {"b": 0, "w": 1}  # "Coming from torchft"
  moments = jax.tree.leaves(ns["layered_state"].global_state)
  assert [m.shape for m in moments if m.ndim == 2] == [(4, 8)] * 4
  # Overlap, alpha = 0.5: w syncs after steps 2 and 6 and merges a step
  # later, halving its own share of the gap: it shrinks, never closes.
  gaps = [g["w"] for g in ns["overlap_gaps"]]
  assert gaps[2] < gaps[1] and gaps[6] < gaps[5], gaps
  assert min(gaps) > 1e-3, gaps
  # The syncs of steps 2, 4 and 6 are in; step 8's lands in the next update.
  assert int(ns["overlap_state"].sync_count) == 3
  # Warm start: identical for steps 1-2, one outer step (after step 6).
  warm = [g["w"] for g in ns["warm_gaps"]]
  assert warm[0] == warm[1] == 0.0 and warm[5] < 1e-6, warm
  assert min(warm[2:5]) > 1e-3, warm
  assert int(ns["warm_state"].sync_count) == 1
  errors = ns["ef_state"].error
  assert {k: v.dtype for k, v in errors.items()} == {
    "b": np.float32,
    "w": np.float32,
  }


def _hlo_computations(hlo: str) -> tuple[dict, str]:
  """{computation name: its instruction lines} and the ENTRY's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      current = head.group(2)
      comps[current] = []
      entry = current if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def _reachable(comps: dict, roots, into_branches: bool) -> set:
  """The computations ``roots`` call, transitively (a conditional's branches
  only with ``into_branches``)."""
  calls = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
  )
  seen, todo = set(), list(roots)
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for line in comps[name]:
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches and not into_branches:
        continue
      callees = calls.findall(line)
      if branches:
        callees += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
      todo += [c for c in callees if c in comps]
  return seen


def test_vmap_route_matches_shard_map_bit_for_bit_and_syncs_only_in_branch():
  """docs/vmap.md: DiLoCo under jax.vmap(axis_name=, spmd_axis_name=) with
  shardopt.vmap_axes gives the params of the same run under jax.shard_map
  (docs/model_parallel.md's layout) bit for bit, and its compiled step runs
  every collective over "data" inside the sync branch of a conditional."""
  from _model_parallel import collectives
  from jax.sharding import NamedSharding

  import shardopt

  ns = run_page("vmap")
  mesh, tx, step, params = ns["mesh"], ns["tx"], ns["step"], ns["params"]
  model_specs = ns["model_specs"]
  w1 = np.asarray(ns["p"]["w1"])
  assert w1.shape == (4, 16, 32)
  assert not np.allclose(w1[0], params["w1"])  # it trained

  # (a) The same run under jax.shard_map: concatenated P("data") blocks.
  blocks = {"w1": P("data", "model"), "w2": P(("data", "model"), None)}
  with jax.set_mesh(mesh):
    replica = {
      k: jax.device_put(v, NamedSharding(mesh, model_specs[k]))
      for k, v in params.items()
    }
    specs = shardopt.state_specs(tx, replica, "data")
    init = jax.shard_map(
      tx.init, mesh=mesh, in_specs=P(), out_specs=specs, axis_names={"data"}
    )
    state = jax.jit(init)(replica)
    shard_step = jax.jit(
      jax.shard_map(
        lambda p, s, x, y: step(p, s, x[0], y[0]),
        mesh=mesh,
        in_specs=(P("data"), specs, P("data"), P("data")),
        out_specs=(P("data"), specs),
        axis_names={"data"},
      )
    )
    p = {
      k: jax.device_put(np.concatenate([v] * 4), NamedSharding(mesh, blocks[k]))
      for k, v in params.items()
    }
    for x, y in ns["batches"]:
      p, state = shard_step(p, state, x, y)
  for k, v in ns["p"].items():
    np.testing.assert_array_equal(
      np.asarray(v), np.asarray(p[k]).reshape(v.shape)
    )

  # (b) The vmapped step's collectives over "data": only in a sync branch.
  with jax.set_mesh(mesh):
    x, y = (
      jax.device_put(a, NamedSharding(mesh, P("data")))
      for a in ns["batches"][0]
    )
    hlo = ns["vstep"].lower(ns["p"], ns["state"], x, y).compile().as_text()
  comps, entry = _hlo_computations(hlo)
  outside = _reachable(comps, [entry], into_branches=False)
  sync, local = set(), set()
  for name in outside:
    for line in comps[name]:
      found = re.search(r"branch_computations=\{([^}]*)\}", line)
      if found:  # lax.cond: [false branch, true branch]
        false, true = (b.strip().lstrip("%") for b in found.group(1).split(","))
        sync |= _reachable(comps, [true], into_branches=True)
        local |= _reachable(comps, [false], into_branches=True)

  def over(names, axis):
    return [
      op
      for name in names
      for op in collectives("\n".join(comps[name]), mesh)
      if axis in op["axes"]
    ]

  assert not over(outside, "data"), [op["line"] for op in over(outside, "data")]
  assert not over(local, "data"), [op["line"] for op in over(local, "data")]
  in_sync = over(sync, "data")
  assert any(op["kind"] == "all-reduce" for op in in_sync), in_sync
  # What the entry does hold: the row-parallel w2's all-reduce over "model".
  entry_ops = collectives("\n".join(comps[entry]), mesh)
  assert entry_ops and all(op["axes"] == {"model"} for op in entry_ops)


def test_model_parallel_out_sharding_note_holds():
  """docs/model_parallel.md: on an Explicit mesh a contraction over a dimension
  sharded over "model" needs out_sharding (JAX's ShardingTypeError, quoted on
  the page); with it the matmul runs; on an Auto mesh it runs without."""
  import jax.numpy as jnp
  from jax.sharding import AxisType

  page = (DOCS / "model_parallel.md").read_text()
  quoted = "Contracting dimensions are sharded and it is ambiguous how"
  assert quoted in page.replace("\n", " ")
  for axis_type, needs in ((AxisType.Explicit, True), (AxisType.Auto, False)):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
      shard = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))
      h = shard(jnp.ones((8, 16)), P(None, "model"))
      w2 = shard(jnp.ones((16, 4)), P("model", None))
      if needs:
        with pytest.raises(Exception, match=quoted):
          jax.jit(lambda h, w: h @ w)(h, w2)
      else:
        assert float(jax.jit(lambda h, w: h @ w)(h, w2)[0, 0]) == 16.0
      out = jax.jit(lambda h, w: jnp.matmul(h, w, out_sharding=P(None, None)))
      assert float(out(h, w2)[0, 0]) == 16.0


def test_noloco_page():
  ns = run_page("noloco")
  spread = ns["spread"]
  # never identical, and the spread settles (the last syncs' no wider than
  # twice the first's largest)
  assert all(s > 0 for s in spread), spread
  assert max(spread[-4:]) < 2 * max(spread[:4]), spread
  # the replicas' average learns the regression (weights of order 1)
  assert ns["err"] < 0.3, ns["err"]
  kinds = {op.kind for op in ns["ops"]}
  assert kinds == {"collective-permute"}, kinds
  assert len(ns["ops"]) == 16
  assert {op.buffer_bytes for op in ns["ops"]} == {16 * 4 * 4}
  assert all(op.context == "conditional" for op in ns["ops"])


def test_eager_page():
  ns = run_page("eager")
  plain, eager = ns["plain"], ns["eager"]
  assert plain[1] == eager[1] and any(k == "all-reduce" for k, _ in eager[1])
  assert plain[2] < 0.05 and eager[2] < 0.3, (plain[2], eager[2])
  assert ("all-reduce", 16 * 4 * 4 + 4) in eager[1]
  centers = np.asarray(eager[0].center)
  assert np.ptp(centers, axis=0).max() > 0  # the own terms: not identical
  assert np.ptp(np.asarray(plain[0].center), axis=0).max() == 0
