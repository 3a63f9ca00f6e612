"""Hostile input, property-based (hypothesis).

* Random pytrees (scalar, empty and small leaves; float32, bfloat16, float16),
  random valid ``axis_index_groups`` (a random permutation of the 8 replicas
  split into equal groups) and both reductions, under ``pmap`` and under
  ``shard_map`` with and without ``check_vma``: ``shardopt.reduce`` equals a
  numpy reference, and every member of a group holds the same bits.
* Random invalid group assignments, wrong axis names, non-float leaves,
  grads whose tree structure does not match the state's, and communication
  periods <= 0: each raises a clear error (type and message checked), and
  nothing is left half-updated: the error is raised while tracing (``lower``
  raises it, so no collective ran), and the caller's params, state and
  gradients, passed as *donated* buffers, are neither consumed nor changed.

Run with ``pytest -s`` to see how many inputs each property tried. How many
they draw depends on the hypothesis profile (``tests/_hypothesis_profiles.py``):
the sizes below under ``ci`` (the default), at least 500 under ``thorough``
(``make fuzz``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _properties import AXIS
from _properties import INVALID_GROUP_KINDS
from _properties import WRONG_NAMES
from _properties import R
from _properties import assert_fails_cleanly
from _properties import build_tree
from _properties import float_params
from _properties import init_on_mesh
from _properties import invalid_groups
from _properties import per_replica_values
from _properties import put_rows
from _properties import pytrees
from _properties import report
from _properties import settings
from _properties import stateless
from _properties import valid_groups
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardopt

NON_FLOATS = [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]


# --- Valid input: equal to numpy. ---------------------------------------------


def _reducer(mapping, mesh, reduction, groups):
  fn = lambda t: shardopt.reduce(
    t, AXIS, reduction=reduction, axis_index_groups=groups
  )
  if mapping == "pmap":
    return jax.pmap(fn, axis_name=AXIS)

  def body(t):
    return jax.tree.map(lambda x: x[None], fn(jax.tree.map(lambda x: x[0], t)))

  mapped = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=P(AXIS),
      out_specs=P(AXIS),
      check_vma=mapping == "shard_map",
    )
  )
  return lambda t: mapped(put_rows(mesh, t))


def _tolerance(dtype, members, magnitude):
  """Rounding bound for summing ``members`` values of this dtype."""
  finfo = jnp.finfo(dtype)
  return members * (
    float(finfo.eps) * magnitude + float(finfo.smallest_subnormal)
  )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mapping", ["pmap", "shard_map", "shard_map_no_vma"])
def test_reduce_equals_numpy_for_random_trees_groups_and_reductions(
  mesh, mapping, reduction
):
  tried = []

  @settings(12)
  @given(
    tree=pytrees(),
    groups=valid_groups(),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-3, 1.0, 100.0, "large"]),
  )
  def check(tree, groups, seed, scale):
    kind, specs = tree
    rng = np.random.default_rng(seed)
    members = R if groups is None else len(groups[0])
    leaves = []
    for shape, dtype in specs:
      # "large": values whose sum over a group overflows float16 although
      # their mean does not (a sum's result must itself fit in float16).
      if scale == "large":
        bound = 60000.0 if reduction == "mean" else 60000.0 / members
        leaves.append(per_replica_values(rng, shape, dtype, bound / 2, bound))
      else:
        leaves.append(per_replica_values(rng, shape, dtype, scale))
    inputs = build_tree(kind, leaves)
    out = _reducer(mapping, mesh, reduction, groups)(inputs)
    assert jax.tree.structure(out) == jax.tree.structure(inputs)
    partition = groups or [list(range(R))]
    for x, y in zip(jax.tree.leaves(inputs), jax.tree.leaves(out)):
      assert y.shape == x.shape and y.dtype == x.dtype
      if x.size == 0:  # (jax 0.10: np.asarray of a pmap output of size 0 fails)
        continue
      x64, y = np.asarray(x, np.float64), np.asarray(y)
      for group in partition:
        want = x64[group].sum(axis=0)
        magnitude = np.abs(x64[group]).sum(axis=0)
        if reduction == "mean":
          want, magnitude = want / members, magnitude / members
        for member in group:  # every member: the same bits, close to numpy
          assert y[member].tobytes() == y[group[0]].tobytes(), (
            f"group {group}: replica {member} differs from {group[0]}"
          )
          np.testing.assert_array_less(
            np.abs(y[member].astype(np.float64) - want),
            _tolerance(x.dtype, members, magnitude) + 1e-30,
          )
    tried.append(
      (
        groups is not None,
        tuple(np.dtype(d).name for _, d in specs),
        tuple(shape for shape, _ in specs),
      )
    )

  check()
  dtypes = sorted({d for t in tried for d in t[1]})
  shapes = sorted({s for t in tried for s in t[2]})
  report(
    f"reduce({reduction}) == numpy under {mapping}",
    len(tried),
    f" (with groups {sum(t[0] for t in tried)}; dtypes {dtypes};"
    f" shapes {shapes}); group members bit-identical in all",
  )


# --- Invalid input: clear errors, nothing half-updated. -----------------------


GROUPED = {
  "shardopt.reduce": lambda g: stateless(
    lambda t: shardopt.reduce(t, AXIS, axis_index_groups=g)
  ),
  "shardopt.scale_loss": lambda g: stateless(
    lambda t: jax.tree.map(
      lambda x: shardopt.scale_loss(x, AXIS, axis_index_groups=g), t
    )
  ),
  "shardopt.cross_shard_mean": lambda g: shardopt.cross_shard_mean(
    AXIS, axis_index_groups=g
  ),
  "shardopt.cross_shard_sum": lambda g: shardopt.cross_shard_sum(
    AXIS, axis_index_groups=g
  ),
  "shardopt.cross_shard": lambda g: shardopt.cross_shard(
    optax.adam(0.1), AXIS, axis_index_groups=g
  ),
  "shardopt.agn": lambda g: shardopt.agn(
    optax.sgd(0.1), AXIS, sync_period=2, axis_index_groups=g
  ),
  "shardopt.local_sgd": lambda g: shardopt.local_sgd(
    optax.sgd(0.1), AXIS, sync_period=2, axis_index_groups=g
  ),
  "shardopt.diloco": lambda g: shardopt.diloco(
    optax.sgd(0.1), AXIS, sync_period=2, axis_index_groups=g
  ),
}


_GROUPED_STATES = {}


@pytest.mark.parametrize("kind", INVALID_GROUP_KINDS)
def test_invalid_groups_raise_a_clear_error_and_change_nothing(mesh, kind):
  params = float_params()
  if not _GROUPED_STATES:
    _GROUPED_STATES.update(
      {
        name: init_on_mesh(mesh, make(None), params)
        for name, make in GROUPED.items()
      }
    )
  states = _GROUPED_STATES
  tried = []

  @settings(8)
  @given(groups=invalid_groups(kind), name=st.sampled_from(sorted(GROUPED)))
  def check(groups, name):
    state, specs = states[name]
    grads = float_params()
    try:
      bad = GROUPED[name](groups)
    except ValueError as e:  # rejected when built: nothing ran at all
      message = str(e)
    else:  # rejected while tracing the update
      message = assert_fails_cleanly(
        mesh, bad, state, specs, params, grads, ValueError
      )
    for fragment in (name, "axis_index_groups", repr(AXIS), f"size {R}"):
      assert fragment in message, (kind, groups, message)
    tried.append(name)

  check()
  report(
    f"invalid axis_index_groups ({kind}) -> ValueError",
    len(tried),
    f" over {len(set(tried))} transforms",
  )


WITH_AXIS = {
  "shardopt.reduce": lambda a: stateless(lambda t: shardopt.reduce(t, a)),
  "shardopt.broadcast": lambda a: stateless(lambda t: shardopt.broadcast(t, a)),
  "shardopt.replica_divergence": lambda a: stateless(
    lambda t: jax.tree.map(lambda x: x + shardopt.replica_divergence(t, a), t)
  ),
  "shardopt.scale_loss": lambda a: stateless(
    lambda t: jax.tree.map(lambda x: shardopt.scale_loss(x, a), t)
  ),
  "shardopt.cross_shard_mean": lambda a: shardopt.cross_shard_mean(a),
  "shardopt.cross_shard_sum": lambda a: shardopt.cross_shard_sum(a),
  "shardopt.cross_shard": lambda a: shardopt.cross_shard(optax.adam(0.1), a),
  "shardopt.tower": lambda a: shardopt.tower(optax.adam(0.1), a),
  "shardopt.clip_by_global_norm": lambda a: shardopt.clip_by_global_norm(
    1.0, a
  ),
  "shardopt.agn": lambda a: shardopt.agn(optax.sgd(0.1), a, sync_period=2),
  "shardopt.local_sgd": lambda a: shardopt.local_sgd(
    optax.sgd(0.1), a, sync_period=2
  ),
  "shardopt.diloco": lambda a: shardopt.diloco(
    optax.sgd(0.1), a, sync_period=2
  ),
}


@pytest.mark.parametrize("name", sorted(WITH_AXIS))
def test_wrong_axis_names_raise_a_clear_error_and_change_nothing(mesh, name):
  params = float_params()
  state, specs = init_on_mesh(mesh, WITH_AXIS[name](AXIS), params)
  tried = []

  @settings(5)
  @given(axis=WRONG_NAMES)
  def check(axis):
    message = assert_fails_cleanly(
      mesh,
      WITH_AXIS[name](axis),
      state,
      specs,
      params,
      float_params(),
      shardopt.AxisNotBoundError,
      name,
      repr(axis),
      "is not bound",
    )
    assert "shard_map" in message and "pmap" in message  # names the fix
    tried.append(axis)

  check()
  report(f"wrong axis names for {name} -> AxisNotBoundError", len(tried))


NON_FLOAT_TARGETS = {
  "shardopt.reduce": lambda: stateless(lambda t: shardopt.reduce(t, AXIS)),
  "shardopt.cross_shard_mean": lambda: shardopt.cross_shard_mean(AXIS),
  "shardopt.cross_shard_sum": lambda: shardopt.cross_shard_sum(AXIS),
  "shardopt.cross_shard": lambda: shardopt.cross_shard(optax.sgd(0.1), AXIS),
  "shardopt.tower": lambda: shardopt.tower(optax.sgd(0.1), AXIS),
  # shardopt.agn needs params of the gradients' structure: it is covered by
  # test_agn_rejects_an_integer_gradient_leaf below.
}


def test_non_float_leaves_raise_a_type_error_naming_the_leaf(mesh):
  tried = []
  states = {}

  @settings(30)
  @given(
    tree=pytrees(min_leaves=2, max_leaves=3),
    bad_dtype=st.sampled_from(NON_FLOATS),
    position=st.integers(0, 2),
    name=st.sampled_from(sorted(NON_FLOAT_TARGETS)),
    seed=st.integers(0, 2**31 - 1),
  )
  def check(tree, bad_dtype, position, name, seed):
    kind, specs = tree
    rng = np.random.default_rng(seed)
    position %= len(specs)
    # Non-empty leaves, so every target has something to reduce.
    specs = [
      (shape if shape != (0,) else (2,), dtype) for shape, dtype in specs
    ]
    specs[position] = (specs[position][0], bad_dtype)
    leaves = [per_replica_values(rng, s, d) for s, d in specs]
    params = build_tree(
      kind,
      [
        x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(np.float32)
        for x in leaves
      ],
    )
    grads = build_tree(kind, leaves)
    tx = NON_FLOAT_TARGETS[name]()
    key = (name, kind, tuple(s for s, _ in specs))
    if key not in states:
      states[key] = init_on_mesh(mesh, tx, params)
    state, state_specs = states[key]
    path = jax.tree_util.keystr(
      jax.tree_util.tree_flatten_with_path(grads)[0][position][0]
    )
    assert_fails_cleanly(
      mesh,
      tx,
      state,
      state_specs,
      params,
      grads,
      TypeError,
      name,
      path,
      str(np.dtype(bad_dtype)),
      "floating-point",
    )
    tried.append(name)

  check()
  report(
    "non-float leaves -> TypeError naming the leaf",
    len(tried),
    f" over {len(set(tried))} transforms",
  )


STATEFUL = {
  "cross_shard(adam)": lambda: shardopt.cross_shard(optax.adam(0.1), AXIS),
  "chain(cross_shard_mean, adam)": lambda: optax.chain(
    shardopt.cross_shard_mean(AXIS), optax.adam(0.1)
  ),
  "tower(adam)": lambda: shardopt.tower(optax.adam(0.1), AXIS),
  "agn(sgd)": lambda: shardopt.agn(optax.sgd(0.1), AXIS, sync_period=2),
  "agn(adam)": lambda: shardopt.agn(optax.adam(0.1), AXIS, sync_period=2),
  "local_sgd": lambda: shardopt.local_sgd(optax.sgd(0.1), AXIS, sync_period=2),
  "diloco": lambda: shardopt.diloco(optax.adam(0.1), AXIS, sync_period=2),
  "accumulate(cross_shard(adam), 2)": lambda: shardopt.accumulate(
    shardopt.cross_shard(optax.adam(0.1), AXIS), 2
  ),
  "apply_if_finite(cross_shard(adam))": lambda: shardopt.apply_if_finite(
    shardopt.cross_shard(optax.adam(0.1), AXIS), 2, axis_name=AXIS
  ),
  "accumulate(apply_if_finite(cross_shard(adam)), 2)": lambda: (
    shardopt.accumulate(
      shardopt.apply_if_finite(
        shardopt.cross_shard(optax.adam(0.1), AXIS), 2, axis_name=AXIS
      ),
      2,
    )
  ),
}


MUTATIONS = [
  "drop_leaf",
  "add_leaf",
  "rename_or_retype",
  "other_container",
  "leaf_to_subtree",
]


def _mutate(mutation, kind, leaves):
  """A pytree whose structure differs from ``build_tree(kind, leaves)``."""
  if mutation == "drop_leaf" and len(leaves) > 1:
    return build_tree(kind, leaves[:-1])
  if mutation in ("drop_leaf", "add_leaf"):
    return build_tree(kind, leaves + [leaves[0]])
  if mutation == "rename_or_retype":
    if kind == "dict":
      tree = build_tree(kind, leaves)
      return {("renamed" if k == "leaf0" else k): v for k, v in tree.items()}
    if kind == "list":
      return tuple(leaves)
    return {"outer": [leaves[0]], "rest": tuple(leaves[1:])}
  if mutation == "other_container":
    return build_tree(
      {"dict": "list", "list": "nested", "nested": "dict"}[kind], leaves
    )
  return build_tree(
    kind, [{"nested": leaves[0]}] + leaves[1:]
  )  # leaf_to_subtree


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_grads_not_matching_the_state_structure_raise_and_change_nothing(
  mesh, name
):
  tried = []

  @settings(6)
  @given(
    tree=pytrees(dtypes=[jnp.float32]),
    mutation=st.sampled_from(MUTATIONS),
    seed=st.integers(0, 2**31 - 1),
  )
  def check(tree, mutation, seed):
    kind, specs = tree
    rng = np.random.default_rng(seed)
    specs = [
      (shape if shape != (0,) else (2,), dtype) for shape, dtype in specs
    ]
    leaves = [per_replica_values(rng, shape, dtype) for shape, dtype in specs]
    state, state_specs = init_on_mesh(
      mesh, STATEFUL[name](), build_tree(kind, leaves)
    )
    # The step gets grads AND params of the new structure, as a user who
    # changed the model but kept an old optimizer state would pass them.
    changed = _mutate(mutation, kind, leaves)
    message = assert_fails_cleanly(
      mesh,
      STATEFUL[name](),
      state,
      state_specs,
      changed,
      changed,
      (ValueError, TypeError),
    )
    assert "structure" in message or "mismatch" in message, message
    tried.append(mutation)

  check()
  report(
    f"grads/state tree mismatch for {name} -> error",
    len(tried),
    f" ({len(set(tried))} kinds of mismatch)",
  )


@pytest.mark.parametrize(
  "make, arg",
  [
    (
      lambda v: shardopt.agn(optax.sgd(0.1), AXIS, sync_period=v),
      "sync_period",
    ),
    (
      lambda v: shardopt.local_sgd(optax.sgd(0.1), AXIS, sync_period=v),
      "sync_period",
    ),
    (
      lambda v: shardopt.diloco(optax.sgd(0.1), AXIS, sync_period=v),
      "sync_period",
    ),
  ],
  ids=["agn", "local_sgd", "diloco"],
)
def test_sync_period_not_a_positive_integer_is_rejected(make, arg):
  tried = []

  @settings(30)
  @given(
    value=st.one_of(
      st.integers(max_value=0),
      st.booleans(),
      st.floats(allow_nan=True),
      st.none(),
      st.text(max_size=3),
    )
  )
  def check(value):
    with pytest.raises(ValueError) as info:
      make(value)
    message = str(info.value)
    assert f"{arg}={value!r}" in message and ">= 1" in message, message
    tried.append(value)

  check()
  report(f"{arg} <= 0 or not an integer -> ValueError", len(tried))


# --- Once gaps in shardopt.agn / local_sgd, now checked by periodic.py. -------


@pytest.mark.parametrize("name", ["agn(sgd)", "local_sgd"])
def test_periodic_rejects_grads_with_a_leaf_turned_into_a_subtree(mesh, name):
  leaves = [float_params()["w"], float_params()["b"]]
  state, specs = init_on_mesh(
    mesh, STATEFUL[name](), build_tree("dict", leaves)
  )
  changed = _mutate("leaf_to_subtree", "dict", leaves)
  message = assert_fails_cleanly(
    mesh, STATEFUL[name](), state, specs, changed, changed, Exception
  )
  assert "structure" in message or "mismatch" in message, message


def test_agn_rejects_an_integer_gradient_leaf(mesh):
  params = {"w": float_params()["w"], "i": float_params()["w"]}
  grads = {
    "w": params["w"],
    "i": per_replica_values(np.random.default_rng(1), (3,), jnp.int32),
  }
  tx = shardopt.agn(optax.sgd(0.1), AXIS, sync_period=2)
  state, specs = init_on_mesh(mesh, tx, params)
  assert_fails_cleanly(
    mesh, tx, state, specs, params, grads, TypeError, "shardopt.agn", "['i']"
  )


def test_agn_accepts_bfloat16_gradients_for_float32_params():
  tx = shardopt.agn(optax.sgd(0.1), AXIS, sync_period=2)

  def step(params, grads):
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)

  params = jax.pmap(step, axis_name=AXIS)(
    np.zeros((R, 3), np.float32), np.ones((R, 3), jnp.bfloat16)
  )
  np.testing.assert_allclose(np.asarray(params), -0.1, rtol=1e-2)
