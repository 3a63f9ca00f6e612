"""Axis facts: group validation, varying/invariant detection, tuple axes,
broadcast and replica_divergence, each against an independent reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt import _axes

N = 8
AXIS = "batch"


def _shard(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


# validate_groups: the one place every caller's groups are checked.


@pytest.mark.parametrize(
  "groups, expected",
  [
    ([[0, 1, 2, 3], [4, 5, 6, 7]], ((0, 1, 2, 3), (4, 5, 6, 7))),
    ([[0, 2, 4, 6], [1, 3, 5, 7]], ((0, 2, 4, 6), (1, 3, 5, 7))),
    ([[0, 1], [2, 3], [4, 5], [6, 7]], ((0, 1), (2, 3), (4, 5), (6, 7))),
    ([[7, 6, 5, 4, 3, 2, 1, 0]], ((7, 6, 5, 4, 3, 2, 1, 0),)),
    (((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))),
    (np.arange(8).reshape(2, 4), ((0, 1, 2, 3), (4, 5, 6, 7))),
    (
      [[np.int32(0), np.int64(1)], [2, 3], [4, 5], [6, 7]],
      ((0, 1), (2, 3), (4, 5), (6, 7)),
    ),
  ],
)
def test_validate_groups_accepts_partitions_and_returns_tuples_of_ints(
  groups, expected
):
  got = _axes.validate_groups(groups, N, "t", AXIS)
  assert got == expected
  assert all(type(i) is int for group in got for i in group)


def test_validate_groups_of_none_is_none():
  assert _axes.validate_groups(None, N, "t", AXIS) is None


@pytest.mark.parametrize(
  "groups, fragments",
  [
    (
      [[0, 1, 2, 3], [3, 4, 5, 6]],
      [
        "index 3 appears more than once",
        "[0, 1, 2, 3]",
        "[3, 4, 5, 6]",
        "of size 8",
      ],
    ),
    ([[0, 1, 2], [3, 4, 5]], ["indices [6, 7] are in no group", "of size 8"]),
    (
      [[0, 1, 2], [3, 4, 5, 6, 7]],
      ["different sizes [3, 5]", "[0, 1, 2]", "[3, 4, 5, 6, 7]"],
    ),
    (
      [[0, 1, 2, 3], [4, 5, 6, 8]],
      ["index 8", "outside range(0, 8)", "[4, 5, 6, 8]"],
    ),
    ([[0, 1, 2, 3], [4, 5, 6, -1]], ["index -1", "outside range(0, 8)"]),
    ([[0, 1.0, 2, 3], [4, 5, 6, 7]], ["holds 1.0", "not an integer"]),
    ([[True, 1, 2, 3], [4, 5, 6, 7]], ["holds True", "not an integer"]),
    ([0, 1, 2, 3, 4, 5, 6, 7], ["group 0 is not a non-empty list"]),
    ([[0, 1, 2, 3], []], ["group [] is not a non-empty list"]),
    ([], ["non-empty list of lists", "got []"]),
    ("01234567", ["non-empty list of lists", "'01234567'"]),
    (
      [[0, 1, 2, 3], [4, 5, 6, 7]][:1],
      ["indices [4, 5, 6, 7] are in no group"],
    ),
  ],
)
def test_validate_groups_rejects_bad_groups_naming_group_and_axis(
  groups, fragments
):
  with pytest.raises(ValueError) as info:
    _axes.validate_groups(groups, N, "shardopt.reduce", AXIS)
  message = str(info.value)
  assert message.startswith(
    "shardopt.reduce: axis_index_groups for axis 'batch' of size 8"
  ), message
  for fragment in fragments:
    assert fragment in message, (fragment, message)


def test_group_size_is_the_group_length_or_the_axis_size():
  assert _axes.group_size(None, N) == 8
  assert _axes.group_size(((0, 1), (2, 3), (4, 5), (6, 7)), N) == 2


# varying_axes / vma_checked: the two reads of JAX internals. If a JAX upgrade
# moves `jax.typeof(x).manual_axis_type.varying` or
# `jax.config.values["check_vma"]`, these tests fail and name the helper to fix.

_MOVED = (
  "JAX moved where it records {what}; update shardopt._axes.{helper}"
  " (the one place that reads it)."
)


def _trace_facts(mesh, check_vma):
  facts = {}

  def body(sharded, replicated):
    facts["sharded"] = _axes.varying_axes(sharded)
    facts["replicated"] = _axes.varying_axes(replicated)
    facts["grad_of_replicated"] = _axes.varying_axes(
      jax.grad(lambda w: jnp.sum(w * sharded))(replicated)
    )
    facts["checked"] = _axes.vma_checked()
    facts["split_sharded"] = _axes.split_axes(sharded, AXIS)
    facts["split_replicated"] = _axes.split_axes(replicated, AXIS)
    return sharded

  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(AXIS), P()),
      out_specs=P(AXIS),
      check_vma=check_vma,
    )
  )
  fn(
    _shard(mesh, np.ones(N, np.float32), P(AXIS)),
    _shard(mesh, np.ones(1, np.float32), P()),
  )
  return facts


def test_varying_axes_and_vma_checked_inside_a_checking_shard_map(mesh):
  facts = _trace_facts(mesh, check_vma=True)
  assert facts["sharded"] == frozenset({AXIS}), _MOVED.format(
    what="the varying axes of a value", helper="varying_axes"
  )
  assert facts["replicated"] == frozenset()
  assert facts["grad_of_replicated"] == frozenset(), (
    "the gradient of replicated params is expected to be typed invariant"
  )
  assert facts["checked"] is True, _MOVED.format(
    what="whether a trace checks varying axes", helper="vma_checked"
  )
  assert facts["split_sharded"] == ((AXIS,), ())
  assert facts["split_replicated"] == ((), (AXIS,))


def test_jax_still_records_varying_axes_where_shardopt_reads_them(mesh):
  seen = {}

  def body(x):
    seen["varying"] = jax.typeof(x).manual_axis_type.varying
    seen["check_vma"] = jax.config.values["check_vma"]
    return x

  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(
    _shard(mesh, np.ones(N, np.float32), P(AXIS))
  )
  assert set(seen["varying"]) == {AXIS}
  assert seen["check_vma"] is True


def test_every_value_is_per_replica_in_shard_map_without_check_vma(mesh):
  facts = _trace_facts(mesh, check_vma=False)
  assert facts["checked"] is False
  assert facts["sharded"] == frozenset()
  assert facts["split_sharded"] == ((AXIS,), ())
  assert facts["split_replicated"] == ((AXIS,), ())


def test_every_value_is_per_replica_under_pmap():
  facts = {}

  def body(x):
    facts["checked"] = _axes.vma_checked()
    facts["split"] = _axes.split_axes(x, AXIS)
    return x

  jax.pmap(body, axis_name=AXIS)(np.ones(N, np.float32))
  assert facts == {"checked": False, "split": ((AXIS,), ())}


def test_vma_checked_is_false_outside_any_mapping():
  seen = []
  jax.jit(lambda x: seen.append(_axes.vma_checked()) or x)(1.0)
  assert seen == [False]
  assert _axes.vma_checked() is False


def test_axis_names_and_as_axis_round_trip():
  assert _axes.axis_names("batch") == ("batch",)
  assert _axes.axis_names(("a", "b")) == ("a", "b")
  assert _axes.as_axis(("batch",)) == "batch"
  assert _axes.as_axis(("a", "b")) == ("a", "b")


# Tuple axis names on a 2 x 4 mesh.


@pytest.fixture(scope="module")
def mesh_2x4():
  return jax.make_mesh((2, 4), ("a", "b"))


@pytest.mark.parametrize(
  "groups", [None, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]]
)
@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_over_a_tuple_of_axes_matches_numpy(mesh_2x4, check_vma, groups):
  rng = np.random.default_rng(0)
  # Row k is device (a, b) with k = 4 * a + b, the index of ("a", "b").
  values = rng.standard_normal((N, 3)).astype(np.float32)

  def body(x):
    reduced = shardopt.reduce(x[0], ("a", "b"), axis_index_groups=groups)
    summed = shardopt.reduce(
      x[0], ("a", "b"), reduction="sum", axis_index_groups=groups
    )
    return reduced[None], summed[None]

  spec = P(("a", "b"))
  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh_2x4,
      in_specs=spec,
      out_specs=(spec, spec),
      check_vma=check_vma,
    )
  )
  mean, total = fn(_shard(mesh_2x4, values, spec))
  expected_sum = np.empty((N, 3))
  for group in groups or [list(range(N))]:
    expected_sum[group] = values[group].astype(np.float64).sum(0)
  group_len = len((groups or [range(N)])[0])
  np.testing.assert_allclose(total, expected_sum, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    mean, expected_sum / group_len, rtol=1e-5, atol=1e-6
  )


def test_gradient_varying_over_one_axis_and_summed_over_the_other(mesh_2x4):
  rng = np.random.default_rng(1)
  data = rng.standard_normal((N, 3)).astype(np.float32)
  seen = {}

  def body(params, x):
    # Varying over "a" only: autodiff sums the gradient over "b".
    local = jax.lax.pcast(params, "a", to="varying")
    grad = jax.grad(lambda w: jnp.sum(w * x[0]))(local)
    seen["grad"] = _axes.varying_axes(grad)
    return shardopt.reduce(grad, ("a", "b"))

  fn = jax.jit(
    jax.shard_map(
      body, mesh=mesh_2x4, in_specs=(P(), P(("a", "b"))), out_specs=P()
    )
  )
  out = fn(
    _shard(mesh_2x4, np.zeros(3, np.float32), P()),
    _shard(mesh_2x4, data, P(("a", "b"))),
  )
  assert seen["grad"] == frozenset({"a"})
  np.testing.assert_allclose(out, data.astype(np.float64).mean(0), rtol=1e-6)


# broadcast: every replica gets the source's bits.


def _bits(x):
  x = np.asarray(x)
  if x.dtype == np.bool_:
    return x
  return x.view(f"uint{x.dtype.itemsize * 8}")


def _broadcast_inputs():
  rng = np.random.default_rng(2)
  floats = rng.standard_normal((N, 6)).astype(np.float32)
  nan_with_payload = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
  floats[5] = [-0.0, nan_with_payload, np.inf, -np.inf, 1e-45, 3.0]
  return {
    "f32": floats,
    "bf16": rng.standard_normal((N, 7)).astype(jnp.bfloat16),
    "i32": rng.integers(-100, 100, (N, 2)).astype(np.int32),
    "flag": rng.integers(0, 2, (N,)).astype(np.bool_),
  }


@pytest.mark.parametrize(
  "mapping", ["pmap", "shard_map_check_vma", "shard_map_no_check_vma"]
)
def test_broadcast_copies_the_source_bits_including_negative_zero_and_nan(
  mesh, mapping
):
  tree = _broadcast_inputs()
  source = 5
  if mapping == "pmap":
    out = jax.pmap(
      lambda t: shardopt.broadcast(t, AXIS, source=source), axis_name=AXIS
    )(tree)
  else:

    def body(t):
      local = jax.tree.map(lambda x: x[0], t)
      out = shardopt.broadcast(local, AXIS, source=source)
      return jax.tree.map(lambda x: x[None], out)

    fn = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=P(AXIS),
        out_specs=P(AXIS),
        check_vma=mapping == "shard_map_check_vma",
      )
    )
    out = fn(_shard(mesh, tree, P(AXIS)))
  out = jax.device_get(out)
  expected = jax.tree.map(
    lambda x: np.broadcast_to(_bits(x[source]), x.shape), tree
  )
  chex.assert_trees_all_equal(jax.tree.map(_bits, out), expected)
  assert np.signbit(out["f32"][:, 0]).all()  # -0.0 stayed -0.0 everywhere


def test_broadcast_leaves_invariant_values_unchanged(mesh):
  values = np.arange(4, dtype=np.float32)
  fn = jax.jit(
    jax.shard_map(
      lambda x: shardopt.broadcast(x, AXIS, source=3),
      mesh=mesh,
      in_specs=P(),
      out_specs=P(),
    )
  )
  np.testing.assert_array_equal(fn(_shard(mesh, values, P())), values)


# replica_divergence: 0.0 exactly when every replica holds the same bits.


def _divergence(mesh, mapping, tree):
  if mapping == "pmap":
    return float(
      jax.pmap(lambda t: shardopt.replica_divergence(t, AXIS), axis_name=AXIS)(
        tree
      )[0]
    )

  def body(t):
    local = jax.tree.map(lambda x: x[0], t)
    return shardopt.replica_divergence(local, AXIS)[None]

  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=P(AXIS),
      out_specs=P(AXIS),
      check_vma=mapping == "shard_map_check_vma",
    )
  )
  out = np.asarray(fn(_shard(mesh, tree, P(AXIS))))
  assert (out == out[0]).all()  # the same on every replica
  return float(out[0])


@pytest.mark.parametrize(
  "mapping", ["pmap", "shard_map_check_vma", "shard_map_no_check_vma"]
)
def test_replica_divergence_matches_numpy_max_spread(mesh, mapping):
  rng = np.random.default_rng(3)
  tree = {
    "w": rng.standard_normal((N, 3, 5)).astype(np.float32),
    "b": rng.standard_normal((N, 7)).astype(jnp.bfloat16),
  }
  expected = max(
    float(np.max(x.astype(np.float64).max(0) - x.astype(np.float64).min(0)))
    for x in jax.tree.leaves(tree)
  )
  assert _divergence(mesh, mapping, tree) == pytest.approx(expected, rel=1e-6)
  assert (
    _divergence(mesh, mapping, {"x": np.arange(N, dtype=np.float32)}) == 7.0
  )


@pytest.mark.parametrize("mapping", ["pmap", "shard_map_check_vma"])
def test_replica_divergence_is_zero_iff_bit_identical(mesh, mapping):
  rng = np.random.default_rng(4)
  row = rng.standard_normal(5).astype(np.float32)
  row[2] = np.nan
  same = np.broadcast_to(row, (N, 5)).copy()
  assert _divergence(mesh, mapping, {"w": same}) == 0.0

  signed_zero = same.copy()
  signed_zero[:, 0] = 0.0
  signed_zero[6, 0] = -0.0  # equal as numbers, different bits
  got = _divergence(mesh, mapping, {"w": signed_zero})
  assert got > 0.0 and got == float(np.finfo(np.float32).tiny)

  nan_on_one = same.copy()
  nan_on_one[3, 1] = np.nan  # NaN on one replica, a number on the others
  assert _divergence(mesh, mapping, {"w": nan_on_one}) == np.inf

  other_nan = same.copy()
  other_nan[4, 2] = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
  assert _divergence(mesh, mapping, {"w": other_nan}) > 0.0


def test_replica_divergence_of_invariant_values_is_zero(mesh):
  fn = jax.jit(
    jax.shard_map(
      lambda x: shardopt.replica_divergence({"w": x}, AXIS),
      mesh=mesh,
      in_specs=P(),
      out_specs=P(),
    )
  )
  assert float(fn(_shard(mesh, np.arange(3, dtype=np.float32), P()))) == 0.0
