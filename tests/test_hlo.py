"""shardopt.measure.hlo, the one reader of what crosses the wire.

Small jitted ``shard_map`` (and ``pmap``) programs with known collectives:
the reader's kind, dtype, element count, group size and bytes equal numbers
computed by hand from the program (a ring all-reduce of B bytes in groups of
g sends 2 (g - 1) / g * B per member; an all-gather, a reduce-scatter or an
all-to-all (g - 1) / g * B; a collective-permute B). The weighting of the
conditional branches by the steps that run them equals a count by numpy over
the steps, written from each schedule's documented rule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo
from shardopt.periodic import schedules

AXIS = "batch"
N = 8
F32 = 4  # bytes


def _compiled_text(mesh, fn, *args, in_specs, out_specs):
  placed = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip(args, in_specs, strict=True)
  ]
  step = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )
  return step.lower(*placed).compile().as_text()


def _only(ops):
  assert len(ops) == 1, ops
  return ops[0]


def _ring(group, buffer_bytes):
  return 2 * (group - 1) / group * buffer_bytes


# --- One collective: kind, dtype, elements, group size, bytes. --------------


def test_psum_of_1000_float32_over_8_devices(mesh):
  text = _compiled_text(
    mesh,
    lambda v: jax.lax.psum(v, AXIS),
    jnp.ones(N * 1000),
    in_specs=(P(AXIS),),
    out_specs=P(),
  )
  op = _only(hlo.compiled_collectives(text))
  assert (op.kind, op.dtypes, op.elements, op.group_size) == (
    "all-reduce",
    ("f32",),
    1000,
    N,
  )
  assert (op.context, op.branch) == ("top", "")
  assert op.buffer_bytes == 1000 * F32
  assert hlo.sent_bytes(op) == _ring(8, 4000) == 7000
  assert hlo.allreduce_equivalent_bytes(op) == 4000


def test_psum_over_groups_of_4_counts_its_own_ring():
  mesh = jax.make_mesh((2, 4), ("outer", "inner"))
  text = _compiled_text(
    mesh,
    lambda v: jax.lax.psum(v, "inner"),
    jnp.ones(N * 1000),
    in_specs=(P(("outer", "inner")),),
    out_specs=P("outer"),
  )
  op = _only(hlo.compiled_collectives(text, num_devices=N))
  assert (op.kind, op.dtypes, op.elements, op.group_size) == (
    "all-reduce",
    ("f32",),
    1000,
    4,
  )
  # 2 (4 - 1) / 4 of 4000 bytes, not the 2 (8 - 1) / 8 of a ring over all 8.
  assert hlo.sent_bytes(op, num_devices=N) == _ring(4, 4000) == 6000


def test_pmap_psum_with_axis_index_groups_of_4():
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  f = jax.pmap(
    lambda v: jax.lax.psum(v, "i", axis_index_groups=groups), axis_name="i"
  )
  text = f.lower(jnp.ones((N, 1000))).compile().as_text()
  op = _only(hlo.compiled_collectives(text, num_devices=N))
  assert (op.kind, op.elements, op.group_size, op.buffer_bytes) == (
    "all-reduce",
    1000,
    4,
    4000,
  )
  assert hlo.sent_bytes(op, num_devices=N) == 6000


def test_all_gather_counts_the_gathered_array(mesh):
  text = _compiled_text(
    mesh,
    lambda v: jax.lax.all_gather(v, AXIS, tiled=True),
    jnp.ones(N * 1000),
    in_specs=(P(AXIS),),
    out_specs=P(AXIS),
  )
  op = _only(hlo.compiled_collectives(text))
  assert (op.kind, op.dtypes, op.elements, op.group_size) == (
    "all-gather",
    ("f32",),
    N * 1000,
    N,
  )
  assert op.buffer_bytes == N * 1000 * F32
  # Each member sends its 1000 elements to the 7 others: (8 - 1) / 8 of it.
  assert hlo.sent_bytes(op) == 7 * 1000 * F32
  assert hlo.allreduce_equivalent_bytes(op) == N * 1000 * F32 / 2


def test_reduce_scatter_counts_its_operand(mesh):
  text = _compiled_text(
    mesh,
    lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True),
    jnp.ones(N * N * 1000),
    in_specs=(P(AXIS),),
    out_specs=P(AXIS),
  )
  op = _only(hlo.compiled_collectives(text))
  assert (op.kind, op.elements, op.group_size) == ("reduce-scatter", 8000, N)
  assert (op.result_bytes, op.buffer_bytes) == (1000 * F32, 8000 * F32)
  assert hlo.sent_bytes(op) == 7 / 8 * 8000 * F32


def test_all_to_all_and_collective_permute(mesh):
  def exchange(v):
    swapped = jax.lax.all_to_all(v.reshape(N, 125), AXIS, 0, 0, tiled=True)
    ring = [(i, (i + 1) % N) for i in range(N)]
    return jax.lax.ppermute(swapped.reshape(-1), AXIS, ring)

  text = _compiled_text(
    mesh, exchange, jnp.ones(N * 1000), in_specs=(P(AXIS),), out_specs=P(AXIS)
  )
  ops = {op.kind: op for op in hlo.compiled_collectives(text)}
  assert set(ops) == {"all-to-all", "collective-permute"}
  a2a, permute = ops["all-to-all"], ops["collective-permute"]
  assert (a2a.elements, a2a.group_size, a2a.buffer_bytes) == (1000, N, 4000)
  assert hlo.sent_bytes(a2a) == 7 / 8 * 4000  # keeps 1/8 of it
  assert (permute.elements, permute.buffer_bytes) == (1000, 4000)
  assert hlo.sent_bytes(permute) == 4000  # the whole buffer to a neighbour


def test_a_psum_in_one_branch_of_a_cond(mesh):
  def step(t, v):
    return jax.lax.cond(
      t % 4 == 0, lambda: v + jax.lax.psum(v[:250], AXIS).sum(), lambda: v
    )

  text = _compiled_text(
    mesh,
    step,
    jnp.int32(4),
    jnp.ones(N * 1000),
    in_specs=(P(), P(AXIS)),
    out_specs=P(AXIS),
  )
  op = _only(hlo.compiled_collectives(text))
  assert (op.kind, op.elements, op.group_size) == ("all-reduce", 250, N)
  assert op.context == "conditional"
  # lax.cond(pred, true, false) compiles to branches [false, true].
  assert op.branch.endswith("#1"), op.branch
  [[false_branch, true_branch]] = hlo.branch_collectives(text)
  assert false_branch == []
  assert [(o.kind, o.elements) for o in true_branch] == [("all-reduce", 250)]
  split = hlo.by_branch(hlo.compiled_collectives(text), hlo.sent_bytes)
  assert split["top"] == 0
  assert split["branches"] == {
    op.branch: {
      "bytes": _ring(8, 250 * F32),
      "group_sizes": [N],
      "count": {"all-reduce": 1},
    }
  }


# --- Bytes per step: each branch weighted by the steps that run it. ---------

PAIRS = [[0, 1], [2, 3], [4, 5], [6, 7]]


def _pmap_text(fn):
  f = jax.pmap(fn, axis_name="i")
  return f.lower(jnp.arange(N), jnp.ones((N, 256))).compile().as_text()


def _numpy_run(step_bytes, steps):
  """Bytes of steps 1..steps, one number per step, summed."""
  return float(sum(step_bytes(t) for t in range(1, steps + 1)))


def test_hierarchy_weights_each_level_by_the_steps_it_wins():
  def levels(t, x):  # 256 float32 = 1024 bytes per all-reduce, every step
    level = jnp.where(t % 16 == 0, 2, jnp.where(t % 4 == 0, 1, 0))
    branches = [
      lambda v: v,
      lambda v: jax.lax.psum(v, "i", axis_index_groups=PAIRS),
      lambda v: jax.lax.psum(v, "i"),
    ]
    return jax.lax.switch(level, branches, jax.lax.psum(x, "i"))

  ops = hlo.compiled_collectives(_pmap_text(levels), num_devices=N)
  schedule = hlo.Schedule(schedules.hierarchy({4: 2, 16: 8}))

  def step_bytes(t):  # the largest period dividing t wins
    extra = 0.0
    if t % 4 == 0:
      extra = _ring(2, 1024)
    if t % 16 == 0:
      extra = _ring(8, 1024)
    return _ring(8, 1024) + extra

  measured = hlo.per_step(ops, schedule, measure=hlo.sent_bytes)
  assert measured["warning"] == ""
  cycle = np.array([step_bytes(t) for t in range(1, 17)])
  assert measured["cycle"] == cycle.tolist()
  assert measured["mean_bytes"] == pytest.approx(cycle.mean())
  assert measured["peak_bytes"] == cycle.max()
  for steps in (1, 4, 15, 16, 17, 100):
    assert hlo.run_bytes(measured, schedule, steps) == pytest.approx(
      _numpy_run(step_bytes, steps)
    )


@pytest.mark.parametrize("lag", [0, 1])
def test_streaming_fragments_each_once_per_period_at_their_offset(lag):
  def fragments(t, x):  # fragment f: 64 float32 = 256 bytes
    for f in range(4):
      part = slice(64 * f, 64 * (f + 1))
      x = jax.lax.cond(
        t % 64 == 16 * f,
        lambda v, part=part: v.at[part].set(jax.lax.psum(v[part], "i")),
        lambda v: v,
        x,
      )
    return x

  ops = hlo.compiled_collectives(_pmap_text(fragments), num_devices=N)
  schedule = hlo.Schedule(schedules.streaming(64, 4, lag=lag))

  def step_bytes(t):
    # fragment f after step s iff s % 64 == 16 f, run `lag` steps later
    s = t - lag
    return sum(256.0 for f in range(4) if s >= 1 and s % 64 == 16 * f)

  measured = hlo.per_step(ops, schedule)
  assert measured["warning"] == ""
  # The steady state: a cycle later, every lagged sync has started.
  cycle = np.array([step_bytes(t + 64) for t in range(1, 65)])
  assert measured["cycle"] == cycle.tolist()
  assert np.flatnonzero(cycle).tolist() == sorted(
    (16 * f + lag - 1) % 64 for f in range(4)
  )
  assert (measured["mean_bytes"], measured["peak_bytes"]) == (1024 / 64, 256)
  for steps in (1, 16, 17, 63, 64, 65, 200):
    assert hlo.run_bytes(measured, schedule, steps) == _numpy_run(
      step_bytes, steps
    )


def test_a_warm_up_then_a_sync_every_4_steps():
  warmup = 3

  def step(t, x):  # the warm-up's all-reduce, then the sync's
    x = jax.lax.cond(
      t <= warmup, lambda v: jax.lax.psum(v, "i"), lambda v: v, x
    )
    return jax.lax.cond(
      (t > warmup) & ((t - warmup) % 4 == 0),
      lambda v: v.at[:128].set(jax.lax.psum(v[:128], "i")),
      lambda v: v,
      x,
    )

  ops = hlo.compiled_collectives(_pmap_text(step), num_devices=N)
  schedule = hlo.Schedule(schedules.every(4), warmup_steps=warmup)

  def step_bytes(t):
    if t <= warmup:
      return 1024.0
    return 512.0 if (t - warmup) % 4 == 0 else 0.0

  measured = hlo.per_step(ops, schedule)
  assert measured["warning"] == ""
  assert measured["warmup_bytes"] == 1024
  assert measured["cycle"] == [step_bytes(t) for t in range(4, 8)]
  for steps in range(1, 21):
    assert hlo.run_bytes(measured, schedule, steps) == _numpy_run(
      step_bytes, steps
    )


@pytest.mark.parametrize("taken, expected", [("max", 1024), ("min", 256)])
def test_without_syncs_every_step_takes_one_branch(taken, expected):
  def step(t, x):
    return jax.lax.cond(
      t > 0,
      lambda v: jax.lax.psum(v, "i"),  # 1024 bytes
      lambda v: v.at[:64].set(jax.lax.psum(v[:64], "i")),  # 256 bytes
      x,
    )

  ops = hlo.compiled_collectives(_pmap_text(step), num_devices=N)
  measured = hlo.per_step(ops, hlo.Schedule(taken=taken))
  assert measured["cycle"] == [expected]
  assert hlo.run_bytes(measured, hlo.Schedule(taken=taken), 10) == (
    10 * expected
  )


def test_fired_is_the_engine_schedule_counted_by_numpy():
  t = np.arange(1, 65)
  hierarchy = hlo.Schedule(schedules.hierarchy({2: 2, 8: 4, 16: 8}))
  expected = np.select([t % 16 == 0, t % 8 == 0, t % 2 == 0], [3, 2, 1], 0)
  assert hlo.fired(hierarchy, t).tolist() == expected.tolist()
  streaming = hlo.Schedule(schedules.streaming(16, 4, lag=1), warmup_steps=5)
  s = t - 5 - 1
  expected = np.select(
    [(s >= 1) & (s % 16 == 4 * f) for f in range(4)], [1, 2, 3, 4], 0
  )
  assert hlo.fired(streaming, t).tolist() == expected.tolist()
  assert hlo.fired(hlo.Schedule(), t).tolist() == [0] * 64


# --- The engine's own steps match their schedules. ---------------------------


def _engine_ops(tx):
  params = {"a": jnp.ones(64), "b": jnp.ones(32)}
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), params)
  state = jax.pmap(tx.init, axis_name=AXIS)(stacked)

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return jax.tree.map(jnp.add, p, updates), s

  text = (
    jax.pmap(step, axis_name=AXIS)
    .lower(stacked, state, stacked)
    .compile()
    .as_text()
  )
  return hlo.compiled_collectives(text, num_devices=N)


def test_streaming_diloco_runs_one_branch_per_fragment_at_its_offset():
  tx = shardopt.diloco(optax.sgd(0.1), AXIS, sync_period=8, num_fragments=2)
  schedule = hlo.Schedule(schedules.streaming(8, 2))
  measured = hlo.per_step(_engine_ops(tx), schedule)
  assert measured["warning"] == ""
  assert len(measured["sync_bytes"]) == 2
  # fragment f after step t iff t % 8 == 4 f: steps 8 and 4 of a cycle
  t = np.arange(1, 9)
  syncing = (t % 8 == 0) | (t % 8 == 4)
  assert (np.array(measured["cycle"]) > 0).tolist() == syncing.tolist()


def test_hierarchical_local_sgd_branches_run_in_their_group_sizes():
  tx = shardopt.hierarchical_local_sgd(
    optax.sgd(0.1), AXIS, period_group_sizes={2: 2, 8: 8}
  )
  schedule = hlo.Schedule(schedules.hierarchy({2: 2, 8: 8}))
  measured = hlo.per_step(_engine_ops(tx), schedule, measure=hlo.sent_bytes)
  assert measured["warning"] == ""
  pairs, everyone = measured["sync_bytes"]
  # The same params either way: a ring of 2 sends 1/2, a ring of 8 sends 7/4.
  assert everyone / pairs == pytest.approx(_ring(8, 1) / _ring(2, 1))
