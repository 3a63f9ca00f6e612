"""Strategies, runners and checks shared by the property tests
(tests/test_properties.py, tests/test_properties_transforms.py).

Random pytrees and ``axis_index_groups`` (valid and invalid) as hypothesis
strategies; a transform's step under ``jax.shard_map`` with params, state and
gradients donated; and :func:`assert_fails_cleanly`, the check that a bad
argument raises while tracing and leaves the donated inputs as they were.
How many examples each property draws is the hypothesis profile's
(tests/_hypothesis_profiles.py): ``ci`` by default, ``thorough`` under
``make fuzz``.
"""

import _hypothesis_profiles
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "batch"
R = 8
SHAPES = [(), (0,), (1,), (3,), (2, 3), (7,)]
FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]


def settings(ci_examples):
  """Hypothesis settings from the loaded profile: ``ci_examples`` examples
  under ``ci`` (the default), at least 500 under ``thorough`` (``make
  fuzz``); both skip shrinking (tests/_hypothesis_profiles.py)."""
  return _hypothesis_profiles.settings_for(ci_examples)


def report(what, tried, detail=""):
  """Prints how many inputs a property tried (``pytest -s`` shows it)."""
  print(f"\n[properties] {what}: {tried} inputs tried{detail}")


# --- Strategies. -------------------------------------------------------------


@st.composite
def pytrees(draw, dtypes=FLOATS, min_leaves=1, max_leaves=3):
  """(structure kind, [(shape, dtype)]) for a random pytree of leaves."""
  leaves = draw(
    st.lists(
      st.tuples(st.sampled_from(SHAPES), st.sampled_from(dtypes)),
      min_size=min_leaves,
      max_size=max_leaves,
    )
  )
  return draw(st.sampled_from(["dict", "list", "nested"])), leaves


def build_tree(kind, leaves):
  """A pytree of the given kind holding ``leaves`` (in order)."""
  if kind == "dict":
    return {f"leaf{i}": leaf for i, leaf in enumerate(leaves)}
  if kind == "list":
    return list(leaves)
  return {"outer": {"inner": leaves[0]}, "rest": tuple(leaves[1:])}


@st.composite
def valid_groups(draw):
  if draw(st.integers(0, 3)) == 0:
    return None
  size = draw(st.sampled_from([1, 2, 4, 8]))
  order = draw(st.permutations(range(R)))
  return [list(order[i : i + size]) for i in range(0, R, size)]


INVALID_GROUP_KINDS = [
  "duplicate",
  "out_of_range",
  "unequal",
  "missing",
  "empty_group",
  "empty_list",
  "not_an_int",
  "not_a_list",
]


@st.composite
def invalid_groups(draw, kind):
  """Groups of the given kind that are not a partition into equal groups."""
  order = list(draw(st.permutations(range(R))))
  size = draw(st.sampled_from([2, 4, 8]))
  split = lambda xs: [xs[i : i + size] for i in range(0, len(xs), size)]
  i, j = draw(
    st.lists(st.integers(0, R - 1), min_size=2, max_size=2, unique=True)
  )
  if kind == "duplicate":
    order[j] = order[i]
    return split(order)
  if kind == "out_of_range":
    order[i] = draw(st.sampled_from([-1, R, R + 1, 100]))
    return split(order)
  if kind == "unequal":
    cut = draw(st.sampled_from([1, 3, 5, 7]))
    return [order[:cut], order[cut:]]
  if kind == "missing":
    del order[i]
    return [order]
  if kind == "empty_group":
    return split(order) + [[]]
  if kind == "empty_list":
    return []
  if kind == "not_an_int":
    order[i] = draw(st.sampled_from([1.0, "0", True, None, [0]]))
    return split(order)
  return draw(st.sampled_from(["01234567", 3, {0: 1}]))


WRONG_NAMES = st.one_of(
  st.text(min_size=1, max_size=8).filter(lambda s: s != AXIS),
  st.tuples(
    st.just(AXIS), st.text(min_size=1, max_size=8).filter(lambda s: s != AXIS)
  ),
)


# --- Running a transform step under shard_map. --------------------------------


def per_replica_values(rng, shape, dtype, scale=1.0, bound=np.inf):
  """Values for R replicas, shape (R,) + shape, in [-bound, bound], rounded
  to dtype."""
  values = np.clip(
    scale * rng.standard_normal(size=(R,) + shape), -bound, bound
  )
  if jnp.issubdtype(dtype, jnp.floating):
    return np.asarray(values).astype(dtype)
  if dtype == jnp.bool_:
    return values > 0
  return np.clip(np.round(values * 10), 0, 100).astype(dtype)


def put_rows(mesh, tree):
  return jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, P(AXIS))), tree
  )


def row_specs(tx, params_host):
  """``P()`` for state leaves that are scalars on a replica, else ``P(AXIS)``."""
  per_replica = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((R, 1) + x.shape[1:], x.dtype), params_host
  )
  shapes = jax.eval_shape(
    jax.vmap(tx.init, axis_name=AXIS, axis_size=R), per_replica
  )
  return jax.tree.map(lambda s: P() if s.ndim == 1 else P(AXIS), shapes)


def stateless(fn):
  """A collective as a transform, so every target is called the same way."""
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda g, s, p=None: (fn(g), s)
  )


def donated_step(mesh, tx, state_specs):
  """jit(shard_map(update)) with params, state and grads donated.

  Every replica holds its own params and grads (a leading axis of 1 inside).
  """

  def body(params, state, grads):
    return tx.update(grads, state, params)

  return jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(AXIS), state_specs, P(AXIS)),
      out_specs=(P(AXIS), state_specs),
    ),
    donate_argnums=(0, 1, 2),
  )


def init_on_mesh(mesh, tx, params_host):
  """State built by ``tx`` (a valid transform) inside shard_map."""
  specs = row_specs(tx, params_host)
  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(AXIS), out_specs=specs)
  )
  return init(put_rows(mesh, params_host)), specs


def assert_fails_cleanly(
  mesh, bad_tx, state, specs, params, grads, error, *fragments
):
  """``bad_tx.update`` raises ``error`` naming every fragment, at trace time,
  and leaves the (donated) params, state and grads as they were."""
  params, grads = put_rows(mesh, params), put_rows(mesh, grads)
  args = (params, state, grads)
  before = jax.tree.map(np.array, args)
  step = donated_step(mesh, bad_tx, specs)
  with pytest.raises(error) as lowered:
    step.lower(*args)  # tracing alone raises it
  with pytest.raises(error) as called:
    step(*args)
  for info in (lowered, called):
    for fragment in fragments:
      assert fragment in str(info.value), (fragment, str(info.value))
  for arr, copy in zip(jax.tree.leaves(args), jax.tree.leaves(before)):
    assert not arr.is_deleted(), "a donated input was consumed"
    np.testing.assert_array_equal(np.asarray(arr), copy)
  return str(called.value)


def float_params():
  rng = np.random.default_rng(0)
  return {
    "w": per_replica_values(rng, (3,), jnp.float32),
    "b": per_replica_values(rng, (), jnp.float32),
  }
