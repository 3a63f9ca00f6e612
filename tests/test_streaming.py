"""Streaming DiLoCo's overlap (overlap_steps, overlap_alpha) and layer
fragments (layer_axes) against a numpy reference written from the spec.

The reference works on the params flattened to one vector per replica
(leaves in jax.tree.leaves order, each in C order) and an integer fragment id
per element, so whole-leaf and layer (strided) fragments are the same code:

* step t = 1, 2, ...: every replica takes its local SGD step;
* fragment f syncs when t % H == (f H) // F: outer gradient
  center_f - mean_i params_i,f, one Nesterov SGD step of its own momentum;
* fragment f merges tau steps after its sync (t - tau >= 1 and
  (t - tau) % H == (f H) // F): params_i,f <- alpha params_i,f
  + (1 - alpha) center_f.

With tau >= 1 the sync of step t may run inside the call of step t + 1 (its
all-reduce reads only the params passed in), so ``state.center`` after call t
is compared with the reference center after step t - 1 then; the params must
match after every step.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _streaming_reference import np_streaming_diloco
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo

R = 8  # replicas
H = 4  # sync period
LR = 0.1  # inner SGD
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
RTOL, ATOL = 1e-5, 1e-6

# Four equal leaves: whole-leaf fragments over F in {2, 4} are leaf j ->
# fragment j * F // 4.
LEAVES = {"a": (3,), "b": (3,), "c": (3,), "d": (3,)}
LAYERED = {"blocks": (4, 3, 2), "embed": (5,), "head": (2, 2)}
LAYERED_AXES = {"blocks": 0, "embed": None, "head": None}


# --------------------------------------------------------------------------
# Data, the loss, and the runs under pmap and shard_map.


def _params0(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {
    k: rng.normal(size=s).astype(np.float32) for k, s in sorted(shapes.items())
  }


def _targets(shapes, steps, seed=1):
  """Per step and replica a target per leaf, (steps, R, *shape): the replicas'
  gradients differ, so their params diverge between syncs."""
  rng = np.random.default_rng(seed)
  return {
    k: rng.normal(size=(steps, R) + s).astype(np.float32)
    for k, s in sorted(shapes.items())
  }


def _loss(params, targets):
  return sum(
    0.5 * jnp.sum((p - y) ** 2)
    for p, y in zip(jax.tree.leaves(params), jax.tree.leaves(targets))
  )


def _diloco(num_fragments, **kwargs):
  return shardopt.diloco(
    optax.sgd(LR),
    "batch",
    sync_period=H,
    outer_learning_rate=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    nesterov=True,
    num_fragments=num_fragments,
    **kwargs,
  )


def _scan_body(tx):
  def body(carry, targets):
    params, state = carry
    grads = jax.grad(_loss)(params, targets)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), (params, state)

  return body


def _stack(params):
  return jax.tree.map(lambda p: np.broadcast_to(p, (R,) + p.shape), params)


def _pmap_history(tx, params0, targets):
  """All steps in one pmap(scan): (params, state) after every step, leaves
  (steps, R, ...)."""

  def run(params, targets):
    _, history = jax.lax.scan(
      _scan_body(tx), (params, tx.init(params)), targets
    )
    return history

  history = jax.pmap(run, axis_name="batch")(
    _stack(params0), jax.tree.map(lambda v: v.swapaxes(0, 1), targets)
  )
  return jax.tree.map(lambda v: np.swapaxes(np.asarray(v), 0, 1), history)


def _shard_map_history(tx, mesh, params0, targets):
  """All steps in one checking shard_map(scan) over the 8 devices; params are
  concatenated per-replica blocks P("batch"), counters P()."""
  example = tx.init(jax.tree.map(lambda p: jnp.zeros((1,) + p.shape), params0))
  state_specs = jax.tree.map(
    lambda v: P(None) if jnp.ndim(v) == 0 else P(None, "batch"), example
  )

  def run(params, targets):  # params (1, ...), targets (steps, 1, ...)
    _, history = jax.lax.scan(
      _scan_body(tx), (params, tx.init(params)), targets
    )
    return history

  per_step = P(None, "batch")
  run = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P("batch"), per_step),
      out_specs=(per_step, state_specs),
    )
  )
  history = run(
    jax.device_put(_stack(params0), NamedSharding(mesh, P("batch"))),
    jax.device_put(targets, NamedSharding(mesh, per_step)),
  )
  return jax.tree.map(np.asarray, history)


# --------------------------------------------------------------------------
# Fragment membership of every element, and the numpy reference.


def _np_fragments(nbytes, num_fragments):
  """Leaf ranges of each whole-leaf fragment: contiguous, cut where the
  cumulative bytes come closest to multiples of total/F (the rule of
  tests/test_properties_transforms.py; the examples here have no ties)."""
  cumulative = np.cumsum(nbytes)
  total, cuts = cumulative[-1], [0]
  for j in range(1, num_fragments):
    distance = np.abs(cumulative[:-1] - j * total / num_fragments)
    best = np.flatnonzero(distance == distance.min())
    assert len(best) == 1 and best[0] + 1 > cuts[-1], (nbytes, num_fragments)
    cuts.append(int(best[0]) + 1)
  cuts.append(len(nbytes))
  return [range(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _fragment_ids(shapes, num_fragments, layer_axes=None):
  """Per leaf (tree order) an int array of its shape: each element's fragment.

  layer_axes None: whole leaves, balanced by bytes. Otherwise a dict leaf
  name -> stacked axis or None: layer l of a stacked leaf is in fragment
  l % F; the other leaves are split as whole leaves when there are at least
  F of them, else the j-th of them is fragment j.
  """
  names = sorted(shapes)
  ids = {}
  if layer_axes is None:
    plain = names
  else:
    plain = [k for k in names if layer_axes[k] is None]
    for k in names:
      axis = layer_axes[k]
      if axis is None:
        continue
      layers = shapes[k][axis]
      assert layers % num_fragments == 0
      along = np.arange(layers) % num_fragments
      view = [1] * len(shapes[k])
      view[axis] = layers
      ids[k] = np.broadcast_to(along.reshape(view), shapes[k])
  if len(plain) >= num_fragments:
    groups = _np_fragments(
      [4 * int(np.prod(shapes[k])) for k in plain], num_fragments
    )
    for f, group in enumerate(groups):
      for j in group:
        ids[plain[j]] = np.full(shapes[plain[j]], f)
  else:
    for j, k in enumerate(plain):
      ids[plain[j]] = np.full(shapes[k], j)
  return [ids[k] for k in names]


def _flat(tree, lead):
  """Leaves (*lead, ...) -> (*lead, N) float64, leaves in tree order."""
  return np.concatenate(
    [
      np.asarray(v, np.float64).reshape(lead + (-1,))
      for v in jax.tree.leaves(tree)
    ],
    axis=-1,
  )


def _np_streaming(params0, targets, ids, num_fragments, tau, alpha):
  """The spec in numpy (tests/_streaming_reference.py) on this file's loss,
  whose gradient is ``params - target``."""
  steps = len(jax.tree.leaves(targets)[0])
  y = _flat(targets, (steps, R))
  return np_streaming_diloco(
    _flat(params0, ()),
    lambda params, t: params - y[t - 1],
    steps,
    np.concatenate([i.reshape(-1) for i in ids]),
    num_fragments=num_fragments,
    period=H,
    tau=tau,
    alpha=alpha,
    lr=LR,
    outer_lr=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    replicas=R,
  )


def _check(history, reference, tau, where):
  (params, state), (ref_params, ref_centers) = history, reference
  steps = len(ref_params)
  got_params = _flat(params, (steps, R))
  got_centers = _flat(state.center, (steps, R))
  for t in range(1, steps + 1):
    np.testing.assert_allclose(
      got_params[t - 1],
      ref_params[t - 1],
      rtol=RTOL,
      atol=ATOL,
      err_msg=f"params after step {t} ({where})",
    )
    rows = got_centers[t - 1]
    for i in range(1, R):
      np.testing.assert_array_equal(
        rows[i], rows[0], err_msg=f"center of replica {i} at step {t}"
      )
    lagged = t if tau == 0 else t - 1
    np.testing.assert_allclose(
      got_centers[t - 1, 0],
      ref_centers[lagged],
      rtol=RTOL,
      atol=ATOL,
      err_msg=f"center after call {t} vs reference step {lagged} ({where})",
    )


# --------------------------------------------------------------------------
# The reference against today's streaming DiLoCo (tau = 0, alpha = 0).


@pytest.mark.parametrize("num_fragments", [1, 2, 4])
def test_reference_with_tau_0_alpha_0_is_todays_streaming_diloco(
  num_fragments,
):
  steps = 10
  params0, targets = _params0(LEAVES), _targets(LEAVES, steps)
  history = _pmap_history(_diloco(num_fragments), params0, targets)
  ids = _fragment_ids(LEAVES, num_fragments)
  reference = _np_streaming(params0, targets, ids, num_fragments, 0, 0.0)
  _check(history, reference, 0, f"F={num_fragments}, no overlap")


# --------------------------------------------------------------------------
# Overlap over whole-leaf fragments.


@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize("tau", [0, 1, 3])
@pytest.mark.parametrize("num_fragments", [2, 4])
def test_overlap_matches_numpy_reference(num_fragments, tau, alpha):
  steps = 11
  params0, targets = _params0(LEAVES), _targets(LEAVES, steps, seed=tau + 2)
  tx = _diloco(num_fragments, overlap_steps=tau, overlap_alpha=alpha)
  history = _pmap_history(tx, params0, targets)
  ids = _fragment_ids(LEAVES, num_fragments)
  assert [int(i.flat[0]) for i in ids] == [
    j * num_fragments // 4 for j in range(4)
  ]
  reference = _np_streaming(params0, targets, ids, num_fragments, tau, alpha)
  _check(history, reference, tau, f"F={num_fragments}, tau={tau}, a={alpha}")
  assert len(history[1].global_state) == num_fragments


def test_overlap_matches_numpy_reference_under_shard_map(mesh):
  num_fragments, tau, alpha, steps = 2, 1, 0.5, 10
  params0, targets = _params0(LEAVES), _targets(LEAVES, steps, seed=5)
  tx = _diloco(num_fragments, overlap_steps=tau, overlap_alpha=alpha)
  history = _shard_map_history(tx, mesh, params0, targets)
  ids = _fragment_ids(LEAVES, num_fragments)
  reference = _np_streaming(params0, targets, ids, num_fragments, tau, alpha)
  _check(history, reference, tau, "shard_map, F=2, tau=1, a=0.5")


@pytest.mark.parametrize(
  "num_fragments, extra", [(2, {}), (1, {"layer_axes": 0})], ids=["F2", "F1"]
)
def test_tau_0_alpha_0_is_streaming_diloco_bit_for_bit(num_fragments, extra):
  """tau = 0, alpha = 0 is today's streaming DiLoCo; F = 1 (whatever
  layer_axes says) is plain DiLoCo."""
  steps = 10
  params0, targets = _params0(LEAVES), _targets(LEAVES, steps, seed=6)
  explicit = _pmap_history(
    _diloco(num_fragments, overlap_steps=0, overlap_alpha=0.0, **extra),
    params0,
    targets,
  )
  default = _pmap_history(_diloco(num_fragments), params0, targets)
  for t in range(steps):
    chex.assert_trees_all_equal(
      jax.tree.map(lambda v, t=t: v[t], explicit),
      jax.tree.map(lambda v, t=t: v[t], default),
    )


# --------------------------------------------------------------------------
# Layer fragments.


@pytest.mark.parametrize(
  "tau, alpha", [(0, 0.0), (2, 0.5)], ids=["tau0", "tau2"]
)
@pytest.mark.parametrize("num_fragments", [2, 4])
def test_layer_fragments_match_numpy_reference(num_fragments, tau, alpha):
  steps = 10
  params0, targets = _params0(LAYERED), _targets(LAYERED, steps, seed=7)
  tx = _diloco(
    num_fragments,
    overlap_steps=tau,
    overlap_alpha=alpha,
    layer_axes=LAYERED_AXES,
  )
  history = _pmap_history(tx, params0, targets)
  ids = _fragment_ids(LAYERED, num_fragments, LAYERED_AXES)
  reference = _np_streaming(params0, targets, ids, num_fragments, tau, alpha)
  _check(history, reference, tau, f"layers, F={num_fragments}, tau={tau}")


def test_layer_fragments_along_axis_1_match_numpy_reference():
  """A leaf stacked along axis 1, and three plain leaves (at least F: split
  as whole leaves by bytes, a and b -> fragment 0, c -> fragment 1)."""
  shapes = {"w": (2, 4, 3), "a": (3,), "b": (3,), "c": (6,)}
  layer_axes = {"w": 1, "a": None, "b": None, "c": None}
  num_fragments, tau, alpha, steps = 2, 1, 0.5, 10
  params0, targets = _params0(shapes), _targets(shapes, steps, seed=8)
  tx = _diloco(
    num_fragments,
    overlap_steps=tau,
    overlap_alpha=alpha,
    layer_axes=layer_axes,
  )
  history = _pmap_history(tx, params0, targets)
  ids = _fragment_ids(shapes, num_fragments, layer_axes)
  assert [int(i.flat[0]) for i in ids[:3]] == [0, 0, 1]
  np.testing.assert_array_equal(ids[3][0, :, 0], [0, 1, 0, 1])
  reference = _np_streaming(params0, targets, ids, num_fragments, tau, alpha)
  _check(history, reference, tau, "layers along axis 1, F=2, tau=1")


def test_each_layer_fragment_keeps_its_own_outer_state():
  num_fragments = 2
  tx = _diloco(num_fragments, overlap_steps=1, layer_axes=LAYERED_AXES)
  state = tx.init(_params0(LAYERED))
  assert len(state.global_state) == num_fragments
  ids = np.concatenate(
    [i.reshape(-1) for i in _fragment_ids(LAYERED, 2, LAYERED_AXES)]
  )
  layers = LAYERED["blocks"][0]
  piece = (layers // num_fragments,) + LAYERED["blocks"][1:]
  for f, outer in enumerate(state.global_state):
    arrays = [
      v
      for v in jax.tree.leaves(outer)
      if jnp.ndim(v) > 0 and jnp.issubdtype(jnp.result_type(v), jnp.floating)
    ]
    shapes = [tuple(v.shape) for v in arrays]
    print(f"fragment {f}: outer state shapes {shapes}")
    # One momentum buffer over the fragment's elements only: 17 and 16.
    assert sum(int(np.prod(s)) for s in shapes) == int(np.sum(ids == f))
    assert piece in shapes and LAYERED["blocks"] not in shapes


# --------------------------------------------------------------------------
# Argument checks.


@pytest.mark.parametrize(
  "name, bad",
  [
    ("overlap_steps", -1),
    ("overlap_steps", H),
    ("overlap_steps", 1.5),
    ("overlap_alpha", -0.1),
    ("overlap_alpha", 1.0),
  ],
)
def test_overlap_arguments_are_checked(name, bad):
  with pytest.raises(ValueError, match=r"shardopt\.diloco") as info:
    tx = _diloco(2, **{name: bad})
    params = _stack(_params0(LEAVES))
    state = jax.pmap(tx.init, axis_name="batch")(params)
    jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")(params, state)
  message = str(info.value)
  assert name in message and str(bad) in message, message


def test_layer_axes_need_layers_divisible_by_the_fragments():
  shapes = {"blocks": (3, 2), "head": (2,)}
  with pytest.raises(ValueError, match=r"shardopt\.diloco") as info:
    tx = _diloco(2, layer_axes={"blocks": 0, "head": None})
    params = _stack(_params0(shapes))
    state = jax.pmap(tx.init, axis_name="batch")(params)
    jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")(params, state)
  assert "layer_axes" in str(info.value), info.value


# --------------------------------------------------------------------------
# Bytes per sync from the compiled HLO.


def _largest_sync_branch_bytes(tx, shapes):
  """All-reduce-equivalent bytes of the largest branch of an outermost
  conditional of one compiled step (the syncs run in those branches)."""
  params = {k: jnp.zeros((R,) + s) for k, s in sorted(shapes.items())}
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  text = step.lower(params, jax.pmap(tx.init)(params)).compile().as_text()
  top = [op for op in hlo.compiled_collectives(text) if op.context == "top"]
  assert not top, top
  per_branch = [
    sum(hlo.allreduce_equivalent_bytes(op) for op in branch)
    for cond in hlo.branch_collectives(text, outermost=True)
    for branch in cond
  ]
  return max(per_branch), per_branch


@pytest.mark.parametrize("tau", [0, 1])
def test_layer_fragments_peak_bytes_per_sync(tau):
  shapes = {"blocks": (8, 64, 64), "bias": (4,)}
  total = 4 * sum(int(np.prod(s)) for s in shapes.values())
  blocks = 4 * int(np.prod(shapes["blocks"]))
  allowance = 4 * 4 + 4 + 16  # the tiny leaf, the finite flag, slack
  one = shardopt.diloco(optax.sgd(LR), "batch", sync_period=8)
  whole, whole_branches = _largest_sync_branch_bytes(one, shapes)
  layered = shardopt.diloco(
    optax.sgd(LR),
    "batch",
    sync_period=8,
    num_fragments=4,
    overlap_steps=tau,
    layer_axes={"blocks": 0, "bias": None},
  )
  peak, branches = _largest_sync_branch_bytes(layered, shapes)
  print(
    f"tau={tau}: bytes per sync branch, F=1 {whole_branches},"
    f" F=4 layers {branches}, of {total} param bytes"
  )
  assert whole >= blocks
  assert peak <= total / 4 + allowance


# --------------------------------------------------------------------------
# Overlap: with tau >= 1 the sync's all-reduce does not read the gradient.


def _conds_reading_grads(tx, params) -> list[tuple[bool, bool]]:
  """For each top-level cond of ``tx.update``'s jaxpr: whether it holds a
  collective, and whether any of its operands depends on the grads."""
  jaxpr = jax.make_jaxpr(
    lambda g, s, p: tx.update(g, s, p), axis_env=[("batch", R)]
  )(params, tx.init(params), params).jaxpr
  num_grads = len(jax.tree.leaves(params))
  tainted = set(jaxpr.invars[:num_grads])
  found = []
  for eqn in jaxpr.eqns:
    reads = any(v in tainted for v in eqn.invars if not hasattr(v, "val"))
    if eqn.primitive.name == "cond":
      text = str(eqn.params["branches"][1])
      found.append(("psum" in text or "all_to_all" in text, reads))
    if reads:
      tainted.update(eqn.outvars)
  return found


@pytest.mark.parametrize("tau", [0, 1, 2])
def test_an_overlapped_sync_does_not_depend_on_the_steps_gradient(tau):
  """With tau >= 1 the sync of step t runs in the update of step t + 1 from
  the params it is given: no operand of a sync's cond depends on the
  gradient (data flow read from the jaxpr), so the all-reduce could run
  alongside the forward and backward pass. With tau = 0 the sync reads the
  params after this step's update, so it does depend on it (the control)."""
  params = {f"w{i}": jnp.zeros((3,)) for i in range(2)}
  tx = _diloco(2, overlap_steps=tau)
  conds = _conds_reading_grads(tx, params)
  syncs = [reads for holds_collective, reads in conds if holds_collective]
  assert len(syncs) == 2, conds
  assert all(syncs) if tau == 0 else not any(syncs), (tau, conds)


# --------------------------------------------------------------------------
# Quantized outer gradients, with error feedback, on every fragment's sync.


INT4 = shardopt.quantized(jnp.int4, block_size=32)


def _constant_outer_gradient_run(error_feedback, syncs_per_leaf, **kwargs):
  """Local SGD (outer sgd(1.0), no momentum) with a constant gradient per
  replica: the params restart from the center at every sync, so an element
  whose last sync came after local step ``t`` has the exact center ``-t *
  lr * mean_i(g_i)``. Returns the centers (R, D) per leaf, the error
  buffers, and those exact centers per leaf."""
  d, period, lr = 300, 2, 0.1
  g = np.random.default_rng(0).standard_normal((R, d)).astype(np.float32)
  tx = shardopt.diloco(
    optax.sgd(lr),
    "batch",
    sync_period=period,
    outer_learning_rate=1.0,
    outer_momentum=0.0,
    comm_dtype=INT4,
    error_feedback=error_feedback,
    **kwargs,
  )
  params = {"a": jnp.zeros((R, d)), "b": jnp.zeros((R, d))}
  state = jax.pmap(tx.init)(params)

  def step(p, s):
    mine = jnp.asarray(g)[jax.lax.axis_index("batch")]
    u, s = tx.update({"a": mine, "b": mine}, s, p)
    return optax.apply_updates(p, u), s

  step = jax.pmap(step, axis_name="batch")
  for _ in range(syncs_per_leaf * period):
    params, state = step(params, state)
    jax.block_until_ready(params)
  steps = syncs_per_leaf * period
  exact = {}
  for leaf, phase in _phases(kwargs, d, period).items():
    last_sync = steps - (steps - phase) % period
    exact[leaf] = -last_sync * lr * g.astype(np.float64).mean(0)
  return jax.tree.map(np.asarray, (state.center, state.error)), exact


def _phases(kwargs, d, period):
  """Per leaf ("a", "b" of d elements), each element's sync phase."""
  num_fragments = kwargs.get("num_fragments", 1)
  if "layer_axes" in kwargs:  # element l in fragment l % F
    fragment = np.arange(d) % num_fragments
    ids = {"a": fragment, "b": fragment}
  else:  # whole leaves: "a" fragment 0, "b" fragment F - 1
    ids = {"a": np.zeros(d, int), "b": np.full(d, num_fragments - 1)}
  return {k: (f * period) // num_fragments for k, f in ids.items()}


@pytest.mark.parametrize(
  "kwargs",
  [{}, {"num_fragments": 2}, {"num_fragments": 2, "layer_axes": 0}],
  ids=["whole", "fragments", "layer fragments"],
)
def test_outer_gradient_error_feedback_keeps_the_center_on_course(kwargs):
  """With a 4-bit outer gradient the same rounding repeats at every sync:
  without error feedback the center drifts from the exact one linearly in
  the number of syncs; with it, the drift stays bounded and the center is
  the exact one plus the mean of the error buffers (issue 22's identity,
  per fragment)."""
  syncs = 30
  drift = {}
  for feedback in (False, True):
    (center, error), exact = _constant_outer_gradient_run(
      feedback, syncs, **kwargs
    )
    for leaf in ("a", "b"):
      np.testing.assert_array_equal(
        center[leaf], np.broadcast_to(center[leaf][0], center[leaf].shape)
      )
    drift[feedback] = max(
      np.abs(center[leaf][0] - exact[leaf]).max() for leaf in ("a", "b")
    )
    if feedback:
      assert {e.dtype for e in jax.tree.leaves(error)} == {np.dtype("float32")}
      for leaf in ("a", "b"):
        # center = -(sum of outputs) = -(sum of exact means - mean error).
        np.testing.assert_allclose(
          center[leaf][0],
          exact[leaf] + error[leaf].astype(np.float64).mean(0),
          atol=1e-3,
        )
    else:
      assert error == ()
  print(f"{kwargs}: center drift after {syncs} int4 syncs {drift}")
  assert drift[True] * 10 < drift[False], drift


def test_quantized_streaming_with_overlap_and_layers_under_shard_map(mesh):
  """An int4 wire with error feedback on layer fragments with overlap, in a
  checking shard_map: runs, keeps the centers bit-identical, the error
  buffers per replica, and its params are the float32 wire's moved by
  exactly what the error buffers say the wire dropped."""
  shapes = {"blocks": (4, 3, 2), "embed": (5,), "head": (2, 2)}
  steps = 8
  params0, targets = _params0(shapes), _targets(shapes, steps)
  # Inside the shard_map every leaf has a leading per-replica axis of 1.
  layers = {"blocks": 1, "embed": None, "head": None}
  kwargs = dict(overlap_steps=1, overlap_alpha=0.5, layer_axes=layers)
  exact = _shard_map_history(_diloco(2, **kwargs), mesh, params0, targets)
  quantized = _shard_map_history(
    _diloco(2, comm_dtype=jnp.int4, error_feedback=True, **kwargs),
    mesh,
    params0,
    targets,
  )
  params, state = quantized
  for leaf in jax.tree.leaves(state.center):
    np.testing.assert_array_equal(
      leaf, np.broadcast_to(leaf[:, :1], leaf.shape)
    )
  errors = jax.tree.leaves(state.error)
  assert errors and all(e.dtype == np.float32 for e in errors)
  assert any(not np.array_equal(e[-1, 0], e[-1, 1]) for e in errors)
  # Error feedback's bookkeeping (shardopt.cross_shard_mean, the wire's
  # docstring): a sync delivers mean(outer gradient) + mean(error before) -
  # mean(error after), exactly but for float32 rounding. With tau = 1 the
  # sync of step t runs in call t + 1, so its errors are those after calls t
  # and t + 1; step 8's runs after the last call and moves no params here.
  # The reference (float64, the spec) with that wire gives the int4 run's
  # params to the float32 wire's tolerance; without it they differ.
  errors = _flat(state.error, (steps, R)).mean(axis=1)  # after every call

  def wire(t, f, mask, delta):
    if t >= steps:
      return delta
    return delta + errors[t - 1, mask] - errors[t, mask]

  ids = _fragment_ids(shapes, 2, {"blocks": 0, "embed": None, "head": None})
  reference = functools.partial(
    np_streaming_diloco,
    _flat(params0, ()),
    lambda p, t: p - _flat(targets, (steps, R))[t - 1],
    steps,
    np.concatenate([i.reshape(-1) for i in ids]),
    num_fragments=2,
    period=H,
    tau=1,
    alpha=0.5,
    lr=LR,
    outer_lr=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    replicas=R,
  )
  got, want = _flat(params, (steps, R)), _flat(exact[0], (steps, R))
  np.testing.assert_allclose(want, reference()[0], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(got, reference(wire=wire)[0], rtol=RTOL, atol=ATOL)
  assert np.abs(got - want).max() > 1e-3  # the int4 wire did drop something


def test_error_feedback_needs_a_quantized_outer_wire():
  with pytest.raises(ValueError, match=r"shardopt\.diloco.*error_feedback"):
    _diloco(2, comm_dtype=jnp.bfloat16, error_feedback=True)


def test_layer_axes_as_a_plain_dict_for_nnx_state_params():
  """Flax nnx hands its params as an ``nnx.State`` (a mapping that is not a
  dict): a plain-dict ``layer_axes`` is read along each leaf's key path."""
  nnx = pytest.importorskip("flax.nnx")
  params = nnx.State(
    {"blocks": {"w": jnp.zeros((4, 2))}, "embed": jnp.zeros(3)}
  )
  tx = _diloco(2, layer_axes={"blocks": 0, "embed": None})
  shapes = [x.shape for x in jax.tree.leaves(tx.init(params).global_state)]
  assert sorted(shapes) == [(2, 2), (2, 2), (3,)]
  with pytest.raises(ValueError, match="not a pytree prefix"):
    _diloco(2, layer_axes={"blocks": 0}).init(params)


# --------------------------------------------------------------------------
# torchft's schedule through sync_offset.


def _np_torchft(params0, targets, ids, num_fragments, delay, alpha):
  """torchft 0.2's Streaming DiLoCo (torchft/local_sgd.py, ``DiLoCo``) in
  float64 numpy, written from its step hook: a per-fragment counter
  ``local_step`` runs 1 .. H / F; at ``H / F - delay`` the fragment
  ``manager_step % F`` computes its outer gradient ``center - mean(params)``
  from the params after that step and starts the all-reduce; at ``H / F``
  it takes the outer Nesterov SGD step (torch's ``buf = m * buf + g; p -= lr
  * (g + m * buf)``) and merges ``params <- lerp(center, params, alpha)``,
  then ``manager_step += 1`` and ``local_step = 0``. Returns the params after
  every step, (steps, R, N)."""
  steps = len(jax.tree.leaves(targets)[0])
  y = _flat(targets, (steps, R))
  ids = np.concatenate([i.reshape(-1) for i in ids])
  center = _flat(params0, ()).copy()
  params = np.tile(center, (R, 1))
  buf = np.zeros_like(center)
  per_fragment = H // num_fragments
  local_step = manager_step = 0
  pending, out = None, []
  for t in range(1, steps + 1):
    params = params - LR * (params - y[t - 1])
    local_step += 1
    if local_step == per_fragment - delay:
      f = manager_step % num_fragments
      m = ids == f
      pending = (m, center[m] - params[:, m].mean(axis=0))
    if local_step == per_fragment:
      m, g = pending
      buf[m] = OUTER_MOMENTUM * buf[m] + g
      center[m] = center[m] - OUTER_LR * (g + OUTER_MOMENTUM * buf[m])
      params[:, m] = alpha * params[:, m] + (1 - alpha) * center[m]
      manager_step, local_step = manager_step + 1, 0
    out.append(params.copy())
  return np.stack(out)


@pytest.mark.parametrize(
  "num_fragments, delay, alpha",
  [(1, 0, 0.0), (2, 0, 0.0), (2, 1, 0.5), (4, 0, 0.5)],
)
def test_sync_offset_gives_torchfts_schedule(num_fragments, delay, alpha):
  """``sync_offset = H // F - fragment_sync_delay`` with ``overlap_steps =
  fragment_sync_delay`` runs torchft's schedule: its fragment i sends after
  step (i + 1) H / F - delay and merges at (i + 1) H / F (shardopt's default
  sends fragment f at f H / F, fragment 0 last)."""
  steps = 2 * H + 3
  params0 = _params0(LEAVES)
  targets = _targets(LEAVES, steps, seed=7 + delay)
  tx = _diloco(
    num_fragments,
    overlap_steps=delay,
    overlap_alpha=alpha,
    sync_offset=H // num_fragments - delay,
  )
  params, _ = _pmap_history(tx, params0, targets)
  ids = _fragment_ids(LEAVES, num_fragments)
  want = _np_torchft(params0, targets, ids, num_fragments, delay, alpha)
  got = _flat(params, (steps, R))
  for t in range(steps):
    np.testing.assert_allclose(
      got[t],
      want[t],
      rtol=RTOL,
      atol=ATOL,
      err_msg=f"params after step {t + 1}",
    )
  if num_fragments > 1:  # F = 1, no delay: the offset H is the same as 0.
    # Without the offset the schedules differ (the test can fail).
    plain = _diloco(num_fragments, overlap_steps=delay, overlap_alpha=alpha)
    other = _flat(_pmap_history(plain, params0, targets)[0], (steps, R))
    assert np.abs(other - want).max() > 1e-3


@pytest.mark.parametrize("bad", [-1, H + 1, 2.0, True, None])
def test_sync_offset_outside_the_period_is_named(bad):
  with pytest.raises(ValueError, match=r"shardopt.diloco: sync_offset="):
    _diloco(1, sync_offset=bad)
