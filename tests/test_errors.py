"""Every row of the README's "bad input -> error you get" table.

Each test checks the exception type and that the message names the transform,
the axis and the bad value (and, where there is one, the fix).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

AXIS = "batch"
N = 8
GRADS = np.ones((N, 4), np.float32)


def _under_pmap(fn, *args):
  """Traces and runs ``fn`` per replica under pmap over the 8 devices."""
  return jax.pmap(fn, axis_name=AXIS)(*args)


def _apply(tx):
  """A per-replica function that runs one update of ``tx``."""
  return lambda g: tx.update(g, tx.init(g), g)[0]


# What each group-taking entry point looks like, so every group error is
# checked through every public caller of the shared validation.
GROUP_CALLERS = {
  "shardopt.reduce": lambda groups: (
    lambda g: shardopt.reduce(g, AXIS, axis_index_groups=groups)
  ),
  "shardopt.cross_shard_mean": lambda groups: _apply(
    shardopt.cross_shard_mean(AXIS, axis_index_groups=groups)
  ),
  "shardopt.cross_shard_sum": lambda groups: _apply(
    shardopt.cross_shard_sum(AXIS, axis_index_groups=groups)
  ),
  "shardopt.cross_shard": lambda groups: _apply(
    shardopt.cross_shard(optax.sgd(1.0), AXIS, axis_index_groups=groups)
  ),
  "shardopt.scale_loss": lambda groups: (
    lambda g: shardopt.scale_loss(jnp.sum(g), AXIS, axis_index_groups=groups)
  ),
}


def _group_error(transform, groups):
  with pytest.raises(ValueError) as info:
    _under_pmap(GROUP_CALLERS[transform](groups), GRADS)
  message = str(info.value)
  assert message.startswith(
    f"{transform}: axis_index_groups for axis 'batch' of size 8"
  ), message
  return message


# 1. Unsupported reduction.


@pytest.mark.parametrize("bad", ["max", "MEAN", None])
def test_unsupported_reduction_in_cross_shard_raises_at_construction(bad):
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"Unsupported reduction: {bad!r} in shardopt.cross_shard (axis 'batch')."
      " Use one of ('mean', 'sum')"
    ),
  ):
    shardopt.cross_shard(optax.sgd(1.0), AXIS, reduction=bad)


def test_unsupported_reduction_in_reduce_and_scale_loss():
  with pytest.raises(
    ValueError,
    match=re.escape(
      "Unsupported reduction: 'max' in shardopt.reduce (axis 'batch')"
    ),
  ):
    shardopt.reduce(GRADS, AXIS, reduction="max")
  with pytest.raises(
    ValueError,
    match=re.escape(
      "Unsupported reduction: 'max' in shardopt.scale_loss (axis 'batch')"
    ),
  ):
    shardopt.scale_loss(1.0, AXIS, reduction="max")


# 2. Axis name not bound.


@pytest.mark.parametrize(
  "transform, call",
  [
    ("shardopt.reduce", lambda g: shardopt.reduce(g, AXIS)),
    ("shardopt.cross_shard_mean", _apply(shardopt.cross_shard_mean(AXIS))),
    (
      "shardopt.cross_shard",
      _apply(shardopt.cross_shard(optax.sgd(1.0), AXIS)),
    ),
    ("shardopt.scale_loss", lambda g: shardopt.scale_loss(jnp.sum(g), AXIS)),
    ("shardopt.broadcast", lambda g: shardopt.broadcast(g, AXIS)),
    (
      "shardopt.replica_divergence",
      lambda g: shardopt.replica_divergence(g, AXIS),
    ),
  ],
)
def test_unbound_axis_under_plain_jit_raises_axis_not_bound_error(
  transform, call
):
  with pytest.raises(
    shardopt.AxisNotBoundError,
    match=re.escape(f"{transform}: axis name 'batch' is not bound here."),
  ) as info:
    jax.jit(call)(GRADS[0])
  assert isinstance(info.value, NameError)
  assert "jax.pmap(..., axis_name='batch')" in str(info.value)
  assert "pass axis_name=None" in str(info.value)  # the fix under plain jit


def test_misspelled_axis_inside_pmap_names_the_misspelling():
  with pytest.raises(
    shardopt.AxisNotBoundError,
    match="shardopt.reduce: axis name 'bacth' is not bound",
  ):
    _under_pmap(lambda g: shardopt.reduce(g, "bacth"), GRADS)


# 3.-6. Bad axis_index_groups: one shared validation, every caller.


@pytest.mark.parametrize("transform", GROUP_CALLERS)
def test_groups_with_a_duplicate_index_name_both_groups_and_axis_size(
  transform,
):
  message = _group_error(transform, [[0, 1, 2, 3], [3, 4, 5, 6]])
  assert (
    "index 3 appears more than once (in group [0, 1, 2, 3] and group"
    " [3, 4, 5, 6])"
  ) in message


@pytest.mark.parametrize("transform", GROUP_CALLERS)
def test_groups_missing_an_index_list_the_missing_indices(transform):
  message = _group_error(transform, [[0, 1, 2], [3, 4, 5]])
  assert "indices [6, 7] are in no group" in message
  assert "every index of range(0, 8) exactly once" in message


@pytest.mark.parametrize("transform", GROUP_CALLERS)
def test_groups_of_unequal_sizes_are_rejected(transform):
  message = _group_error(transform, [[0, 1, 2], [3, 4, 5, 6, 7]])
  assert (
    "groups have different sizes [3, 5] (group [0, 1, 2] vs group"
    " [3, 4, 5, 6, 7])"
  ) in message


@pytest.mark.parametrize(
  "groups, fragment",
  [
    (
      [[0, 1, 2, 3], [4, 5, 6, 8]],
      "group [4, 5, 6, 8] holds index 8, outside range(0, 8)",
    ),
    (
      [[0, 1, 2, 3], [4, 5, 6, 7.0]],
      "group [4, 5, 6, 7.0] holds 7.0, which is not an integer replica index",
    ),
    (
      [0, 1, 2, 3, 4, 5, 6, 7],
      "group 0 is not a non-empty list of replica indices",
    ),
    (
      "pairs",
      "must be a non-empty list of lists of replica indices, got 'pairs'",
    ),
  ],
  ids=["out_of_range", "not_an_int", "flat_list", "string"],
)
@pytest.mark.parametrize(
  "transform", ["shardopt.reduce", "shardopt.cross_shard"]
)
def test_malformed_groups_are_rejected(transform, groups, fragment):
  assert fragment in _group_error(transform, groups)


# 7. Invariant gradient with groups under a checking shard_map.


@pytest.mark.parametrize(
  "transform, make_tx",
  [
    (
      "shardopt.cross_shard",
      lambda groups: shardopt.cross_shard(
        optax.sgd(1.0), AXIS, axis_index_groups=groups
      ),
    ),
    (
      "shardopt.cross_shard_mean",
      lambda groups: shardopt.cross_shard_mean(AXIS, axis_index_groups=groups),
    ),
  ],
)
def test_invariant_gradient_with_groups_says_to_pcast_the_params(
  mesh, transform, make_tx
):
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  tx = make_tx(groups)

  def step(params, data):
    grads = jax.grad(lambda p: jnp.sum(p["w"] * data))(params)  # invariant
    return tx.update(grads, tx.init(params), params)[0]

  fn = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  )
  params = jax.device_put(
    {"w": np.zeros(1, np.float32)}, NamedSharding(mesh, P())
  )
  data = jax.device_put(np.ones(N, np.float32), NamedSharding(mesh, P(AXIS)))
  with pytest.raises(ValueError) as info:
    fn(params, data)
  message = str(info.value)
  assert message.startswith(
    f"{transform}: the leaf at ['w'] is invariant over"
    " axis 'batch' (under shard_map"
  ), message
  assert "axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]" in message
  assert (
    "jax.lax.pcast(params, 'batch', to='varying') before jax.grad" in message
  )


# 8. Non-float leaf.


def test_non_float_leaf_raises_type_error_naming_its_path():
  grads = {"w": GRADS, "step": np.zeros(N, np.int32)}
  with pytest.raises(
    TypeError,
    match=re.escape(
      "shardopt.cross_shard_mean: leaf at ['step'] has dtype int32; only"
      " floating-point leaves can be reduced across the replicas of axis"
      " 'batch'."
    ),
  ) as info:
    _under_pmap(_apply(shardopt.cross_shard_mean(AXIS)), grads)
  assert "optax.masked(...)" in str(info.value)  # the fix


def test_non_float_leaf_in_reduce_and_a_bool_leaf():
  with pytest.raises(
    TypeError,
    match=re.escape("shardopt.reduce: leaf at [1]['flag'] has dtype bool"),
  ):
    _under_pmap(
      lambda t: shardopt.reduce(t, AXIS),
      (GRADS, {"flag": np.ones(N, np.bool_)}),
    )


# 9. A comm_dtype that is neither floating nor quantized (int8, float8 and
# int4 are quantized wires: tests/test_quantize.py).


@pytest.mark.parametrize(
  "transform, build",
  [
    (
      "shardopt.cross_shard_mean",
      lambda d: shardopt.cross_shard_mean(AXIS, comm_dtype=d),
    ),
    (
      "shardopt.cross_shard_sum",
      lambda d: shardopt.cross_shard_sum(AXIS, comm_dtype=d),
    ),
    (
      "shardopt.cross_shard",
      lambda d: shardopt.cross_shard(optax.sgd(1.0), AXIS, comm_dtype=d),
    ),
    ("shardopt.reduce", lambda d: shardopt.reduce(GRADS, AXIS, comm_dtype=d)),
  ],
)
def test_integer_comm_dtype_raises_type_error(transform, build):
  with pytest.raises(
    TypeError,
    match=re.escape(
      f"{transform}: comm_dtype=int32 (the wire dtype of reductions over axis"
      " 'batch') is neither a floating dtype nor a quantized one; use a float"
      " dtype such as jnp.bfloat16"
    ),
  ):
    build(jnp.int32)


def test_comm_dtype_that_is_not_a_dtype_raises_type_error():
  with pytest.raises(
    TypeError,
    match=re.escape(
      "shardopt.cross_shard_mean: comm_dtype='bfloat-16' (the wire dtype of"
      " reductions over axis 'batch') is not a dtype"
    ),
  ):
    shardopt.cross_shard_mean(AXIS, comm_dtype="bfloat-16")


# 10. Groups without an axis name.


@pytest.mark.parametrize(
  "transform, call",
  [
    (
      "shardopt.reduce",
      lambda g: shardopt.reduce(g, None, axis_index_groups=[[0, 1], [2, 3]]),
    ),
    (
      "shardopt.cross_shard",
      _apply(
        shardopt.cross_shard(
          optax.sgd(1.0), None, axis_index_groups=[[0, 1], [2, 3]]
        )
      ),
    ),
    (
      "shardopt.cross_shard_sum",
      _apply(
        shardopt.cross_shard_sum(None, axis_index_groups=[[0, 1], [2, 3]])
      ),
    ),
    (
      "shardopt.scale_loss",
      lambda g: shardopt.scale_loss(
        jnp.sum(g), None, axis_index_groups=[[0, 1], [2, 3]]
      ),
    ),
  ],
)
def test_groups_with_axis_name_none_are_rejected(transform, call):
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"{transform}: axis_index_groups=[[0, 1], [2, 3]] needs a named axis,"
      " but axis_name=None. Pass the pmap/mesh axis name."
    ),
  ):
    jax.jit(call)(GRADS[0])


# 11. broadcast source out of range.


@pytest.mark.parametrize("source", [8, -1, 2.0, True])
def test_broadcast_source_out_of_range(source):
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"shardopt.broadcast: source={source!r} is not a replica index of axis"
      " 'batch' (size 8); use 0 <= source < 8."
    ),
  ):
    _under_pmap(lambda g: shardopt.broadcast(g, AXIS, source=source), GRADS)


@pytest.mark.parametrize(
  "make",
  [
    lambda: jax.pmap(lambda x: shardopt.reduce(x, 3), axis_name="i"),
    lambda: jax.pmap(lambda x: shardopt.all_finite(x, 3), axis_name="i"),
    lambda: jax.pmap(
      lambda x: shardopt.cross_shard(optax.sgd(1.0), 3).update(
        x, optax.EmptyState()
      )[0],
      axis_name="i",
    ),
  ],
  ids=["reduce", "all_finite", "cross_shard"],
)
def test_an_integer_axis_name_that_is_not_bound_names_the_axis(make):
  """jax reads an integer as a positional axis ("axis 3 is out of bounds")."""
  with pytest.raises(
    shardopt.AxisNotBoundError,
    match=r"axis name 3 is not"
    r" bound here",
  ):
    make()(jnp.ones(8))


# 12. Replicated P() params given to a transform whose replicas train apart.

PERIODIC = {
  "shardopt.diloco": lambda: shardopt.diloco(
    optax.adam(1e-2), AXIS, sync_period=2
  ),
  "shardopt.local_sgd": lambda: shardopt.local_sgd(
    optax.sgd(0.1), AXIS, sync_period=2
  ),
  "shardopt.agn": lambda: shardopt.agn(optax.sgd(0.1), AXIS, sync_period=2),
  "shardopt.hierarchical_local_sgd": lambda: shardopt.hierarchical_local_sgd(
    optax.sgd(0.1), AXIS, period_group_sizes={2: 2, 4: 8}
  ),
}


def _readme_step(tx, mesh, *, check_vma=True, per_replica=False):
  """The README's cross_shard step with ``tx``: params in replicated (P()),
  the gradient of this replica's copy (pcast to varying). With
  ``per_replica`` the params are cast to varying before the update too,
  and go out per replica (the fix the error gives)."""
  loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)

  def step(w, x, y):
    local = jax.lax.pcast(w, AXIS, to="varying") if check_vma else w
    if per_replica:
      w = local
    grads = jax.grad(loss)(local, x, y)
    updates, _ = tx.update(grads, tx.init(w), w)
    return optax.apply_updates(w, updates)[None]

  return jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), P(AXIS), P(AXIS)),
    out_specs=P(AXIS),
    check_vma=check_vma,
  )


def _readme_inputs(mesh):
  def on(shape, spec):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    )

  return on((4,), P()), on((64, 4), P(AXIS)), on((64,), P(AXIS))


@pytest.mark.parametrize("transform", sorted(PERIODIC))
def test_replicated_params_of_a_periodic_transform_say_to_lay_them_out_per_replica(
  mesh, transform
):
  """Before, JAX's own out_specs check failed later, with check_vma=False
  as its hint."""
  f = _readme_step(PERIODIC[transform](), mesh)
  with pytest.raises(ValueError) as info:
    jax.eval_shape(f, *_readme_inputs(mesh))
  message = str(info.value)
  assert message.startswith(
    f"{transform}: the params at <root> are invariant over axis 'batch'"
    " inside a checking jax.shard_map (replicated, in_specs=P()"
  ), message
  assert "drift apart between syncs" in message, message
  assert "in_specs=P('batch') and out_specs=P('batch')" in message, message
  assert "jax.lax.pcast(params, 'batch', to='varying')" in message, message
  assert "shardopt.state_specs(tx, params, 'batch', mesh=mesh)" in message, (
    message
  )


@pytest.mark.parametrize("transform", sorted(PERIODIC))
def test_per_replica_params_and_unchecked_shard_map_pass_that_check(
  mesh, transform
):
  """The fix the message gives traces, and shard_map(check_vma=False),
  where every value is per replica and no type says otherwise, is not
  refused (as under pmap)."""
  for kwargs in ({"per_replica": True}, {"check_vma": False}):
    f = _readme_step(PERIODIC[transform](), mesh, **kwargs)
    out = jax.eval_shape(f, *_readme_inputs(mesh))
    assert out.shape == (N, 4), (kwargs, out.shape)
