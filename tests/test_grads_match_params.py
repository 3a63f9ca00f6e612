"""Every public transform refuses gradients that do not look like the params.

Under ``jax.pmap`` with params of shape (4,) per replica and gradients of
shape (1,), a transform used to broadcast the gradient somewhere inside (an
accumulator, a center, an error buffer) and return updates of a shape nobody
asked for. Each transform's ``update`` now raises at trace time, naming the
transform, the leaf's path and both shapes (``shardopt._shapes``).

The table below lists every name of ``shardopt.__all__``: a transform with
how to build it, or the reason it is not one. A new public name that is in
neither fails ``test_the_table_covers_every_public_name``.

The one exception is ``shardopt.accumulate``, which keeps
``optax.MultiSteps``' behaviour (its accumulator has the params' shapes and
broadcasts the gradient into it): checked against MultiSteps itself.
"""

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

AXIS = "i"
N = 8

# name in shardopt.__all__ -> a function that builds the transform.
TRANSFORMS = {
  "cross_shard": lambda: shardopt.cross_shard(optax.adam(0.1), AXIS),
  "cross_shard_mean": lambda: shardopt.cross_shard_mean(AXIS),
  "cross_shard_sum": lambda: shardopt.cross_shard_sum(AXIS),
  "tower": lambda: shardopt.tower(optax.adam(0.1), AXIS),
  "clip_by_global_norm": lambda: shardopt.clip_by_global_norm(1.0, AXIS),
  "apply_if_finite": lambda: shardopt.apply_if_finite(
    optax.sgd(1.0), 2, axis_name=AXIS
  ),
  "powersgd": lambda: shardopt.powersgd(AXIS, rank=1),
  "decoupled_momentum": lambda: shardopt.decoupled_momentum(
    AXIS, k=2, chunk_size=4
  ),
  "agn": lambda: shardopt.agn(optax.sgd(0.1), AXIS, sync_period=2),
  "local_sgd": lambda: shardopt.local_sgd(optax.sgd(0.1), AXIS, sync_period=2),
  "diloco": lambda: shardopt.diloco(optax.adam(0.1), AXIS, sync_period=1),
  "hierarchical_local_sgd": lambda: shardopt.hierarchical_local_sgd(
    optax.sgd(0.1), AXIS, period_group_sizes={2: 2, 4: 8}
  ),
  "desloc": lambda: shardopt.desloc(optax.adam(0.1), AXIS, sync_period=2),
  "noloco": lambda: shardopt.noloco(
    optax.sgd(0.1), AXIS, sync_period=2, num_matchings=2
  ),
  # Keeps optax.MultiSteps' broadcast: test_accumulate_broadcasts_as_...
  "accumulate": lambda: shardopt.accumulate(optax.sgd(1.0), 1),
}

# More configurations of the transforms above, each its own code path.
VARIANTS = {
  # shardopt.pier is a shardopt.diloco (its errors name diloco).
  "pier": (
    "diloco",
    lambda: shardopt.pier(optax.adam(0.1), AXIS, total_steps=20, sync_period=2),
  ),
  "cross_shard_mean int8 error_feedback": (
    "cross_shard_mean",
    lambda: shardopt.cross_shard_mean(
      AXIS, comm_dtype=jnp.int8, error_feedback=True
    ),
  ),
  "cross_shard int8 error_feedback": (
    "cross_shard",
    lambda: shardopt.cross_shard(
      optax.sgd(1.0), AXIS, comm_dtype=jnp.int8, error_feedback=True
    ),
  ),
  "diloco streaming": (
    "diloco",
    lambda: shardopt.diloco(
      optax.adam(0.1), AXIS, sync_period=2, num_fragments=2
    ),
  ),
}

# The other public names, and why they take no gradients.
NOT_TRANSFORMS = {
  "AxisNotBoundError": "an exception",
  "broadcast": "a collective on any tree",
  "reduce": "a collective on any tree",
  "replica_divergence": "a collective on any tree",
  "scale_loss": "scales a loss",
  "all_finite": "a predicate on any tree",
  "ErrorFeedbackState": "a state",
  "AGNState": "a state",
  "PeriodicState": "a state",
  "PowerSGDState": "a state",
  "DecoupledMomentumState": "a state",
  "AccumulateState": "a state",
  "quantized": "a wire spec",
  "topk": "a wire spec",
  "state_specs": "reads a transform's state layout",
  "vmap_axes": "reads a transform's state layout",
  "describe_fragments": "reads streaming DiLoCo's split of the params",
  "fragment_of": "reads streaming DiLoCo's split of the params",
  "elastic": "a module; its Island runs these transforms' update",
  "wire": "a module of wire specs and collectives",
  "measure": "a module that reads compiled steps",
  "due": "reads a transform's schedule on the host",
  "WARM_UP": "a constant, a value of due",
  "MTDAOState": "a state",
  "DelayedNesterovState": "a state",
  "delayed_nesterov": "an outer optimizer without collectives, like"
  " optax.sgd: it runs on combined outer gradients (diloco's"
  " outer_optimizer, an asynchronous coordinator), never on a replica's",
  "pier_momentum": "a schedule of diloco's outer momentum",
  "pier_learning_rate": "a schedule of diloco's outer learning rate",
  "pier": "a shardopt.diloco (checked as the variant 'pier', its errors"
  " naming shardopt.diloco)",
  "PierOuterState": "a state",
  "mt_dao": "a local optimizer without collectives, like optax.adamw: it"
  " runs inside local_sgd, diloco or desloc, which check the gradients",
  "scale_by_mt_dao": "mt_dao's direction, like optax.scale_by_adam: it runs"
  " inside the transforms, which check the gradients",
}

CHECKED = sorted(
  [(name, name, make) for name, make in TRANSFORMS.items()]
  + [(label, name, make) for label, (name, make) in VARIANTS.items()],
)
REFUSING = [c for c in CHECKED if c[1] != "accumulate"]


def _params():
  # Two leaves (streaming DiLoCo splits them into two fragments); "b" is
  # right, "w" is per replica (4,) against a gradient of shape (1,).
  return {
    "b": np.zeros((N, 4), np.float32),
    "w": np.tile(np.linspace(-1, 1, 4, dtype=np.float32), (N, 1)),
  }


def _grads(w_shape=(1,), w_dtype=np.float32):
  return {
    "b": np.ones((N, 4), np.float32),
    "w": np.ones((N,) + w_shape, w_dtype),
  }


def _step(tx):
  def step(params, grads):
    return tx.update(grads, tx.init(params), params)[0]

  return step


def _under_pmap(tx, params, grads):
  return jax.pmap(_step(tx), axis_name=AXIS)(params, grads)


def test_the_table_covers_every_public_name():
  public = set(shardopt.__all__)
  assert not set(TRANSFORMS) & set(NOT_TRANSFORMS)
  missing = public - set(TRANSFORMS) - set(NOT_TRANSFORMS)
  assert not missing, (
    f"public names in neither table: {sorted(missing)}; add each to"
    " TRANSFORMS (how to build it) or NOT_TRANSFORMS (why it takes no"
    " gradients)"
  )
  assert not (set(TRANSFORMS) | set(NOT_TRANSFORMS)) - public


@pytest.mark.parametrize(
  "label, name, make", REFUSING, ids=[c[0] for c in REFUSING]
)
def test_misshaped_gradients_raise_naming_transform_leaf_and_shapes(
  label, name, make
):
  with pytest.raises(ValueError) as info:
    _under_pmap(make(), _params(), _grads((1,)))
  message = str(info.value)
  assert message.startswith(f"shardopt.{name} (axis 'i'): "), message
  assert (
    "the gradient at ['w'] has shape (1,), but the param at ['w'] has"
    " shape (4,)" in message
  ), message
  assert "jax.grad(loss)(params)" in message, message  # the fix


@pytest.mark.parametrize(
  "label, name, make", REFUSING, ids=[c[0] for c in REFUSING]
)
def test_integer_gradients_of_float_params_raise(label, name, make):
  with pytest.raises(TypeError) as info:
    _under_pmap(make(), _params(), _grads((4,), np.int32))
  message = str(info.value)
  assert message.startswith(
    f"shardopt.{name} (axis 'i'): the gradient at ['w'] has dtype int32,"
    " but the param at ['w'] has dtype float32"
  ), message


@pytest.mark.parametrize(
  "label, name, make", REFUSING, ids=[c[0] for c in REFUSING]
)
def test_a_gradient_tree_unlike_the_params_raises(label, name, make):
  grads = {**_grads((4,)), "extra": np.ones((N, 4), np.float32)}
  with pytest.raises(ValueError) as info:
    _under_pmap(make(), _params(), grads)
  message = str(info.value)
  assert message.startswith(
    f"shardopt.{name} (axis 'i'): the gradient tree does not match the"
    " params tree"
  ), message
  assert "'extra'" in message, message


@pytest.mark.parametrize(
  "label, name, make", CHECKED, ids=[c[0] for c in CHECKED]
)
def test_gradients_shaped_like_the_params_pass(label, name, make):
  """The positive control: each transform traces with matching gradients
  (bfloat16 gradients of float32 params included: only float-ness must
  match) and returns updates of the params' shapes."""
  params = _params()
  for grads in (_grads((4,)), jax.tree.map(jnp.bfloat16, _grads((4,)))):
    out = jax.eval_shape(jax.pmap(_step(make()), axis_name=AXIS), params, grads)
    assert jax.tree.map(lambda u: u.shape, out) == {
      "b": (N, 4),
      "w": (N, 4),
    }, label


def test_cross_shard_mean_without_params_still_reduces():
  """params=None: nothing to compare against; the mean as before."""
  tx = shardopt.cross_shard_mean(AXIS)
  g = np.arange(N, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  out = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name=AXIS)(g)
  np.testing.assert_allclose(np.asarray(out), np.full((N, 3), 3.5))


def test_accumulate_broadcasts_as_optax_multisteps_does():
  """shardopt.accumulate keeps optax.MultiSteps' behaviour: the gradient is
  broadcast into the params-shaped accumulator. The same numbers as
  MultiSteps for the same misshaped gradients (and no error)."""
  params, grads = _params(), _grads((1,))
  grads["w"] = grads["w"] * 3.0
  ours = _under_pmap(TRANSFORMS["accumulate"](), params, grads)
  theirs = _under_pmap(
    optax.MultiSteps(optax.sgd(1.0), 1).gradient_transformation(),
    params,
    grads,
  )
  chex.assert_trees_all_equal(ours, theirs)
  np.testing.assert_array_equal(np.asarray(ours["w"]), -3.0 * np.ones((N, 4)))


@pytest.mark.parametrize(
  "name, make, params_spec",
  [
    # Replicated P() params, per-replica gradients (the README's layout).
    ("tower", TRANSFORMS["tower"], P()),
    # Per-replica P(axis) params (DiLoCo's layout).
    ("diloco", TRANSFORMS["diloco"], P(AXIS)),
  ],
)
def test_misshaped_local_blocks_raise_under_shard_map(name, make, params_spec):
  """Under jax.shard_map the params' and the gradients' local blocks are
  compared: (4,) per replica against (1,)."""
  mesh = jax.make_mesh((N,), (AXIS,))
  tx = make()

  def step(w, g):
    if params_spec == P():
      w = jax.lax.pcast(w, AXIS, to="varying")
    return tx.update({"w": g}, tx.init({"w": w}), {"w": w})[0]["w"]

  f = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(params_spec, P(AXIS)),
    out_specs=P(AXIS),
  )
  w_shape = (4,) if params_spec == P() else (N * 4,)
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"shardopt.{name} (axis 'i'): the gradient at ['w'] has shape (1,),"
      " but the param at ['w'] has shape (4,)"
    ),
  ):
    jax.eval_shape(
      f,
      jax.ShapeDtypeStruct(
        w_shape, jnp.float32, sharding=NamedSharding(mesh, params_spec)
      ),
      jax.ShapeDtypeStruct(
        (N,), jnp.float32, sharding=NamedSharding(mesh, P(AXIS))
      ),
    )
