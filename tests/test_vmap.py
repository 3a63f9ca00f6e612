"""shardopt.vmap_axes: the state's in_axes/out_axes for jax.vmap (the route
of MaxText and drjax: replicas stacked on a leading axis, no shard_map).

The axes are checked against state_specs (0 exactly where it says
P(axis), None where it says P()), against the per-replica fields each
transform documents, and by running: a vmapped local_sgd with them gives
numpy's local SGD, while the all-batched state raises. The Explicit-mesh
limitation docs/vmap.md states is checked on JAX itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

N = 4  # replicas
PARAMS = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}

TRANSFORMS = {
  "local_sgd": lambda: shardopt.local_sgd(
    optax.sgd(0.1, momentum=0.9), "data", sync_period=2
  ),
  "diloco": lambda: shardopt.diloco(optax.adam(1e-3), "data", sync_period=2),
  "cross_shard": lambda: shardopt.cross_shard(optax.adam(1e-3), "data"),
  "chain": lambda: optax.chain(
    optax.clip_by_global_norm(1.0),
    shardopt.powersgd("data", rank=1),
    optax.adam(1e-3),
  ),
  "tower": lambda: shardopt.tower(optax.adam(1e-3), "data"),
}


def _mesh(types=AxisType.Auto):
  return jax.make_mesh(
    (N,), ("data",), axis_types=(types,), devices=jax.devices()[:N]
  )


def _leaves(tree):
  """The leaves of a vmap_axes or state_specs tree, None kept as a leaf."""
  return jax.tree.leaves(tree, is_leaf=lambda x: x is None or isinstance(x, P))


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_axes_are_zero_exactly_where_state_specs_say_per_replica(name):
  tx = TRANSFORMS[name]()
  specs = shardopt.state_specs(tx, PARAMS, "data", mesh=_mesh())
  axes = shardopt.vmap_axes(tx, PARAMS, "data", mesh=_mesh())
  is_leaf = lambda x: x is None or isinstance(x, P)  # noqa: E731
  assert jax.tree.structure(axes, is_leaf=is_leaf) == jax.tree.structure(
    specs, is_leaf=is_leaf
  )
  for spec, axis in zip(_leaves(specs), _leaves(axes), strict=True):
    assert spec in (P(), P("data")), spec
    assert axis == (0 if spec == P("data") else None), (spec, axis)
  # The state's own structure: one axis per leaf of tx.init(params).
  init = jax.eval_shape(
    jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=N), PARAMS
  )
  assert len(_leaves(axes)) == len(jax.tree.leaves(init))


def test_axes_name_the_fields_each_transform_documents():
  """Independent of state_specs: the per-replica fields the docstrings
  name (local moments, error feedback, tower's slice) and the replicated
  ones (counters, center, reduced-gradient moments)."""
  axes = shardopt.vmap_axes(
    TRANSFORMS["local_sgd"](), PARAMS, "data", axis_size=N
  )
  assert axes.count is None and axes.sync_count is None
  assert axes.center == {"w": None} and axes.local_state[0].trace == {"w": 0}
  axes = shardopt.vmap_axes(TRANSFORMS["diloco"](), PARAMS, "data", axis_size=N)
  assert (
    axes.local_state[0].mu == {"w": 0} and axes.local_state[0].count is None
  )
  assert axes.global_state[0].trace == {"w": None}
  axes = shardopt.vmap_axes(
    TRANSFORMS["cross_shard"](), PARAMS, "data", axis_size=N
  )
  assert set(_leaves(axes)) == {None}
  axes = shardopt.vmap_axes(TRANSFORMS["chain"](), PARAMS, "data", axis_size=N)
  assert axes[1].error == {"w": 0} and axes[1].q == {"w": None}
  assert axes[2][0].mu == {"w": None}
  axes = shardopt.vmap_axes(TRANSFORMS["tower"](), PARAMS, "data", axis_size=N)
  assert axes[0].mu == {"w": 0} and axes[0].count is None


def test_axis_size_traces_without_a_mesh_and_agrees_with_the_mesh():
  for name, make_tx in TRANSFORMS.items():
    tx = make_tx()
    assert shardopt.vmap_axes(tx, PARAMS, "data", axis_size=N) == (
      shardopt.vmap_axes(tx, PARAMS, "data", mesh=_mesh())
    ), name


def test_a_per_replica_scalar_is_batched_where_state_specs_refuses_it():
  """A local optax.apply_if_finite counts each replica's own non-finite
  steps: a per-replica scalar, which P(axis) blocks cannot hold but a
  vmap stacks to shape (N,)."""
  tx = shardopt.local_sgd(
    optax.apply_if_finite(optax.sgd(0.1), 3), "data", sync_period=2
  )
  with pytest.raises(ValueError, match="notfinite_count is a scalar"):
    shardopt.state_specs(tx, PARAMS, "data", mesh=_mesh())
  axes = shardopt.vmap_axes(tx, PARAMS, "data", axis_size=N)
  assert axes.local_state.notfinite_count == 0
  params = {"w": jnp.zeros((8, 6))}
  state = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name="data", axis_size=N
  )(params)
  assert state.local_state.notfinite_count.shape == (N,)
  assert state.count.shape == ()


def _local_sgd_numpy(p0, grads, lr, momentum, sync_period):
  """Local momentum SGD per replica, the params averaged every
  sync_period steps (the momentum stays each replica's own)."""
  p = np.stack([p0] * N).astype(np.float64)
  trace = np.zeros_like(p)
  for t, g in enumerate(grads, start=1):
    trace = g + momentum * trace
    p = p - lr * trace
    if t % sync_period == 0:
      p = np.broadcast_to(p.mean(0), p.shape).copy()
  return p


def test_vmapped_local_sgd_with_its_axes_matches_numpy():
  tx = shardopt.local_sgd(optax.sgd(0.1, momentum=0.9), "data", sync_period=2)
  rng = np.random.default_rng(0)
  p0 = rng.normal(size=(8, 6)).astype(np.float32)
  grads = [rng.normal(size=(N, 8, 6)).astype(np.float32) for _ in range(5)]
  axes = shardopt.vmap_axes(tx, {"w": p0}, "data", axis_size=N)
  state = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name="data", axis_size=N
  )({"w": jnp.asarray(p0)})

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(
    jax.vmap(step, in_axes=(0, axes, 0), out_axes=(0, axes), axis_name="data")
  )
  p = {"w": jnp.asarray(np.stack([p0] * N))}
  for g in grads:
    p, state = step(p, state, {"w": jnp.asarray(g)})
  expected = _local_sgd_numpy(p0, grads, 0.1, 0.9, 2)
  np.testing.assert_allclose(np.asarray(p["w"]), expected, rtol=1e-5, atol=1e-6)
  assert int(state.count) == len(grads)


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_the_all_batched_state_raises_and_vmap_axes_does_not(name):
  tx = TRANSFORMS[name]()
  params = {"w": jnp.ones((N, 8, 6))}

  def step(p, s, g):
    return tx.update(g, s, p)[0]

  batched = jax.vmap(tx.init, axis_name="data")(params)
  with pytest.raises(ValueError, match="batched by jax.vmap"):
    jax.jit(jax.vmap(step, axis_name="data"))(params, batched, params)

  axes = shardopt.vmap_axes(tx, {"w": params["w"][0]}, "data", axis_size=N)
  state = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name="data", axis_size=N
  )({"w": params["w"][0]})
  updates = jax.jit(jax.vmap(step, in_axes=(0, axes, 0), axis_name="data"))(
    params, state, params
  )
  assert updates["w"].shape == (N, 8, 6)


def test_errors_name_the_function_the_argument_and_the_fix():
  tx = TRANSFORMS["cross_shard"]()
  with pytest.raises(ValueError, match=r"shardopt.vmap_axes: axis_name=\("):
    shardopt.vmap_axes(tx, PARAMS, ("island", "data"), axis_size=N)
  with pytest.raises(ValueError, match="vmap_axes: axis_name=None"):
    shardopt.vmap_axes(tx, PARAMS, None, axis_size=N)
  with pytest.raises(ValueError, match="vmap_axes: no mesh to trace on"):
    shardopt.vmap_axes(tx, PARAMS, "data")
  with pytest.raises(ValueError, match="vmap_axes: axis 'batch' is not an"):
    shardopt.vmap_axes(tx, PARAMS, "batch", mesh=_mesh())


# docs/vmap.md, "Auto meshes only, for now": what JAX 0.10 does with a
# collective under vmap(spmd_axis_name=) on an Explicit mesh. When one of
# these starts passing, a JAX release fixed it: update that section.


def test_explicit_mesh_psum_of_a_per_replica_scalar_fails_inside_jax():
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    x = jax.device_put(np.ones(N, np.float32), NamedSharding(mesh, P("data")))
    psum = jax.vmap(
      lambda v: jax.lax.psum(v, "data"), axis_name="data", spmd_axis_name="data"
    )
    with pytest.raises(AssertionError, match=r"\(0, P\('data',\)\)"):
      jax.jit(psum)(x)
    x = jax.device_put(
      np.ones((N, 3), np.float32), NamedSharding(mesh, P("data"))
    )
    with pytest.raises(ValueError, match="does not evenly divide"):
      jax.jit(psum)(x)


def test_explicit_mesh_diloco_step_under_spmd_vmap_fails_inside_jax():
  mesh = _mesh(AxisType.Explicit)
  tx = shardopt.diloco(optax.sgd(0.1), "data", sync_period=2)
  with jax.set_mesh(mesh):
    params = {"w": jnp.zeros((8, 6))}
    axes = shardopt.vmap_axes(tx, params, "data")
    state = jax.vmap(
      tx.init, in_axes=None, out_axes=axes, axis_name="data", axis_size=N
    )(params)
    state = jax.tree.map(
      lambda x, a: jax.device_put(
        x, NamedSharding(mesh, P("data") if a == 0 else P())
      ),
      state,
      axes,
      is_leaf=lambda x: x is None,
    )
    stacked = jax.device_put(
      jnp.ones((N, 8, 6)), NamedSharding(mesh, P("data"))
    )

    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    vstep = jax.vmap(
      step,
      in_axes=(0, axes, 0),
      out_axes=(0, axes),
      axis_name="data",
      spmd_axis_name="data",
    )
    with pytest.raises(AssertionError, match=r"\(0, P\('data',\)\)"):
      jax.jit(vstep)({"w": stacked}, state, {"w": stacked})


# ------------------------------------------- groups over a jax.vmap axis

GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]


def _vmapped(fn, x):
  return jax.vmap(fn, axis_name="data")(x)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_grouped_float_reduce_runs_over_a_vmap_axis_and_matches_numpy(
  reduction,
):
  """JAX has no axis_index_groups under vmap; shardopt's grouped float
  reduce sums one slot per group over the whole axis instead: each group's
  numpy mean (or sum), the same bits on every member."""
  x = np.random.default_rng(0).normal(size=(8, 5, 3)).astype(np.float32)
  got = np.asarray(
    _vmapped(
      lambda v: shardopt.reduce(
        v, "data", reduction=reduction, axis_index_groups=GROUPS
      ),
      x,
    )
  )
  for group in GROUPS:
    part = x[group].astype(np.float64)
    want = part.mean(0) if reduction == "mean" else part.sum(0)
    np.testing.assert_allclose(got[group[0]], want, rtol=1e-6, atol=1e-6)
    for member in group[1:]:
      np.testing.assert_array_equal(got[member], got[group[0]])


def test_cross_shard_with_groups_under_vmap_is_each_groups_sgd():
  """``cross_shard(sgd)`` with groups, vmapped: each group's replicas step
  with their group's mean gradient (numpy), bit-identical within a group."""
  g = np.random.default_rng(1).normal(size=(8, 6)).astype(np.float32)
  p = np.zeros((6,), np.float32)
  tx = shardopt.cross_shard(optax.sgd(0.5), "data", axis_index_groups=GROUPS)
  state = tx.init(p)
  updates = np.asarray(
    jax.vmap(lambda gi: tx.update(gi, state, p)[0], axis_name="data")(g)
  )
  for group in GROUPS:
    want = -0.5 * g[group].astype(np.float64).mean(0)
    np.testing.assert_allclose(updates[group[0]], want, rtol=1e-6, atol=1e-7)
    for member in group[1:]:
      np.testing.assert_array_equal(updates[member], updates[group[0]])


@pytest.mark.parametrize(
  "comm_dtype, what",
  [
    (jnp.int8, "the int8 wire"),
    (shardopt.topk(4, chunk_size=16), "the top-k wire"),
  ],
)
def test_a_grouped_quantized_or_sparse_reduce_under_vmap_names_the_fix(
  comm_dtype, what
):
  x = np.ones((8, 64), np.float32)
  tx = shardopt.cross_shard_mean(
    "data",
    comm_dtype=comm_dtype,
    error_feedback=True,
    axis_index_groups=GROUPS,
  )
  axes = shardopt.vmap_axes(tx, x[0], "data", axis_size=8)
  state = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name="data", axis_size=8
  )(x[0])
  with pytest.raises(NotImplementedError) as error:
    jax.vmap(
      lambda g, s: tx.update(g, s)[0],
      in_axes=(0, axes),
      axis_name="data",
    )(x, state)
  message = str(error.value)
  assert what in message and "jax.vmap" in message, message
  assert "jax.pmap or jax.shard_map" in message, message
  assert "float comm_dtype" in message, message


GROUPED_SYNCS = {
  "hierarchical_local_sgd": lambda: shardopt.hierarchical_local_sgd(
    optax.sgd(0.1), "data", period_group_sizes={2: 2, 4: 8}
  ),
}


@pytest.mark.parametrize("name", sorted(GROUPED_SYNCS))
def test_a_sync_within_groups_under_vmap_names_the_fix(name):
  """The sync runs within groups inside a lax.cond: JAX's own error ("Please
  open a feature request!") becomes shardopt's, with the fix."""
  params = {"w": np.ones((4, 3), np.float32)}
  tx = GROUPED_SYNCS[name]()
  axes = shardopt.vmap_axes(tx, params, "data", axis_size=8)
  state = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name="data", axis_size=8
  )(params)
  stacked = jax.tree.map(lambda v: np.broadcast_to(v, (8, *v.shape)), params)

  def step(p, s, g):
    return tx.update(g, s, p)[0]

  with pytest.raises(NotImplementedError) as error:
    jax.vmap(step, in_axes=(0, axes, 0), axis_name="data")(
      stacked, state, stacked
    )
  message = str(error.value)
  assert "a sync within groups" in message, message
  assert "jax.pmap or jax.shard_map" in message, message
