"""shardopt.tower (TowerOptimizer with 1/n optimizer state) and clip_by_global_norm.

References are independent of the code under test: numpy arithmetic written
here, TensorFlow's TowerOptimizer oracles quoted in design.md, and
``shardopt.cross_shard``/``optax`` applied to the full reduced gradient (the
property the issue asks for: ``tower(inner) == cross_shard(inner)``).
"""

import math
import re

import _mlp
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo

N = 8
AXIS = "batch"

# Leaf sizes: scalar, < n, a multiple of n, not a multiple of n (2-D), 2 * n.
SHAPES = {
  "scalar": (),
  "short": (7,),
  "eight": (8,),
  "odd": (3, 5),
  "matrix": (2, 8),
}
STEPS = 2

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(0.1),
  "adamw": lambda: optax.adamw(0.1, weight_decay=0.1),
  "rmsprop": lambda: optax.rmsprop(0.1),
  "adagrad": lambda: optax.adagrad(0.1),
  "lion": lambda: optax.lion(0.1),
}
# Optimizers whose first update is bit-identical to cross_shard's: only
# multiplies by constants and signs, so XLA folding the constants 1/N and -lr
# together cannot change the rounding (N = 8 is a power of two). With sqrt and
# division XLA CPU may fuse the two programs differently (seen for adagrad:
# 1 ulp), and over several steps it may contract a multiply-add into an FMA in
# one program only, so those compare to float32 rounding.
BIT_IDENTICAL = ("sgd", "momentum", "lion")


def _tree(rng, lead=()):
  return {
    k: rng.normal(size=lead + s).astype(np.float32) for k, s in SHAPES.items()
  }


def _put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _device_copies_equal(tree):
  """Every device's copy of every (replicated) leaf holds the same bits."""
  for leaf in jax.tree.leaves(tree):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == len(leaf.sharding.device_set)
    for s in shards[1:]:
      np.testing.assert_array_equal(s, shards[0])


def _tower_state_specs(inner, params, axis=AXIS):
  """tower's state specs: owned slices (1-D) are P(axis), scalar counters P().

  ``inner.init`` over 1-element stand-ins gives the state's structure without
  binding the axis.
  """
  stand_ins = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((1,), x.dtype), params
  )
  return jax.tree.map(
    lambda x: P(axis) if x.ndim else P(), jax.eval_shape(inner.init, stand_ins)
  )


def _run(tx_tower, tx_cross, params, grads_at):
  """STEPS steps of both transforms from the same params.

  Returns the final params of both and the updates of both at the first step.
  """
  p_tower, p_cross = params, params
  s_tower, s_cross = tx_tower.init(params), tx_cross.init(params)
  for step in range(STEPS):
    u_tower, s_tower = tx_tower.update(grads_at(step), s_tower, p_tower)
    p_tower = optax.apply_updates(p_tower, u_tower)
    u_cross, s_cross = tx_cross.update(grads_at(step), s_cross, p_cross)
    p_cross = optax.apply_updates(p_cross, u_cross)
    if step == 0:
      first = (u_tower, u_cross)
  return (p_tower, p_cross), first


def _assert_first_updates_agree(name, u_tower, u_cross):
  if name in BIT_IDENTICAL:
    # The same arithmetic on the same reduced gradient (psum_scatter and psum
    # add the replicas in the same order): the same bits.
    chex.assert_trees_all_equal(u_tower, u_cross)
  else:
    chex.assert_trees_all_close(u_tower, u_cross, rtol=2e-7, atol=1e-9)


def _grads_at(base):
  # A gradient that changes with the step, so a mismatch in the slice layout or
  # the state shows up in the second step.
  return lambda step: jax.tree.map(lambda b: b * 0.5**step, base)


# --------------------------------------------------------------------------
# tower(inner) == cross_shard(inner)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tower_equals_cross_shard_under_pmap(name):
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: np.broadcast_to(x, (N,) + x.shape), _tree(rng)
  )
  base = _tree(rng, (N,))
  inner = OPTIMIZERS[name]()

  def run(p, b):
    return _run(
      shardopt.tower(inner, AXIS),
      shardopt.cross_shard(inner, AXIS),
      p,
      _grads_at(b),
    )

  (p_tower, p_cross), first = jax.pmap(run, axis_name=AXIS)(params, base)
  _assert_first_updates_agree(name, *first)
  # Over several steps XLA fuses the two programs differently (e.g. a
  # multiply-add contracted to an FMA in one of them): float32 rounding.
  chex.assert_trees_all_close(p_tower, p_cross, rtol=2e-6, atol=2e-7)
  for leaf in jax.tree.leaves(p_tower):  # every replica holds the same bits
    np.testing.assert_array_equal(
      np.asarray(leaf), np.broadcast_to(leaf[0], leaf.shape)
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tower_equals_cross_shard_under_shard_map(mesh, name):
  """Varying gradients (reduce-scatter) and invariant ones (autodiff's sum)."""
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda x: _put(mesh, x, P()), _tree(rng))
  base = jax.tree.map(lambda x: _put(mesh, x, P(AXIS)), _tree(rng, (N,)))
  inner = OPTIMIZERS[name]()

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  def run(p, b):
    b = jax.tree.map(lambda x: x[0], b)  # this replica's gradient: varying
    varying = _run(
      shardopt.tower(inner, AXIS),
      shardopt.cross_shard(inner, AXIS),
      p,
      _grads_at(b),
    )
    # Invariant gradients, as autodiff of P() params delivers them: summed.
    summed = jax.tree.map(lambda x: jax.lax.psum(x, AXIS), b)
    invariant = _run(
      shardopt.tower(inner, AXIS),
      shardopt.cross_shard(inner, AXIS),
      p,
      _grads_at(summed),
    )
    return varying, invariant  # out_specs P(): typed invariant, else an error

  ((t_var, c_var), first_var), ((t_inv, c_inv), first_inv) = run(params, base)
  _assert_first_updates_agree(name, *first_var)
  _assert_first_updates_agree(name, *first_inv)
  # Over several steps XLA fuses the two programs differently: float32 rounding.
  chex.assert_trees_all_close(t_var, c_var, rtol=2e-6, atol=2e-7)
  chex.assert_trees_all_close(t_inv, c_inv, rtol=2e-6, atol=2e-7)
  _device_copies_equal((t_var, t_inv))


def test_tower_sgd_matches_numpy_reference_for_all_leaf_shapes():
  rng = np.random.default_rng(2)
  params = _tree(rng)
  base = _tree(rng, (N,))
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (N,) + x.shape), params)
  tx = shardopt.tower(optax.sgd(0.1), AXIS)

  def step(p, g):
    updates, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, updates)

  out = jax.pmap(step, axis_name=AXIS)(stacked, base)
  for k in SHAPES:
    expected = params[k] - 0.1 * base[k].astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(
      np.asarray(out[k]),
      np.broadcast_to(expected, out[k].shape),
      rtol=1e-6,
      atol=1e-7,
    )


def test_tower_over_a_tuple_of_axes_and_mixed_varying_leaves_equals_cross_shard():
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  axes = ("a", "b")
  rng = np.random.default_rng(3)
  params = jax.tree.map(lambda x: _put(mesh, x, P()), _tree(rng))
  per_device = jax.tree.map(lambda x: _put(mesh, x, P(axes)), _tree(rng, (N,)))
  per_row = jax.tree.map(lambda x: _put(mesh, x, P("a")), _tree(rng, (2,)))
  inner = optax.adam(0.1)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(axes), P("a")), out_specs=P())
  def run(p, g_all, g_row):
    g_all = jax.tree.map(lambda x: x[0], g_all)  # varying over a and b
    # varying over "a", invariant over "b" (already summed over b)
    g_row = jax.tree.map(lambda x: x[0], g_row)
    both = _run(
      shardopt.tower(inner, axes),
      shardopt.cross_shard(inner, axes),
      p,
      lambda step: g_all,
    )
    mixed = _run(
      shardopt.tower(inner, axes),
      shardopt.cross_shard(inner, axes),
      p,
      lambda step: g_row,
    )
    return both, mixed

  ((t_all, c_all), _), ((t_mix, c_mix), _) = run(params, per_device, per_row)
  chex.assert_trees_all_close(t_all, c_all, rtol=2e-6, atol=2e-7)
  chex.assert_trees_all_close(t_mix, c_mix, rtol=2e-6, atol=2e-7)
  _device_copies_equal((t_all, t_mix))


# --------------------------------------------------------------------------
# TensorFlow's TowerOptimizer oracles (design.md, float64, two towers)
# --------------------------------------------------------------------------

FEATURES = np.array([[[1.0]], [[2.0]]])
LABELS = np.array([[[1.0]], [[2.0]]])
FEATURES_2 = LABELS_2 = np.array([[[1.5]], [[2.5]]])


def _tower_loss(c, features, labels):
  return jnp.sum(jnp.abs(features * c - labels))


def _oracle_step(c, features, labels, *, tf_literal, reduction):
  """One GD(lr=1) step in one tower; returns (total loss, new c)."""
  tx = shardopt.tower(
    optax.sgd(1.0), AXIS, reduction="sum" if tf_literal else reduction
  )

  def loss_fn(c):
    loss = _tower_loss(c, features, labels)
    if tf_literal:  # TowerOptimizer scales the loss by 1/towers (unless SUM)
      return shardopt.scale_loss(loss, AXIS, reduction=reduction)
    return loss

  loss, grads = jax.value_and_grad(loss_fn)(c)
  if not tf_literal and reduction == "mean":
    loss = loss / 2  # the reported loss is the mean over the towers
  updates, _ = tx.update(grads, tx.init(c), c)
  return jax.lax.psum(loss, AXIS), optax.apply_updates(c, updates)


ORACLES = [  # reduction, loss, c after one step (design.md)
  ("sum", 27.0, 7.0),
  ("mean", 13.5, 8.5),
]


@pytest.mark.parametrize(
  "tf_literal", [True, False], ids=["scale_loss+sum", "unscaled"]
)
@pytest.mark.parametrize("reduction,loss,c", ORACLES)
def test_tensorflow_tower_oracle_under_pmap(tf_literal, reduction, loss, c):
  with jax.enable_x64(True):
    step = jax.pmap(
      lambda c, f, labels: _oracle_step(
        c, f, labels, tf_literal=tf_literal, reduction=reduction
      ),
      axis_name=AXIS,
      devices=jax.devices()[:2],
    )
    total, new_c = step(jnp.full((2,), 10.0, jnp.float64), FEATURES, LABELS)
    assert new_c.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(total), [loss, loss])
    np.testing.assert_array_equal(np.asarray(new_c), [c, c])


@pytest.mark.parametrize(
  "tf_literal", [True, False], ids=["scale_loss+sum", "unscaled"]
)
@pytest.mark.parametrize("reduction,loss,c", ORACLES)
def test_tensorflow_tower_oracle_under_shard_map_with_replicated_params(
  tf_literal, reduction, loss, c
):
  """c is P(): its gradient arrives invariant, already summed by autodiff."""
  mesh2 = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])
  with jax.enable_x64(True):
    step = jax.jit(
      jax.shard_map(
        lambda c, f, labels: _oracle_step(
          c, f[0], labels[0], tf_literal=tf_literal, reduction=reduction
        ),
        mesh=mesh2,
        in_specs=(P(), P(AXIS), P(AXIS)),
        out_specs=(P(), P()),
      )
    )
    total, new_c = step(
      _put(mesh2, jnp.array(10.0, jnp.float64), P()),
      _put(mesh2, FEATURES, P(AXIS)),
      _put(mesh2, LABELS, P(AXIS)),
    )
    assert new_c.dtype == jnp.float64
    assert float(total) == loss
    assert float(new_c) == c


@pytest.mark.parametrize(
  "tf_literal", [True, False], ids=["scale_loss+sum", "unscaled"]
)
def test_tensorflow_tower_oracle_two_sum_steps(tf_literal):
  with jax.enable_x64(True):
    step = jax.pmap(
      lambda c, f, labels: _oracle_step(
        c, f, labels, tf_literal=tf_literal, reduction="sum"
      ),
      axis_name=AXIS,
      devices=jax.devices()[:2],
    )
    _, c = step(jnp.full((2,), 10.0, jnp.float64), FEATURES, LABELS)
    total, c = step(c, FEATURES_2, LABELS_2)
    np.testing.assert_array_equal(np.asarray(total), [24.0, 24.0])
    np.testing.assert_array_equal(np.asarray(c), [3.0, 3.0])


# --------------------------------------------------------------------------
# Optimizer state: ceil(size / n) per leaf per replica
# --------------------------------------------------------------------------

STATE_SHAPES = {"w": (64, 33), "b": (33,), "s": ()}


def _np_owned_slice(x, n, r):
  """numpy reference of tower's layout outside model-parallel replicas:
  replica r owns the contiguous block r of the leaf flattened and zero-padded
  to a multiple of n, shaped like the leaf with its first dimension whose
  size is a multiple of n divided by n (flat if there is none)."""
  m = -(-x.size // n)
  block = np.pad(x.reshape(-1), (0, n * m - x.size))[r * m : (r + 1) * m]
  for d, size in enumerate(x.shape):
    if size >= n and size % n == 0:
      return block.reshape(x.shape[:d] + (size // n,) + x.shape[d + 1 :])
  return block


def _bytes_per_device(tree):
  return sum(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)
  )


def test_adam_state_bytes_per_replica_are_ceil_size_over_n():
  rng = np.random.default_rng(4)
  params_np = {
    k: rng.normal(size=s).astype(np.float32) for k, s in STATE_SHAPES.items()
  }
  grads_np = {
    k: rng.normal(size=(8,) + s).astype(np.float32)
    for k, s in STATE_SHAPES.items()
  }
  sizes = [math.prod(s) for s in STATE_SHAPES.values()]
  rows = []
  for n in (2, 4, 8):
    mesh_n = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    params = jax.tree.map(lambda x: _put(mesh_n, x, P()), params_np)
    grads = jax.tree.map(lambda x: _put(mesh_n, x[:n], P(AXIS)), grads_np)
    tower_tx = shardopt.tower(optax.adam(0.1), AXIS)
    cross_tx = shardopt.cross_shard(optax.adam(0.1), AXIS)
    tower_specs = _tower_state_specs(optax.adam(0.1), params)
    tower_state = jax.jit(
      jax.shard_map(
        tower_tx.init, mesh=mesh_n, in_specs=P(), out_specs=tower_specs
      )
    )(params)
    cross_state = jax.jit(
      jax.shard_map(cross_tx.init, mesh=mesh_n, in_specs=P(), out_specs=P())
    )(params)

    # One step that carries the sharded state in and out of shard_map.
    def step(tx, state_specs):
      @jax.jit
      @jax.shard_map(
        mesh=mesh_n,
        in_specs=(P(), state_specs, P(AXIS)),
        out_specs=(P(), state_specs),
      )
      def run(p, state, g):
        updates, state = tx.update(jax.tree.map(lambda x: x[0], g), state, p)
        return optax.apply_updates(p, updates), state

      return run

    p_tower, tower_state = step(tower_tx, tower_specs)(
      params, tower_state, grads
    )
    p_cross, cross_state = step(cross_tx, P())(params, cross_state, grads)
    chex.assert_trees_all_close(p_tower, p_cross, rtol=2e-6, atol=2e-7)
    # Replica r's owned slice (the r-th P(axis) block of the state) is the
    # full moment's r-th slice of the documented layout.
    for field in ("mu", "nu"):
      owned = optax.tree_utils.tree_get(tower_state, field)
      full = optax.tree_utils.tree_get(cross_state, field)
      for k in STATE_SHAPES:
        blocks = np.split(np.asarray(owned[k]), n)
        for r, block in enumerate(blocks):
          np.testing.assert_allclose(
            block,
            _np_owned_slice(np.asarray(full[k]), n, r),
            rtol=2e-6,
            atol=1e-9,
          )

    tower_bytes = _bytes_per_device(tower_state)
    cross_bytes = _bytes_per_device(cross_state)
    count_bytes = 4  # adam's int32 count, replicated
    assert (
      tower_bytes == 2 * 4 * sum(-(-size // n) for size in sizes) + count_bytes
    )
    assert cross_bytes == 2 * 4 * sum(sizes) + count_bytes
    rows.append((n, tower_bytes, cross_bytes, tower_bytes / cross_bytes))
  print(
    f"\nadam state bytes per replica, params {STATE_SHAPES} ({sum(sizes)} floats)"
  )
  print(f"{'n':>3} {'tower':>8} {'cross_shard':>12} {'ratio':>7}")
  for n, t, c, r in rows:
    print(f"{n:>3} {t:>8} {c:>12} {r:>7.4f}")


# --------------------------------------------------------------------------
# Communication: reduce-scatter + all-gather, no all-reduce; comm_dtype
# --------------------------------------------------------------------------


def _collectives(text):
  return sorted(
    set(
      re.findall(
        r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)\b",
        text,
      )
    )
  )


def test_compiled_step_reduce_scatters_and_all_gathers_without_all_reduce(mesh):
  tx = shardopt.tower(optax.adam(0.1), AXIS)
  params = {"w": _put(mesh, np.ones((5, 7), np.float32), P())}

  def collectives_of_step(grads_spec, grads):
    @jax.shard_map(mesh=mesh, in_specs=(P(), grads_spec), out_specs=P())
    def step(p, g):
      g = jax.tree.map(lambda x: x.reshape(x.shape[-2:]), g)
      updates, _ = tx.update(g, tx.init(p), p)
      return updates

    return _collectives(jax.jit(step).lower(params, grads).compile().as_text())

  varying = collectives_of_step(
    P(AXIS), {"w": _put(mesh, np.ones((N, 5, 7), np.float32), P(AXIS))}
  )
  print("\ncollectives in the compiled step, varying gradients:", varying)
  assert varying == ["all-gather", "reduce-scatter"]
  # Invariant gradients (P(): already summed, as autodiff delivers them for
  # replicated params): no reduction at all, only the all-gather.
  invariant = collectives_of_step(
    P(), {"w": _put(mesh, np.ones((5, 7), np.float32), P())}
  )
  print("collectives in the compiled step, invariant gradients:", invariant)
  assert invariant == ["all-gather"]


# An MLP whose leaves take every path of the layout: a kernel split along its
# first dimension ((16, 20)), one split along its second ((4, 16): 4 < n), a
# bias split along its only dimension ((16,)), and leaves with no dimension
# divisible by n, padded or not ((20, 10), (20,), (10,): flattened).
COPY_SIZES = (4, 16, 20, 10)


def _copies(text):
  """(number, bytes) of the ``copy`` instructions in compiled HLO text."""
  count = sum(
    1
    for line in text.splitlines()
    if re.match(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.+?\s+copy(?:-start)?\(", line)
  )
  copied = hlo.copied_bytes(text)
  return count, copied["top"] + sum(copied["conditional"].values())


def _per_replica_step_text(tx, mesh):
  """A training loop's donated jit + shard_map step: every replica's params,
  state and batch are P(AXIS) blocks of global arrays."""
  stacked = _mlp.replicate(_mlp.mlp_init(jax.random.key(0), COPY_SIZES), N)
  state = _mlp.on_mesh(jax.pmap(tx.init, axis_name=AXIS)(stacked), mesh)
  step = _mlp.concat_shard_map_step(
    tx, mesh, _mlp.concat_specs(state), donate=True
  )
  batch = _mlp.batch(jax.random.key(1), N, 4, COPY_SIZES[0], COPY_SIZES[-1])
  args = _mlp.on_mesh(stacked, mesh), state, *_mlp.on_mesh(batch, mesh)
  return step.lower(*args).compile().as_text()


def _replicated_step_text(tx, mesh, sharded_state):
  """A donated jit + checking shard_map step over replicated P() params (the
  gradients arrive summed: tower only all-gathers); the state is P() or, for
  tower, as ``shardopt.state_specs`` says."""
  params = _put(mesh, _mlp.mlp_init(jax.random.key(0), COPY_SIZES), P())
  state_specs = (
    shardopt.state_specs(tx, params, AXIS, mesh=mesh) if sharded_state else P()
  )
  state = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs)
  )(params)
  x, y = _mlp.batch(jax.random.key(1), 1, 4 * N, COPY_SIZES[0], COPY_SIZES[-1])

  def step(p, state, x, y):
    grads = jax.grad(_mlp.mlp_loss)(p, x, y)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), state_specs, P(AXIS), P(AXIS)),
      out_specs=(P(), state_specs),
    ),
    donate_argnums=(0, 1),
  )
  batch = _put(mesh, x[0], P(AXIS)), _put(mesh, y[0], P(AXIS))
  return step.lower(params, state, *batch).compile().as_text()


def test_compiled_step_copies_no_more_than_plain_optax(mesh):
  """Outside model-parallel replicas each replica owns a contiguous block
  (owner-major): the reduce-scatter and the all-gather move contiguous
  blocks, and XLA adds no layout copy (transpose) around them. A strided
  slice (replica i owning rows i, i + n, ...) cost 26 copies (7,840 bytes)
  here with per-replica params, where plain optax has 2 (2,080 bytes: the
  same in both, donated params), and 6 with replicated params, where plain
  optax has none."""
  plain, tower = optax.adam(1e-3), shardopt.tower(optax.adam(1e-3), AXIS)
  per_replica = {
    name: _per_replica_step_text(tx, mesh)
    for name, tx in (("plain", plain), ("tower", tower))
  }
  replicated = {
    "plain": _replicated_step_text(plain, mesh, sharded_state=False),
    "tower": _replicated_step_text(tower, mesh, sharded_state=True),
  }
  print(
    "\ncopy ops (number, bytes), per-replica params:",
    {k: _copies(t) for k, t in per_replica.items()},
  )
  print(
    "copy ops (number, bytes), replicated params:",
    {k: _copies(t) for k, t in replicated.items()},
  )
  # The tower steps do reduce-scatter/all-gather (this is no vacuous pass).
  assert _collectives(per_replica["tower"]) == ["all-gather", "reduce-scatter"]
  assert "all-gather" in _collectives(replicated["tower"])
  for texts in (per_replica, replicated):
    tower_count, tower_bytes = _copies(texts["tower"])
    plain_count, plain_bytes = _copies(texts["plain"])
    assert tower_count <= plain_count, texts["tower"]
    assert tower_bytes <= plain_bytes


def test_comm_dtype_bfloat16_is_on_the_wire_and_rounds_like_numpy(mesh):
  tx = shardopt.tower(optax.sgd(1.0), AXIS, comm_dtype=jnp.bfloat16)
  rng = np.random.default_rng(5)
  g_np = rng.normal(size=(N, 11)).astype(np.float32)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=P(AXIS), out_specs=P())
  def step(g):
    updates, _ = tx.update(g[0], tx.init(g[0]))
    return updates

  g = _put(mesh, g_np, P(AXIS))
  text = step.lower(g).as_text()
  # 11 elements padded to 16 (viewed as 8 owners x 2, owner-major), each of
  # the 8 replicas reduces 2, in bfloat16; the updates come back in float32.
  assert re.search(
    r'"stablehlo.reduce_scatter".*?\}\) : \(tensor<8x2xbf16>\)'
    r" -> tensor<1x2xbf16>",
    text,
    flags=re.S,
  ), text
  assert re.search(
    r"\"stablehlo.all_gather\".*: \(tensor<1x2xf32>\) -> tensor<8x2xf32>", text
  ), text
  bf16 = np.asarray(jnp.asarray(g_np, jnp.bfloat16).astype(jnp.float32))
  expected = -bf16.astype(np.float64).sum(0) / N
  np.testing.assert_allclose(
    np.asarray(step(g)), expected, rtol=2e-2, atol=1e-2
  )


def test_comm_dtype_float16_sum_does_not_overflow():
  tx = shardopt.tower(
    optax.sgd(1.0), AXIS, reduction="sum", comm_dtype=jnp.float16
  )

  def step(g):
    updates, _ = tx.update(g, tx.init(g))
    return updates

  out = jax.pmap(step, axis_name=AXIS)(jnp.full((N, 3), 60000.0))
  # 8 * 60000 = 480000 overflows float16 (max 65504) unless pre-divided.
  np.testing.assert_allclose(
    np.asarray(out), np.full((N, 3), -480000.0), rtol=1e-3
  )


# --------------------------------------------------------------------------
# Pass-through leaves, constant inner updates, errors
# --------------------------------------------------------------------------


def test_none_leaves_pass_through_and_constant_updates_are_typed_invariant(
  mesh,
):
  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=P(AXIS), out_specs=P())
  def step(g):
    grads = {"w": g[0], "frozen": None}
    zeros, _ = shardopt.tower(optax.set_to_zero(), AXIS).update(
      grads, optax.EmptyState()
    )
    tx = shardopt.tower(optax.sgd(1.0), AXIS)
    updates, _ = tx.update(grads, tx.init(grads))
    return zeros, updates

  g_np = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  zeros, updates = step(_put(mesh, g_np, P(AXIS)))
  assert zeros["frozen"] is None and updates["frozen"] is None
  np.testing.assert_array_equal(np.asarray(zeros["w"]), np.zeros(3))
  np.testing.assert_allclose(np.asarray(updates["w"]), -g_np.mean(0), rtol=1e-6)


def test_multisteps_inside_tower_accumulates_owned_slices(mesh):
  """MultiSteps goes inside tower (its accumulator is then 1/n too).

  Outside, under a checking shard_map with varying gradients, its lax.cond
  branches disagree on varying-ness (tower's updates are invariant).
  """
  tx = shardopt.tower(
    optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2), AXIS
  )

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  def run(w, g):
    state, out = tx.init(w), []
    for micro_step in range(2):
      u, state = tx.update(g[0] * (micro_step + 1.0), state, w)
      out.append(u)
    return out

  g_np = np.arange(N * 5, dtype=np.float32).reshape(N, 5)
  first, second = run(np.zeros(5, np.float32), _put(mesh, g_np, P(AXIS)))
  np.testing.assert_array_equal(np.asarray(first), np.zeros(5))
  # MultiSteps averages the two micro-steps' mean gradients (1x and 2x).
  np.testing.assert_allclose(np.asarray(second), -1.5 * g_np.mean(0), rtol=1e-6)


def test_tower_rejects_bad_arguments_up_front():
  with pytest.raises(
    ValueError, match=r"shardopt\.tower: axis_name=None.*named axis"
  ):
    shardopt.tower(optax.sgd(1.0), None)
  with pytest.raises(ValueError, match="Unsupported reduction: 'max'"):
    shardopt.tower(optax.sgd(1.0), AXIS, reduction="max")
  with pytest.raises(TypeError, match=r"shardopt\.tower: comm_dtype=int32"):
    shardopt.tower(optax.sgd(1.0), AXIS, comm_dtype=jnp.int32)
  with pytest.raises(ValueError, match=r"max_norm=-1\.0 must be a positive"):
    shardopt.clip_by_global_norm(-1.0, AXIS)


def test_tower_outside_a_mapping_names_the_axis_and_the_fix():
  tx = shardopt.tower(optax.sgd(1.0), AXIS)
  with pytest.raises(
    shardopt.AxisNotBoundError,
    match=r"shardopt\.tower: axis name 'batch' is not bound.*pmap",
  ):
    jax.jit(tx.init)(jnp.zeros(3))
  clip = shardopt.clip_by_global_norm(1.0, AXIS)
  with pytest.raises(
    shardopt.AxisNotBoundError,
    match=r"shardopt\.clip_by_global_norm: axis name 'batch' is not bound",
  ):
    jax.jit(clip.update)(jnp.ones(3), optax.EmptyState())


def test_tower_rejects_integer_gradients_naming_the_leaf():
  tx = shardopt.tower(optax.sgd(1.0), AXIS)
  with pytest.raises(
    TypeError, match=r"shardopt\.tower: leaf at \['steps'\] has dtype int32"
  ):
    jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name=AXIS)(
      {"steps": jnp.zeros((N, 2), jnp.int32)}
    )


# --------------------------------------------------------------------------
# clip_by_global_norm
# --------------------------------------------------------------------------


def _clip_np(tree, max_norm):
  norm = math.sqrt(
    sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in tree.values())
  )
  return {k: x * min(1.0, max_norm / norm) for k, x in tree.items()}, norm


def test_sharding_aware_clip_inside_tower_equals_optax_clip_of_full_gradient_pmap():
  rng = np.random.default_rng(6)
  base = _tree(rng, (N,))
  params = jax.tree.map(
    lambda x: np.zeros((N,) + x.shape[1:], np.float32), base
  )
  full_mean = {k: x.astype(np.float64).mean(0) for k, x in base.items()}
  max_norms = (0.5, 100.0)  # clips, passes
  assert (
    _clip_np(full_mean, 0.5)[1] > 0.5 and _clip_np(full_mean, 100.0)[1] < 100.0
  )
  # The example, against optax's clip on the full reduced gradient.
  tower_tx = shardopt.tower(
    optax.chain(shardopt.clip_by_global_norm(0.5, AXIS), optax.adam(1e-3)), AXIS
  )
  cross_tx = shardopt.cross_shard(
    optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3)), AXIS
  )

  def run(p, b):
    out = _run(tower_tx, cross_tx, p, _grads_at(b))
    clipped = []
    for max_norm in max_norms:
      clip_tx = shardopt.tower(
        shardopt.clip_by_global_norm(max_norm, AXIS), AXIS
      )
      clipped.append(clip_tx.update(b, clip_tx.init(p), p)[0])
    # optax's own clip inside tower clips each slice by the slice's norm: wrong.
    naive_tx = shardopt.tower(optax.clip_by_global_norm(0.5), AXIS)
    naive, _ = naive_tx.update(b, naive_tx.init(p), p)
    return out, clipped, naive

  ((p_tower, p_cross), _), clipped, naive = jax.pmap(run, axis_name=AXIS)(
    params, base
  )
  chex.assert_trees_all_close(p_tower, p_cross, rtol=2e-6, atol=2e-7)
  for max_norm, got in zip(max_norms, clipped):
    expected, _ = _clip_np(full_mean, max_norm)
    for k in SHAPES:
      np.testing.assert_allclose(
        np.asarray(got[k]),
        np.broadcast_to(expected[k], got[k].shape),
        rtol=1e-5,
        atol=1e-7,
      )
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(
      {k: np.asarray(x[0]) for k, x in naive.items()},
      _clip_np(full_mean, 0.5)[0],
      rtol=1e-3,
    )


def test_sharding_aware_clip_inside_tower_under_shard_map(mesh):
  rng = np.random.default_rng(7)
  base_np = _tree(rng, (N,))
  base = jax.tree.map(lambda x: _put(mesh, x, P(AXIS)), base_np)
  tx = shardopt.tower(shardopt.clip_by_global_norm(0.5, AXIS), AXIS)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=P(AXIS), out_specs=(P(), P()))
  def step(b):
    varying = jax.tree.map(lambda x: x[0], b)
    summed = jax.tree.map(lambda x: jax.lax.psum(x, AXIS), varying)  # invariant
    return (
      tx.update(varying, tx.init(varying))[0],
      tx.update(summed, tx.init(summed))[0],
    )

  from_varying, from_invariant = step(base)
  expected, _ = _clip_np(
    {k: x.astype(np.float64).mean(0) for k, x in base_np.items()}, 0.5
  )
  for k in SHAPES:
    np.testing.assert_allclose(
      np.asarray(from_varying[k]), expected[k], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
      np.asarray(from_invariant[k]), expected[k], rtol=1e-5, atol=1e-7
    )


def test_clip_without_axis_is_optax_clip_by_global_norm():
  rng = np.random.default_rng(8)
  tree = jax.tree.map(jnp.asarray, _tree(rng))
  for max_norm in (0.5, 100.0):
    ours = jax.jit(shardopt.clip_by_global_norm(max_norm).update)
    theirs = jax.jit(optax.clip_by_global_norm(max_norm).update)
    chex.assert_trees_all_equal(
      ours(tree, optax.EmptyState()), theirs(tree, optax.EmptyState())
    )


def test_clip_with_axis_sums_partitioned_parts_and_counts_invariant_leaves_once(
  mesh,
):
  """Outside tower: varying leaves are parts of one tree, invariant ones shared."""
  rng = np.random.default_rng(9)
  parts = rng.normal(size=(N, 4)).astype(np.float32)
  shared = rng.normal(size=(3,)).astype(np.float32)
  clip = shardopt.clip_by_global_norm(1.0, AXIS)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P()), out_specs=(P(AXIS), P()))
  def step(part, shared):
    out, _ = clip.update({"part": part, "shared": shared}, optax.EmptyState())
    return out["part"], out["shared"]

  part_out, shared_out = step(
    _put(mesh, parts, P(AXIS)), _put(mesh, shared, P())
  )
  norm = math.sqrt(
    float(
      np.sum(parts.astype(np.float64) ** 2)
      + np.sum(shared.astype(np.float64) ** 2)
    )
  )
  assert norm > 1.0
  np.testing.assert_allclose(np.asarray(part_out), parts / norm, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(shared_out), shared / norm, rtol=1e-5)
