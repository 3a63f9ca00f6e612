"""Every transform inside model-parallel replicas (issue 21).

A 2-layer MLP whose params are sharded over a "model" axis (tensor
parallel: ``w1`` column-parallel, ``w2`` row-parallel) is trained with each
public transform over the "data" axis of a partial-manual ``jax.shard_map``
(``axis_names={"data"}``) on a ``(data=4, model=2)`` mesh, Auto and Explicit.
The reference is the same run on a data-only mesh of 4 devices (no model
axis): the numbers must agree to 1e-6 at every step, the data replicas must be
bit-identical wherever the transform makes them so, and the compiled step may
add collectives over the data axis only, each moving a device's model shard.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _model_parallel import HIDDEN
from _model_parallel import IN
from _model_parallel import OUT
from _model_parallel import STEPS
from _model_parallel import collectives
from _model_parallel import make_mesh
from _model_parallel import train
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardopt

LR = 0.05
ALL = tuple(range(1, STEPS + 1))


def _adam():
  return optax.adam(LR)


# name -> (factory, steps after which the data replicas agree: bit for bit
# for the transforms that apply reduced updates (ALL); for the periodic ones
# the params after a sync are p + (center - p), the center rounded once more
# by optax.apply_updates on each replica, so they agree to float32 rounding
# (the center itself is bit-identical: typed invariant, P() in state_specs).
TRANSFORMS = {
  "cross_shard": (lambda: shardopt.cross_shard(_adam(), "data"), ALL),
  "chain(clip, cross_shard_mean)": (
    lambda: optax.chain(
      optax.clip_by_global_norm(0.5), shardopt.cross_shard_mean("data"), _adam()
    ),
    ALL,
  ),
  "chain(cross_shard_sum)": (
    lambda: optax.chain(shardopt.cross_shard_sum("data"), optax.sgd(0.01)),
    ALL,
  ),
  "tower": (lambda: shardopt.tower(_adam(), "data"), ALL),
  "tower(clip_by_global_norm)": (
    lambda: shardopt.tower(
      optax.chain(shardopt.clip_by_global_norm(0.3, "data"), _adam()), "data"
    ),
    ALL,
  ),
  "powersgd": (
    lambda: optax.chain(shardopt.powersgd("data", rank=2), _adam()),
    ALL,
  ),
  "accumulate": (
    lambda: shardopt.accumulate(shardopt.cross_shard(_adam(), "data"), 2),
    ALL,
  ),
  "apply_if_finite": (
    lambda: shardopt.apply_if_finite(
      shardopt.cross_shard(_adam(), "data"), 3, axis_name="data"
    ),
    ALL,
  ),
  "local_sgd": (
    lambda: shardopt.local_sgd(_adam(), "data", sync_period=2),
    (2, 4, 6),
  ),
  "agn": (
    lambda: shardopt.agn(_adam(), "data", sync_period=2),
    (2, 4, 6),
  ),
  "diloco": (
    lambda: shardopt.diloco(_adam(), "data", sync_period=3),
    (3, 6),
  ),
  "diloco(num_fragments=2)": (
    lambda: shardopt.diloco(_adam(), "data", sync_period=2, num_fragments=2),
    (),
  ),
  "hierarchical_local_sgd": (
    lambda: shardopt.hierarchical_local_sgd(
      _adam(), "data", period_group_sizes={2: 2, 4: 4}
    ),
    (4,),
  ),
  # Issue 51's transforms. DES-LOC: params every 2, Adam's moments every 3
  # and 6 (each in the round of its sync). NoLoCo and Eager updates keep
  # per-replica params by design (one peer; each replica's own term): no
  # step where the data replicas agree.
  "desloc": (
    lambda: shardopt.desloc(
      _adam(), "data", sync_period=2, state_sync_periods={"mu": 3, "nu": 6}
    ),
    (2, 4, 6),
  ),
  "noloco": (
    lambda: shardopt.noloco(_adam(), "data", sync_period=2, num_matchings=2),
    (),
  ),
  "diloco(eager=True)": (
    lambda: shardopt.diloco(_adam(), "data", sync_period=2, eager=True),
    (),
  ),
}
# Model collectives a transform may add beyond plain optax's (elements): the
# finite flags of a sync (a reduction of one bool over the model shards), and
# PowerSGD's factors (M Q contracts the model-sharded dimension: rank x 32).
EXTRA_MODEL_ELEMS = {"powersgd": 2 * HIDDEN}
LOCAL_SHARD = max(IN * HIDDEN, HIDDEN * OUT) // 2  # the largest shard (elems)
# A grouped all-reduce inside model-parallel replicas is one all-reduce over
# the axis of a buffer with a slot per group (collectives.py): 2 pairs here.
DATA_SLOTS = {"hierarchical_local_sgd": 2}
PARAM_BYTES = 4 * (IN * HIDDEN + HIDDEN + HIDDEN * OUT)


@functools.cache
def _reference(name):
  history, _, _ = train(TRANSFORMS[name][0], make_mesh({"data": 4}), ("data",))
  return history


def _check_against_reference(
  history, reference, synced, replicas_axis=0, exact=True
):
  for t in range(STEPS):
    for k in reference[t]:
      np.testing.assert_allclose(
        history[t][k],
        reference[t][k],
        rtol=1e-6,
        atol=1e-6,
        err_msg=f"step {t + 1}, leaf {k}",
      )
      if t + 1 in synced:
        replicas = history[t][k]
        for r in range(1, replicas.shape[replicas_axis]):
          if exact:
            np.testing.assert_array_equal(
              replicas[r], replicas[0], err_msg=f"replica {r}, step {t + 1}"
            )
          else:
            np.testing.assert_allclose(
              replicas[r], replicas[0], rtol=2e-7, atol=1e-8
            )


@pytest.mark.parametrize(
  "axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"]
)
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_model_sharded_run_matches_data_only_run(name, axis_type):
  make_tx, synced = TRANSFORMS[name]
  history, _, _ = train(
    make_tx,
    make_mesh({"data": 4, "model": 2}, axis_type),
    ("data",),
    explicit=axis_type == AxisType.Explicit,
  )
  _check_against_reference(
    history, _reference(name), synced, exact=synced == ALL
  )


HOST_SCHEDULED = (
  "accumulate",
  "local_sgd",
  "agn",
  "diloco",
  "diloco(num_fragments=2)",
  "hierarchical_local_sgd",
)


@pytest.mark.parametrize(
  "axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"]
)
@pytest.mark.parametrize("name", HOST_SCHEDULED)
def test_host_scheduled_steps_inside_model_parallel_replicas(name, axis_type):
  """``sync=shardopt.due(tx, t)`` in the partial-manual shard_map: the
  data-only in-graph run's numbers, the replicas agreeing after each sync."""
  make_tx, synced = TRANSFORMS[name]
  history, _, _ = train(
    make_tx,
    make_mesh({"data": 4, "model": 2}, axis_type),
    ("data",),
    explicit=axis_type == AxisType.Explicit,
    host=True,
  )
  _check_against_reference(
    history, _reference(name), synced, exact=synced == ALL
  )


ISLANDS = {
  "diloco(cross_shard) over islands": (
    lambda: shardopt.diloco(
      shardopt.cross_shard(_adam(), "data"), "island", sync_period=3
    ),
    (3, 6),
  ),
  "local_sgd(cross_shard) over islands": (
    lambda: shardopt.local_sgd(
      shardopt.cross_shard(_adam(), "data"), "island", sync_period=2
    ),
    (2, 4, 6),
  ),
}


@pytest.mark.parametrize("name", list(ISLANDS))
def test_islands_with_a_model_axis_match_the_run_without(name):
  """(island=2, data=2, model=2): DiLoCo across islands, synchronous data
  parallelism within each, tensor parallelism within each replica."""
  make_tx, synced = ISLANDS[name]
  manual = ("island", "data")
  reference, _, _ = train(
    make_tx,
    make_mesh({"island": 2, "data": 2}),
    manual,
    params_axes=("island",),
  )
  history, hlo, _ = train(
    make_tx,
    make_mesh({"island": 2, "data": 2, "model": 2}),
    manual,
    params_axes=("island",),
  )
  _check_against_reference(history, reference, synced, exact=False)
  mesh = make_mesh({"island": 2, "data": 2, "model": 2})
  for op in collectives(hlo, mesh):
    if "model" not in op["axes"]:
      assert op["elems"] <= LOCAL_SHARD, op["line"]


def _plain_optax_hlo(mesh):
  """The same step with plain optax (no cross-replica communication)."""
  return train(lambda: _adam(), mesh, ("data",))[1]


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_no_collective_over_the_model_axis_beyond_plain_optax(name):
  """The compiled step (Auto axes) against plain optax's in the same layout:
  every extra collective runs over "data" only and moves at most a device's
  model shard of a leaf; over "model" only the finite flags (one element)
  and, for PowerSGD, factor-sized reductions are added."""
  mesh = make_mesh({"data": 4, "model": 2})
  _, hlo, _ = train(TRANSFORMS[name][0], mesh, ("data",))
  ops = collectives(hlo, mesh)
  plain = collectives(_plain_optax_hlo(mesh), mesh)
  data_bytes = 0
  for op in ops:
    if op["axes"] == {"data"}:
      bound = LOCAL_SHARD * DATA_SLOTS.get(name, 1)
      assert op["elems"] <= bound, (
        f"{name}: a collective over 'data' moves {op['elems']} elements, more"
        f" than the largest model shard ({bound}):\n{op['line']}"
      )
      data_bytes += op["bytes"]
  model = collections.Counter(
    (op["kind"], op["elems"]) for op in ops if "model" in op["axes"]
  )
  model.subtract(
    collections.Counter(
      (op["kind"], op["elems"]) for op in plain if "model" in op["axes"]
    )
  )
  limit = EXTRA_MODEL_ELEMS.get(name, 1)
  extra = {k: v for k, v in model.items() if v > 0}
  assert all(elems <= limit for _, elems in extra), (
    f"{name}: collectives over the model axis beyond plain optax's: {extra}"
  )
  print(
    f"{name}: {data_bytes} B per device over 'data' in the compiled step"
    f" (every branch), params {PARAM_BYTES} B, {PARAM_BYTES // 2} B per device"
  )


def test_tower_state_is_one_eighth_of_the_params_per_device():
  """tower's adam moments on a (data=4, model=2) mesh: each device holds
  1 / (4 x 2) of every leaf's mu and nu, and no all-gather over "model"."""
  mesh = make_mesh({"data": 4, "model": 2})
  _, hlo, state = train(TRANSFORMS["tower"][0], mesh, ("data",))
  param_bytes = PARAM_BYTES
  for field in ("mu", "nu"):
    moments = optax.tree_utils.tree_get(state, field)
    per_device = sum(
      leaf.addressable_shards[0].data.nbytes
      for leaf in jax.tree.leaves(moments)
    )
    print(f"tower {field}: {per_device} B per device of {param_bytes} B")
    assert per_device * 8 == param_bytes, (field, per_device, param_bytes)
  gathers = [
    op
    for op in collectives(hlo, mesh)
    if op["kind"] == "all-gather" and "model" in op["axes"]
  ]
  assert not gathers, [op["line"] for op in gathers]


def test_state_specs_name_the_per_replica_leaves():
  """state_specs against the per-replica fields each transform documents."""
  mesh = make_mesh({"data": 4})
  params = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}
  rep, per = P(), P("data")
  specs = shardopt.state_specs(
    shardopt.diloco(_adam(), "data"), params, "data", mesh=mesh
  )
  assert specs.center == {"w": rep} and specs.count == rep
  assert specs.local_state[0].mu == {"w": per}
  assert specs.global_state[0].trace == {"w": rep}
  assert specs.restart == per and specs.skipped == rep
  specs = shardopt.state_specs(
    optax.chain(shardopt.powersgd("data", rank=1), _adam()),
    params,
    "data",
    mesh=mesh,
  )
  assert specs[0].error == {"w": per} and specs[0].q == {"w": rep}
  assert specs[1][0].mu == {"w": rep}
  specs = shardopt.state_specs(
    shardopt.tower(_adam(), "data"), params, "data", mesh=mesh
  )
  assert specs[0].mu == {"w": per} and specs[0].count == rep
  specs = shardopt.state_specs(
    shardopt.accumulate(shardopt.cross_shard(_adam(), "data"), 2),
    params,
    "data",
    mesh=mesh,
  )
  assert specs.acc_grads == {"w": per} and specs.inner_state[0].mu == {"w": rep}
  specs = shardopt.state_specs(
    shardopt.cross_shard(
      _adam(), "data", comm_dtype=jnp.int8, error_feedback=True
    ),
    params,
    "data",
    mesh=mesh,
  )
  assert specs.error == {"w": per} and specs.inner_state[0].mu == {"w": rep}


def test_state_specs_errors_name_the_fix():
  params = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}
  tx = shardopt.cross_shard(_adam(), "data")
  with pytest.raises(ValueError, match="no mesh to trace on.*mesh="):
    shardopt.state_specs(tx, params, "data")
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    shardopt.state_specs(tx, params, "batch", mesh=make_mesh({"data": 4}))
  with pytest.raises(ValueError, match="axis_name=None"):
    shardopt.state_specs(tx, params, None, mesh=make_mesh({"data": 4}))


@pytest.mark.parametrize(
  "make_tx",
  [
    lambda: shardopt.local_sgd(optax.sgd(0.1), "data", sync_period=2),
    lambda: shardopt.diloco(optax.sgd(0.1), "data", sync_period=2),
    lambda: shardopt.agn(optax.sgd(0.1), "data", sync_period=2),
  ],
  ids=["local_sgd", "diloco", "agn"],
)
def test_vmap_with_batched_counters_raises_and_points_to_shard_map(make_tx):
  """Under jax.vmap(axis_name=...) with the state vmapped (a per-replica
  counter), a lax.cond becomes a select of both branches: the sync's
  all-reduce would run every step. shardopt raises instead."""
  tx = make_tx()
  params = {"w": jnp.ones((4, 3))}
  state = jax.vmap(tx.init, axis_name="data")(params)

  def step(p, s, g):
    return tx.update(g, s, p)[0]

  with pytest.raises(ValueError, match="batched by jax.vmap.*jax.shard_map"):
    jax.jit(jax.vmap(step, axis_name="data"))(params, state, params)


def test_vmap_with_unbatched_counters_runs_the_sync_only_when_due():
  """The same step with the counters unbatched (in_axes=None) keeps the
  cond: local_sgd under vmap averages at step 2 like numpy."""
  tx = shardopt.local_sgd(optax.sgd(0.5), "data", sync_period=2)
  p0 = np.zeros((4, 3), np.float32)
  grads = np.arange(12, dtype=np.float32).reshape(4, 3)
  stacked = jax.vmap(tx.init, axis_name="data")({"w": jnp.asarray(p0)})
  # Per-replica fields batched, the counters and the center not.
  axes = jax.tree.map(lambda _: None, stacked)._replace(
    local_state=jax.tree.map(lambda _: 0, stacked.local_state), restart=0
  )
  state = jax.tree.map(
    lambda x, a: x if a == 0 else x[0],
    stacked,
    axes,
    is_leaf=lambda x: x is None,
  )

  @jax.jit
  @functools.partial(
    jax.vmap, in_axes=(0, axes, 0), out_axes=(0, axes), axis_name="data"
  )
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = {"w": jnp.asarray(p0)}
  for _ in range(2):
    p, state = step(p, state, {"w": jnp.asarray(grads)})
  local = p0 - 2 * 0.5 * grads
  np.testing.assert_allclose(
    np.asarray(p["w"]), np.broadcast_to(local.mean(0), (4, 3)), rtol=1e-6
  )


def test_the_docs_guide_example_runs_and_replicas_agree_after_the_sync():
  """docs/model_parallel.md's example (DiLoCo over "data", tensor parallel
  over "model", diloco's default outer step) runs as written and trains: the
  center's held-out loss falls to under a third of the start's."""
  import pathlib
  import re

  page = (
    pathlib.Path(__file__).resolve().parents[1] / "docs" / "model_parallel.md"
  )
  (code,) = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
  namespace = {}
  exec(compile(code, "docs/model_parallel.md", "exec"), namespace)
  w1 = namespace["w1"]
  assert np.all(np.isfinite(w1))
  np.testing.assert_allclose(w1, np.broadcast_to(w1[0], w1.shape), atol=1e-6)
  assert not np.allclose(w1[0], namespace["params"]["w1"])
  loss, x_val, y_val = (namespace[k] for k in ("loss", "x_val", "y_val"))
  before = float(loss(namespace["params"], x_val, y_val))
  after = float(loss(namespace["center"], x_val, y_val))
  assert after < before / 3, (before, after)


def test_quantized_wire_inside_model_parallel_replicas_matches_data_only():
  """An int8 wire (issue 22) with params sharded over "model" gives the
  data-only run's numbers, replicas bit-identical. (Its flatten-and-concat
  of the leaves makes XLA gather them over "model": not yet model-local.)"""
  make_tx = lambda: shardopt.cross_shard(_adam(), "data", comm_dtype=jnp.int8)
  reference, _, _ = train(make_tx, make_mesh({"data": 4}), ("data",))
  history, _, _ = train(make_tx, make_mesh({"data": 4, "model": 2}), ("data",))
  _check_against_reference(history, reference, ALL)
