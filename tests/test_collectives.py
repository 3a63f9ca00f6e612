"""shardopt.reduce against a float64 numpy reference, and what it puts on the wire.

The matrix runs every mapping (pmap, shard_map with check_vma on and off), every
group layout, both reductions and every wire dtype on one nested pytree that
holds float32, bfloat16 and float16 leaves of mixed shapes, so one compiled
function covers all leaf dtypes. The reference is numpy arithmetic in float64
on the per-replica inputs; the tolerance is the floating-point summation bound
for the narrowest dtype involved (leaf or wire).
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

N = 8
AXIS = "batch"
MAPPINGS = ("pmap", "shard_map_check_vma", "shard_map_no_check_vma")
GROUPS = {
  "no_groups": None,
  "contiguous": [[0, 1, 2, 3], [4, 5, 6, 7]],
  "strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
  "pairs": [[0, 1], [2, 3], [4, 5], [6, 7]],
}
COMM_DTYPES = {
  "no_comm_dtype": None,
  "comm_bfloat16": jnp.bfloat16,
  "comm_float16": jnp.float16,
}
REDUCTIONS = ("mean", "sum")


def _mesh():
  return jax.make_mesh((N,), (AXIS,))


def _per_replica_tree(seed=0, scale=1.0):
  """Stacked per-replica inputs (leading axis = replica): every dtype x shape."""
  rng = np.random.default_rng(seed)

  def leaf(shape, dtype):
    values = rng.standard_normal((N,) + shape) * scale
    return values.astype(np.float32).astype(dtype)

  return {
    "dense": {
      "kernel": leaf((3, 5), jnp.float32),
      "bias": leaf((7,), jnp.bfloat16),
    },
    "scale": leaf((), jnp.float16),
    "layers": [
      leaf((3, 5), jnp.bfloat16),
      leaf((7,), jnp.float16),
      leaf((), jnp.float32),
    ],
    "extra": (
      leaf((3, 5), jnp.float16),
      leaf((7,), jnp.float32),
      leaf((), jnp.bfloat16),
    ),
  }


def _groups_or_all(groups):
  return groups if groups is not None else [list(range(N))]


def _numpy_reduce(stacked, groups, reduction):
  """float64 reference: each replica gets its group's mean or sum."""
  values = np.asarray(stacked).astype(np.float64)
  out = np.empty_like(values)
  for group in _groups_or_all(groups):
    total = values[group].sum(axis=0)
    out[group] = total / len(group) if reduction == "mean" else total
  return out


def _summation_tolerance(stacked, groups, reduction, wire_dtype):
  """Bound on |float result - exact| for a sum rounded in the narrowest dtype.

  Summing m terms in precision eps errs by at most (m - 1) * eps * sum|x_i|;
  casting to the wire dtype and back, dividing, and the final rounding add a
  few more eps * sum|x_i|.
  """
  values = np.asarray(stacked).astype(np.float64)
  eps = max(
    float(jnp.finfo(stacked.dtype).eps), float(jnp.finfo(wire_dtype).eps)
  )
  out = np.empty_like(values)
  for group in _groups_or_all(groups):
    magnitude = np.abs(values[group]).sum(axis=0)
    bound = (len(group) + 3) * eps * magnitude
    out[group] = bound / len(group) if reduction == "mean" else bound
  return out + 1e-6


def _assert_matches_reference(actual, stacked, groups, reduction, comm_dtype):
  leaves_actual, _ = jax.tree_util.tree_flatten_with_path(actual)
  leaves_input = jax.tree.leaves(stacked)
  assert len(leaves_actual) == len(leaves_input)
  for (path, got), given in zip(leaves_actual, leaves_input):
    where = jax.tree_util.keystr(path)
    assert got.dtype == given.dtype, (
      f"{where}: dtype {got.dtype} != {given.dtype}"
    )
    assert got.shape == given.shape, (
      f"{where}: shape {got.shape} != {given.shape}"
    )
    wire = comm_dtype if comm_dtype is not None else given.dtype
    expected = _numpy_reduce(given, groups, reduction)
    tolerance = _summation_tolerance(given, groups, reduction, wire)
    error = np.abs(np.asarray(got).astype(np.float64) - expected)
    assert np.all(error <= tolerance), (
      f"{where} ({given.dtype}, wire {np.dtype(wire)}): max error"
      f" {error.max():.3g} exceeds tolerance; got {np.asarray(got)!r},"
      f" expected {expected!r}"
    )


def _shard(tree, spec=P(AXIS)):
  return jax.device_put(tree, NamedSharding(_mesh(), spec))


@functools.cache
def _reducer(mapping, groups_name, reduction, comm_name):
  """A compiled reduce for one (mapping, groups, reduction, comm_dtype)."""
  kwargs = dict(
    reduction=reduction,
    axis_index_groups=GROUPS[groups_name],
    comm_dtype=COMM_DTYPES[comm_name],
  )
  return _mapped(mapping, lambda tree: shardopt.reduce(tree, AXIS, **kwargs))


@functools.cache
def _all_reductions(mapping, groups_name):
  """Every (reduction, comm_dtype) in one compiled function: one compile per
  (mapping, groups) keeps the matrix cheap."""

  def reduce_every_way(tree):
    return {
      (reduction, comm_name): shardopt.reduce(
        tree,
        AXIS,
        reduction=reduction,
        axis_index_groups=GROUPS[groups_name],
        comm_dtype=comm_dtype,
      )
      for reduction in REDUCTIONS
      for comm_name, comm_dtype in COMM_DTYPES.items()
    }

  fn = _mapped(mapping, reduce_every_way)
  return _run(mapping, fn, _per_replica_tree(seed=1))


def _mapped(mapping, per_replica_fn):
  """per_replica_fn under pmap or shard_map over the 8 replicas."""
  if mapping == "pmap":
    return jax.pmap(per_replica_fn, axis_name=AXIS)

  def body(tree):
    local = jax.tree.map(lambda x: x[0], tree)
    return jax.tree.map(lambda x: x[None], per_replica_fn(local))

  return jax.jit(
    jax.shard_map(
      body,
      mesh=_mesh(),
      in_specs=P(AXIS),
      out_specs=P(AXIS),
      check_vma=mapping == "shard_map_check_vma",
    )
  )


def _run(mapping, fn, stacked):
  if mapping == "pmap":
    return jax.device_get(fn(stacked))
  return jax.device_get(fn(_shard(stacked)))


@pytest.mark.parametrize("comm_name", COMM_DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("groups_name", GROUPS)
@pytest.mark.parametrize("mapping", MAPPINGS)
def test_reduce_of_per_replica_values_matches_numpy(
  mapping, groups_name, reduction, comm_name
):
  out = _all_reductions(mapping, groups_name)[reduction, comm_name]
  _assert_matches_reference(
    out,
    _per_replica_tree(seed=1),
    GROUPS[groups_name],
    reduction,
    COMM_DTYPES[comm_name],
  )


# Invariant leaves: under a checking shard_map, the gradient of replicated (P())
# params is typed invariant and autodiff has already summed it over the axis.


def _loss(params, data):
  """sum_i <params_i, data_i>: its gradient on one replica is that replica's data."""
  terms = [
    jnp.sum(p * x).astype(jnp.float32)
    for p, x in zip(jax.tree.leaves(params), jax.tree.leaves(data))
  ]
  return sum(terms)


@functools.cache
def _invariant_gradient_reducer(groups_name, reduction, comm_name):

  def body(params, data):
    local = jax.tree.map(lambda x: x[0], data)
    grads = jax.grad(_loss)(params, local)
    return shardopt.reduce(
      grads,
      AXIS,
      reduction=reduction,
      axis_index_groups=GROUPS[groups_name],
      comm_dtype=COMM_DTYPES[comm_name],
    )

  return jax.jit(
    jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P(AXIS)), out_specs=P())
  )


def _zero_params(stacked):
  return jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), stacked)


@pytest.mark.parametrize("comm_name", COMM_DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reduce_of_invariant_gradient_divides_instead_of_all_reducing(
  reduction, comm_name
):
  stacked = _per_replica_tree(seed=2)
  fn = _invariant_gradient_reducer("no_groups", reduction, comm_name)
  out = jax.device_get(fn(_shard(_zero_params(stacked), P()), _shard(stacked)))
  # out_specs=P(): one copy; compare it with replica 0's row of the reference.
  per_replica = jax.tree.map(lambda x: np.broadcast_to(x, (N,) + x.shape), out)
  # Autodiff's own psum runs in the leaf dtype, so the wire dtype is the leaf's.
  _assert_matches_reference(per_replica, stacked, None, reduction, None)


@pytest.mark.parametrize("groups_name", ["contiguous", "strided", "pairs"])
def test_reduce_of_invariant_gradient_with_groups_raises(groups_name):
  stacked = _per_replica_tree(seed=2)
  fn = _invariant_gradient_reducer(groups_name, "mean", "no_comm_dtype")
  with pytest.raises(ValueError, match=r"jax\.lax\.pcast\(params, 'batch'"):
    fn(_shard(_zero_params(stacked), P()), _shard(stacked))


def test_varying_and_invariant_leaves_in_one_tree_both_reduce_to_the_mean():
  rng = np.random.default_rng(3)
  data = rng.standard_normal((N, 4)).astype(np.float32)
  per_replica = rng.standard_normal((N, 5)).astype(np.float32)

  def body(params, data, per_replica):
    grad = jax.grad(lambda p: jnp.sum(p * data[0]))(params)
    reduced = shardopt.reduce(
      {"invariant": grad, "varying": per_replica[0]}, AXIS
    )
    return reduced["invariant"], reduced["varying"][None]

  fn = jax.jit(
    jax.shard_map(
      body,
      mesh=_mesh(),
      in_specs=(P(), P(AXIS), P(AXIS)),
      out_specs=(P(), P(AXIS)),
    )
  )
  invariant, varying = fn(
    _shard(np.zeros(4, np.float32), P()), _shard(data), _shard(per_replica)
  )
  np.testing.assert_allclose(
    invariant, data.astype(np.float64).mean(0), rtol=1e-6
  )
  np.testing.assert_allclose(
    varying,
    np.broadcast_to(per_replica.astype(np.float64).mean(0), (N, 5)),
    rtol=1e-6,
  )


# Bit-identity: every member of a group ends with the same bits.


def _bits(x):
  x = np.asarray(x)
  return x.view(f"uint{x.dtype.itemsize * 8}")


def _awkward_tree(seed):
  """Values spanning many magnitudes, so a different summation order shows."""
  rng = np.random.default_rng(seed)

  def leaf(shape, dtype):
    mantissa = rng.standard_normal((N,) + shape)
    exponent = rng.uniform(-3, 3, (N,) + shape)
    return (mantissa * 10.0**exponent).astype(np.float32).astype(dtype)

  return {
    "w": leaf((3, 5), jnp.float32),
    "b": leaf((7,), jnp.bfloat16),
    "s": leaf((), jnp.float16),
  }


@pytest.mark.parametrize("groups_name", ["contiguous", "strided", "pairs"])
@pytest.mark.parametrize("mapping", MAPPINGS)
def test_group_members_bit_identical_after_grouped_reduce(mapping, groups_name):
  stacked = _awkward_tree(seed=4)
  for reduction in REDUCTIONS:
    out = _run(
      mapping,
      _reducer(mapping, groups_name, reduction, "no_comm_dtype"),
      stacked,
    )
    for group in GROUPS[groups_name]:
      first = jax.tree.map(lambda x, g0=group[0]: _bits(x[g0]), out)
      for member in group[1:]:
        chex.assert_trees_all_equal(
          jax.tree.map(lambda x, m=member: _bits(x[m]), out), first
        )
    _assert_matches_reference(
      out, stacked, GROUPS[groups_name], reduction, None
    )


# float16 on the wire: divide before the collective so the sum cannot overflow.


def test_float16_mean_does_not_overflow_when_the_sum_would():
  # 8 * 16384 = 131072 > float16 max 65504; every partial sum of 16384 / 8
  # is exact in float16, so the mean is exact.
  values = np.full((N, 3), 16384.0, np.float16)
  fn = _reducer("pmap", "no_groups", "mean", "no_comm_dtype")
  out = np.asarray(fn(values))
  assert out.dtype == np.float16
  np.testing.assert_array_equal(out, np.full((N, 3), 16384.0, np.float16))


def test_float16_wire_sum_of_float32_leaves_does_not_overflow():
  values = np.full((N, 3), 16384.0, np.float32)
  fn = _reducer("pmap", "no_groups", "sum", "comm_float16")
  out = np.asarray(fn(values))
  assert out.dtype == np.float32
  np.testing.assert_array_equal(out, np.full((N, 3), 131072.0, np.float32))


# None, MaskedNode and axis_name=None.


def test_none_and_masked_node_leaves_pass_through():
  grads = {
    "w": np.arange(N * 2, dtype=np.float32).reshape(N, 2),
    "b": None,
    "frozen": optax.MaskedNode(),
  }
  out = jax.pmap(lambda t: shardopt.reduce(t, AXIS), axis_name=AXIS)(grads)
  assert out["b"] is None
  assert isinstance(out["frozen"], optax.MaskedNode)
  np.testing.assert_allclose(
    out["w"], np.broadcast_to(grads["w"].astype(np.float64).mean(0), (N, 2))
  )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_axis_name_none_is_the_identity_under_plain_jit(reduction):
  tree = _per_replica_tree(seed=5)
  out = jax.jit(lambda t: shardopt.reduce(t, None, reduction=reduction))(tree)
  chex.assert_trees_all_equal(
    jax.tree.map(_bits, out), jax.tree.map(_bits, tree)
  )


# What goes on the wire: StableHLO as lowered (before XLA's CPU passes widen
# bf16 collectives) and HLO as compiled.

_F32_TREE = {
  "kernel": np.ones((N, 3, 5), np.float32),
  "bias": np.ones((N, 7), np.float32),
  "scale": np.ones((N,), np.float32),
}
_LEAVES = len(_F32_TREE)


def _operand_types(stablehlo, op):
  """Operand tensor types of every `stablehlo.<op>` in the lowered text."""
  # "stablehlo.op"(%x) <{attributes}> ({ reduction region }) : (type) -> type;
  # all_gather has no region.
  pattern = (
    r'"stablehlo\.' + op + r'"\(%[^)]*\) <\{.*?\}>'
    r"(?: \(\{.*?\}\))? : \((tensor<[^>]*>)\)"
  )
  return re.findall(pattern, stablehlo, flags=re.S)


def _count_hlo_ops(hlo, op):
  return len(re.findall(rf"\s{op}(?:-start)?\(", hlo))


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_bfloat16_comm_dtype_puts_bfloat16_all_reduce_in_the_lowered_module(
  mapping,
):
  fn = _reducer(mapping, "no_groups", "mean", "comm_bfloat16")
  args = _F32_TREE if mapping == "pmap" else _shard(_F32_TREE)
  types = _operand_types(fn.lower(args).as_text(), "all_reduce")
  assert len(types) == _LEAVES, types
  assert all(t.endswith("bf16>") for t in types), types


def test_grouped_bfloat16_reduce_under_checking_shard_map_sends_bfloat16():
  fn = _reducer("shard_map_check_vma", "strided", "mean", "comm_bfloat16")
  text = fn.lower(_shard(_F32_TREE)).as_text()
  scattered = _operand_types(text, "reduce_scatter")
  gathered = _operand_types(text, "all_gather")
  assert len(scattered) == len(gathered) == _LEAVES, (scattered, gathered)
  assert all(t.endswith("bf16>") for t in scattered + gathered)


def test_without_comm_dtype_the_wire_dtype_is_the_leaf_dtype():
  fn = _reducer("shard_map_check_vma", "no_groups", "mean", "no_comm_dtype")
  types = _operand_types(fn.lower(_shard(_F32_TREE)).as_text(), "all_reduce")
  assert len(types) == _LEAVES and all(t.endswith("f32>") for t in types), types


@pytest.mark.parametrize("groups_name", ["contiguous", "strided", "pairs"])
def test_grouped_reduce_under_checking_shard_map_is_reduce_scatter_plus_all_gather(
  groups_name,
):
  fn = _reducer("shard_map_check_vma", groups_name, "mean", "no_comm_dtype")
  lowered = fn.lower(_shard(_F32_TREE))
  assert not _operand_types(lowered.as_text(), "all_reduce")
  hlo = lowered.compile().as_text()
  assert _count_hlo_ops(hlo, "all-reduce") == 0, hlo
  # One reduce-scatter and one all-gather per leaf, each over the groups.
  assert _count_hlo_ops(hlo, "reduce-scatter") == _LEAVES, hlo
  assert _count_hlo_ops(hlo, "all-gather") == _LEAVES, hlo
  groups_attr = (
    "{"
    + ",".join("{" + ",".join(map(str, g)) + "}" for g in GROUPS[groups_name])
    + "}"
  )
  assert f"replica_groups={groups_attr}" in hlo


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_ungrouped_reduce_is_one_all_reduce_per_leaf(mapping):
  fn = _reducer(mapping, "no_groups", "mean", "no_comm_dtype")
  lowered = fn.lower(_F32_TREE if mapping == "pmap" else _shard(_F32_TREE))
  text = lowered.as_text()
  assert len(_operand_types(text, "all_reduce")) == _LEAVES
  assert not _operand_types(text, "reduce_scatter")
  assert not _operand_types(text, "all_gather")
  hlo = lowered.compile().as_text()
  # XLA's all-reduce combiner may merge the per-leaf all-reduces into one
  # tuple all-reduce (it does on CPU); it never adds any.
  assert 1 <= _count_hlo_ops(hlo, "all-reduce") <= _LEAVES, hlo
  assert _count_hlo_ops(hlo, "reduce-scatter") == 0
  assert _count_hlo_ops(hlo, "all-gather") == 0


def test_mean_of_invariant_gradient_adds_no_collective_after_autodiffs_psum():
  stacked = {k: v for k, v in _F32_TREE.items()}
  with_reduce = _invariant_gradient_reducer(
    "no_groups", "mean", "no_comm_dtype"
  )

  def body(params, data):
    return jax.grad(_loss)(params, jax.tree.map(lambda x: x[0], data))

  grad_only = jax.jit(
    jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P(AXIS)), out_specs=P())
  )
  args = (_shard(_zero_params(stacked), P()), _shard(stacked))
  expected = len(_operand_types(grad_only.lower(*args).as_text(), "all_reduce"))
  assert expected >= 1  # autodiff's psum of the replicated params' gradient
  got = len(_operand_types(with_reduce.lower(*args).as_text(), "all_reduce"))
  assert got == expected
