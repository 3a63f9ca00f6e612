"""Sync schedules of the periodic engine: hierarchy, islands, fragments.

Every schedule is checked against a numpy float64 reference written here
(local SGD with momentum, direct group averaging, DiLoCo's Nesterov outer
step), plus the identities of design.md 6.4 (one level of the axis size is
``local_sgd``; one fragment is ``diloco``, bit for bit), the compiled HLO
(collectives only inside the switch's sync branches, within the right
groups, one round each, a fragment's bytes), mid-period checkpoints and the
argument checks. Run with ``pytest -s`` to see the numbers.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiled import non_sync_copied_bytes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo
from shardopt.periodic import fragments as _fragments

R = 8  # replicas
B = 4  # examples per replica per step
LR, MOMENTUM = 0.1, 0.5
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
# Leaves in jax.tree.leaves order: "b" (), "w1" (4,), "w2" (2,): 4, 16, 8 bytes.
SLICES = {"b": slice(0, 1), "w1": slice(1, 5), "w2": slice(5, 7)}
FLAT = 7


# --------------------------------------------------------------------------
# The model, its numpy gradient, trajectories under pmap.


def _loss(params, x, y):
  pred = x[:, :4] @ params["w1"] + x[:, 4:] @ params["w2"] + params["b"]
  return 0.5 * jnp.mean((pred - y) ** 2)


def _np_grad(p, x, y):
  """Gradient of _loss at flat params p (7,) = [b, w1, w2]."""
  xa = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
  return xa.T @ (xa @ p - y) / x.shape[0]


def _data(seed, steps, replicas=R):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps, replicas, B, 6)).astype(np.float32)
  y = rng.normal(size=(steps, replicas, B)).astype(np.float32)
  return x, y


def _p0():
  return {
    "b": np.float32(0.05),
    "w1": np.array([0.3, -0.2, 0.1, 0.0], np.float32),
    "w2": np.array([0.2, -0.1], np.float32),
  }


def _flat(tree):
  """Params with leading axes (..., leaf) -> (..., 7) float64."""
  return np.concatenate(
    [
      np.asarray(tree[k], np.float64).reshape(
        np.shape(tree[k])[: np.ndim(tree["b"])] + (-1,)
      )
      for k in SLICES
    ],
    axis=-1,
  )


def _stack(tree, n=R):
  return jax.tree.map(
    lambda p: jnp.broadcast_to(jnp.asarray(p), (n,) + np.shape(p)), tree
  )


def _scan_body(tx, grad_fn):
  def body(carry, batch):
    params, state = carry
    updates, state = tx.update(grad_fn(params, *batch), state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), (params, state)

  return body


def _pmap_trajectory(tx, x, y, params=None, state=None):
  """All steps in one pmap(scan); (params, state) per step, step axis first."""

  def run(params, state, x, y):
    return jax.lax.scan(
      _scan_body(tx, jax.grad(_loss)), (params, state), (x, y)
    )[1]

  params = _stack(_p0()) if params is None else params
  state = jax.pmap(tx.init)(params) if state is None else state
  history = jax.pmap(run, axis_name="batch")(
    params, state, x.swapaxes(0, 1), y.swapaxes(0, 1)
  )
  return jax.tree.map(lambda v: np.swapaxes(np.asarray(v), 0, 1), history)


def _at(tree, t):
  return jax.tree.map(lambda v: v[t], tree)


# --------------------------------------------------------------------------
# numpy references.


def _np_local_steps(p, m, x, y, t):
  """One step of local SGD with momentum on every replica."""
  g = np.stack([_np_grad(p[i], x[t, i], y[t, i]) for i in range(len(p))])
  m = g + MOMENTUM * m
  return p - LR * m, m


def _np_hierarchical(x, y, levels):
  """Direct averaging within contiguous groups; the largest period wins."""
  p = np.tile(_flat(_p0()), (R, 1))
  m = np.zeros_like(p)
  history = []
  for t in range(len(x)):
    p, m = _np_local_steps(p, m, x, y, t)
    due = [size for period, size in levels.items() if (t + 1) % period == 0]
    if due:
      size = due[-1]
      for g in range(0, R, size):
        p[g : g + size] = p[g : g + size].mean(0)
    history.append(p.copy())
  return history


def _np_streaming(x, y, sync_period, fragments):
  """Streaming DiLoCo: fragment f's outer Nesterov step after step t iff
  t % H == (f * H) // F; fragments are lists of leaf names."""
  p = np.tile(_flat(_p0()), (R, 1))
  m = np.zeros_like(p)
  center = _flat(_p0()).copy()
  outer_m = np.zeros_like(center)
  history = []
  for t in range(len(x)):
    p, m = _np_local_steps(p, m, x, y, t)
    for f, names in enumerate(fragments):
      if (t + 1) % sync_period != (f * sync_period) // len(fragments):
        continue
      idx = np.concatenate([np.arange(FLAT)[SLICES[k]] for k in names])
      delta = center[idx] - p[:, idx].mean(0)
      outer_m[idx] = OUTER_MOMENTUM * outer_m[idx] + delta
      center[idx] -= OUTER_LR * (delta + OUTER_MOMENTUM * outer_m[idx])
      p[:, idx] = center[idx]
    history.append((p.copy(), center.copy()))
  return history


def _local():
  return optax.sgd(LR, momentum=MOMENTUM)


def _diloco(sync_period, **kwargs):
  return shardopt.diloco(
    _local(),
    "batch",
    sync_period=sync_period,
    outer_learning_rate=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    **kwargs,
  )


# --------------------------------------------------------------------------
# Hierarchical local SGD.

LEVELS = {2: 2, 4: 4, 8: 8}


def test_hierarchical_2_4_8_matches_numpy_reference_on_8_replicas():
  tx = shardopt.hierarchical_local_sgd(
    _local(), "batch", period_group_sizes=LEVELS
  )
  x, y = _data(1, 16)
  params, state = _pmap_trajectory(tx, x, y)
  reference = _np_hierarchical(x, y, LEVELS)
  for t in range(len(x)):
    np.testing.assert_allclose(
      _flat(_at(params, t)),
      reference[t],
      rtol=2e-5,
      atol=2e-6,
      err_msg=f"params after step {t + 1}",
    )
  # Every level is hit: pairs after 2, 6, ...; fours after 4, 12; all after 8
  # (equal within one rounding: params + (average - params), see agn's snap).
  w = params["w1"]
  same = lambda a, b: np.allclose(a, b, rtol=1e-6, atol=1e-7)
  assert same(w[1][0], w[1][1]) and not same(w[1][1], w[1][2])
  assert same(w[3][0], w[3][3]) and not same(w[3][3], w[3][4])
  assert all(same(w[7][0], w[7][i]) for i in range(R))
  assert list(state.sync_count[:, 0]) == [(t + 1) // 2 for t in range(16)]
  # The center keeps the last sync's group average (what the params were
  # pulled onto): pairs after step 14, all 8 after step 16; identical bits
  # within each group.
  for t, size in ((13, 2), (15, 8)):
    center = _flat(_at(state.center, t))
    np.testing.assert_allclose(center, reference[t], rtol=2e-5, atol=2e-6)
    for g in range(0, R, size):
      assert (center[g : g + size] == center[g]).all(), (t, g)
  assert not (
    _flat(_at(state.center, 13))[1] == _flat(_at(state.center, 13))[2]
  ).all()
  assert state.global_state == ()
  print(
    f"hierarchical {LEVELS}: 16 steps match numpy; sync_count"
    f" {int(state.sync_count[-1, 0])}"
  )


def test_hierarchical_one_level_of_the_axis_size_is_local_sgd_to_a_few_ulp():
  x, y = _data(2, 9)
  hier, _ = _pmap_trajectory(
    shardopt.hierarchical_local_sgd(
      _local(), "batch", period_group_sizes={3: R}
    ),
    x,
    y,
  )
  local, _ = _pmap_trajectory(
    shardopt.local_sgd(_local(), "batch", sync_period=3), x, y
  )
  # In ulps of the largest param: direct vs center-based averaging round
  # differently, by a few ulps of the values being averaged.
  scale = np.spacing(np.float32(np.max(np.abs(_flat(local)))))
  ulp = np.max(np.abs(_flat(hier) - _flat(local))) / scale
  print(
    f"hierarchical {{3: {R}}} vs local_sgd(sync_period=3): max {ulp:.1f} ulp"
  )
  assert 0 < ulp <= 8


def test_hierarchical_groups_are_contiguous_and_collectives_stay_in_them():
  tx = shardopt.hierarchical_local_sgd(
    _local(), "batch", period_group_sizes={2: 2, 4: 4}
  )
  params = _stack(_p0())
  x, y = _data(3, 1)
  step = jax.pmap(
    lambda p, s, x, y: tx.update(jax.grad(_loss)(p, x, y), s, p),
    axis_name="batch",
  )
  text = (
    step.lower(params, jax.pmap(tx.init)(params), x[0], y[0])
    .compile()
    .as_text()
  )
  assert not [
    op for op in hlo.compiled_collectives(text) if op.context == "top"
  ]
  conds = hlo.branch_collectives(text, outermost=True)
  sizes = [[sorted({op.group_size for op in b}) for b in c] for c in conds]
  print(f"hierarchical {{2: 2, 4: 4}}: group sizes per cond branch {sizes}")
  # One cond per level (false branch: no sync), nothing else.
  assert sizes == [[[], [2]], [[], [4]]]
  groups = re.findall(r"all-reduce\(.*?replica_groups=(\{\{[\d,{}]*\}\})", text)
  assert "{{0,1},{2,3},{4,5},{6,7}}" in groups
  assert "{{0,1,2,3},{4,5,6,7}}" in groups


def test_hierarchical_leaves_a_non_finite_replica_out_of_its_group_only():
  tx = shardopt.hierarchical_local_sgd(
    optax.sgd(1.0), "batch", period_group_sizes={1: 4}
  )
  grads = -np.tile(np.arange(R, dtype=np.float32)[:, None], (1, 2))
  grads[5, 1] = np.nan
  step = jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name="batch")
  params = jnp.zeros((R, 2))
  updates, state = step(params, jax.pmap(tx.init)(params), grads)
  np.testing.assert_array_equal(np.asarray(updates)[:4], 1.5)  # mean(0..3)
  np.testing.assert_allclose(np.asarray(updates)[4:], 17 / 3)  # mean(4, 6, 7)
  # The skip counter is per group: 1 in the second group, 0 in the first.
  assert list(np.asarray(state.skipped)) == [0] * 4 + [1] * 4


@pytest.mark.parametrize(
  "value, match",
  [
    ({}, "non-empty dict"),
    ([(2, 2)], "non-empty dict"),
    ({0: 2}, "period 0"),
    ({2: 2.0}, "group size 2.0"),
    ({2: True}, "group size True"),
    ({4: 4, 2: 2}, "strictly increasing in the order given"),
    ({2: 4, 4: 4}, "2: 4 is followed by 4: 4"),
  ],
)
def test_hierarchical_period_group_sizes_are_checked_when_built(value, match):
  with pytest.raises(
    ValueError, match="shardopt.hierarchical_local_sgd: period_group_sizes="
  ) as info:
    shardopt.hierarchical_local_sgd(
      optax.sgd(0.1), "batch", period_group_sizes=value
    )
  assert re.search(match, str(info.value)), str(info.value)


def test_hierarchical_group_size_must_divide_the_axis_size():
  tx = shardopt.hierarchical_local_sgd(
    optax.sgd(0.1), "batch", period_group_sizes={2: 3}
  )
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  params = jnp.zeros((R, 2))
  with pytest.raises(
    ValueError,
    match=r"group size 3 does not divide the size"
    r" 8 of axis 'batch'.*\[1, 2, 4, 8\]",
  ):
    step(params, jax.pmap(tx.init)(params))


# --------------------------------------------------------------------------
# Streaming DiLoCo.


def test_fragments_are_contiguous_and_balanced_by_bytes():
  split = _fragments.split_fragments
  assert split([4, 16, 8], 2) == ((0, 1), (2,))
  assert split([4, 16, 8], 3) == ((0,), (1,), (2,))
  assert split([10] * 8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert split([100, 1, 1, 1], 3) == ((0,), (1,), (2, 3))
  assert split([5], 1) == ((0,),)


@pytest.mark.parametrize(
  "num_fragments, fragments",
  [
    (2, [["b", "w1"], ["w2"]]),
    (3, [["b"], ["w1"], ["w2"]]),
  ],
)
def test_streaming_diloco_matches_numpy_reference(num_fragments, fragments):
  sync_period = 6
  tx = _diloco(sync_period, num_fragments=num_fragments)
  x, y = _data(4 + num_fragments, 13)
  params, state = _pmap_trajectory(tx, x, y)
  reference = _np_streaming(x, y, sync_period, fragments)
  for t in range(len(x)):
    np.testing.assert_allclose(
      _flat(_at(params, t)),
      reference[t][0],
      rtol=1e-5,
      atol=1e-6,
      err_msg=f"params after step {t + 1}",
    )
    np.testing.assert_allclose(
      _flat(_at(state.center, t))[0],
      reference[t][1],
      rtol=1e-5,
      atol=1e-6,
      err_msg=f"center after step {t + 1}",
    )
  # One outer momentum per fragment, over the list of its leaves.
  assert len(state.global_state) == num_fragments
  assert int(state.sync_count[-1, 0]) == sum(
    1
    for t in range(1, 14)
    for f in range(num_fragments)
    if t % sync_period == (f * sync_period) // num_fragments
  )
  print(
    f"streaming diloco F={num_fragments}, H={sync_period}: 13 steps match"
    f" numpy, {int(state.sync_count[-1, 0])} fragment syncs"
  )


def test_one_fragment_is_diloco_bit_for_bit():
  x, y = _data(8, 7)
  one = _pmap_trajectory(_diloco(3, num_fragments=1), x, y)
  plain = _pmap_trajectory(_diloco(3), x, y)
  chex.assert_trees_all_equal(one, plain)


def test_each_fragment_sync_all_reduces_only_its_fragment():
  """The peak bytes of a branch are the fragment's bytes (plus the 4-byte
  finite flag): at most 1/F of the params plus the split's imbalance."""
  sizes = {"a": (96,), "b": (64,), "c": (32,), "d": (32,), "e": (32,)}
  params = {k: jnp.zeros((R,) + s) for k, s in sizes.items()}
  total = 4 * sum(np.prod(s) for s in sizes.values())
  largest = 4 * max(np.prod(s) for s in sizes.values())
  for num_fragments in (1, 2, 4):
    tx = shardopt.diloco(
      optax.adam(0.1), "batch", sync_period=8, num_fragments=num_fragments
    )
    step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
    text = step.lower(params, jax.pmap(tx.init)(params)).compile().as_text()
    assert not [
      op for op in hlo.compiled_collectives(text) if op.context == "top"
    ]
    conds = hlo.branch_collectives(text, outermost=True)
    # One cond per fragment, nothing else.
    assert len(conds) == num_fragments
    assert all(c[0] == [] for c in conds)
    branches = [c[1] for c in conds]
    per_branch = [sum(op.buffer_bytes for op in b) for b in branches]
    fragments = _fragments.split_fragments(
      [4 * np.prod(s) for s in sizes.values()], num_fragments
    )
    expected = [
      4 * sum(np.prod(list(sizes.values())[i]) for i in f) + 4
      for f in fragments
    ]
    print(
      f"F={num_fragments}: bytes per sync branch {per_branch} of"
      f" {total} param bytes"
    )
    assert per_branch == expected
    assert max(per_branch) <= total / num_fragments + largest + 4
    for ops in branches:  # one round: all over the same (whole) axis
      assert {op.group_size for op in ops} <= {0, R}


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"num_fragments": 0}, "num_fragments=0"),
    ({"num_fragments": True}, "num_fragments=True"),
    ({"num_fragments": 2.0}, "num_fragments=2.0"),
    (
      {"num_fragments": 5, "sync_period": 4},
      "num_fragments=5 .* <= sync_period=4",
    ),
  ],
)
def test_num_fragments_is_checked_when_built(kwargs, match):
  with pytest.raises(ValueError, match=f"shardopt.diloco: {match}"):
    shardopt.diloco(optax.sgd(0.1), "batch", **kwargs)


def test_more_fragments_than_leaves_is_a_clear_error():
  tx = shardopt.diloco(optax.sgd(0.1), "batch", sync_period=8, num_fragments=4)
  with pytest.raises(
    ValueError,
    match=r"shardopt.diloco: num_fragments=4 but"
    r" the params have only 3 leaves.*num_fragments <= 3",
  ):
    tx.init(_p0())


# --------------------------------------------------------------------------
# Checkpoints mid-period / mid-fragment.


@pytest.mark.parametrize(
  "make",
  [
    lambda: shardopt.hierarchical_local_sgd(
      _local(), "batch", period_group_sizes={2: 2, 4: 8}
    ),
    lambda: _diloco(4, num_fragments=3),
    lambda: shardopt.agn(optax.adam(0.05), "batch", sync_period=4),
  ],
  ids=["hierarchical", "streaming", "agn"],
)
def test_checkpoint_mid_period_restores_bit_identically(make):
  tx = make()
  x, y = _data(9, 10)
  full = _pmap_trajectory(tx, x, y)
  first = _pmap_trajectory(tx, x[:5], y[:5])
  saved = jax.tree.map(lambda v: np.asarray(v[-1]), first)  # after step 5
  assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(saved))
  params, state = jax.tree.map(jnp.asarray, saved)
  rest = _pmap_trajectory(tx, x[5:], y[5:], params=params, state=state)
  chex.assert_trees_all_equal(_at(rest, -1), _at(full, -1))


# --------------------------------------------------------------------------
# Islands: DiLoCo across islands, data parallel within each.

ISLANDS, DATA = 2, 4


def _np_islands(x, y, sync_period, *, method):
  """x (steps, islands, data, B, 6): synchronous SGD within each island on
  the mean gradient, then DiLoCo / local SGD / AGN-style sync across islands."""
  p = np.tile(_flat(_p0()), (ISLANDS, 1))
  center = _flat(_p0()).copy()
  outer_m = np.zeros_like(center)
  acc = np.zeros_like(p)
  history = []
  for t in range(len(x)):
    g = np.stack(
      [
        np.mean(
          [_np_grad(p[i], x[t, i, j], y[t, i, j]) for j in range(DATA)], 0
        )
        for i in range(ISLANDS)
      ]
    )
    p = p - LR * g
    acc += g
    if (t + 1) % sync_period == 0:
      if method == "diloco":
        delta = center - p.mean(0)
        outer_m = OUTER_MOMENTUM * outer_m + delta
        center = center - OUTER_LR * (delta + OUTER_MOMENTUM * outer_m)
      elif method == "local_sgd":
        center = p.mean(0)
      else:  # agn with global sgd(LR)
        center = center - LR * (acc / sync_period).mean(0)
        acc[:] = 0
      p = np.tile(center, (ISLANDS, 1))
    history.append(p.copy())
  return history


def _island_tx(method, sync_period):
  inner = shardopt.cross_shard(optax.sgd(LR), "data")
  if method == "diloco":
    return shardopt.diloco(
      inner,
      "island",
      sync_period=sync_period,
      outer_learning_rate=OUTER_LR,
      outer_momentum=OUTER_MOMENTUM,
    )
  if method == "local_sgd":
    return shardopt.local_sgd(inner, "island", sync_period=sync_period)
  # agn accumulates the gradients it is given: reduce them over "data" first,
  # so that every data replica of an island accumulates the island's mean.
  return optax.chain(
    shardopt.cross_shard_mean("data"),
    shardopt.agn(
      optax.sgd(LR),
      "island",
      sync_period=sync_period,
      global_optimizer=optax.sgd(LR),
    ),
  )


def _island_run(tx, x, y, *, varying_over_data):
  """shard_map over ("island", "data"): params P("island") (replicated over
  "data") or P("island", "data"); returns (params per step, compiled HLO)."""
  mesh = jax.make_mesh((ISLANDS, DATA), ("island", "data"))
  spec = P("island", "data") if varying_over_data else P("island")
  lead = (ISLANDS, DATA) if varying_over_data else (ISLANDS,)
  params = jax.tree.map(lambda p: np.broadcast_to(p, lead + np.shape(p)), _p0())
  state_specs = jax.tree.map(
    lambda v: P() if np.ndim(v) == 0 else spec,
    jax.eval_shape(
      tx.init,
      jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
          (1,) * len(lead) + np.shape(p), np.float32
        ),
        _p0(),
      ),
    ),
  )

  def squeeze(tree):
    return jax.tree.map(lambda v: v.reshape(v.shape[len(lead) :]), tree)

  def grad_fn(params, x, y):  # x: (1, 1, B, 6) on each device
    grads = jax.grad(lambda p: _loss(squeeze(p), x[0, 0], y[0, 0]))(params)
    return grads

  def run(params, x, y):
    state = tx.init(params)
    _, history = jax.lax.scan(_scan_body(tx, grad_fn), (params, state), (x, y))
    return history[0]

  data = P(None, "island", "data")
  run = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(spec, data, data),
      out_specs=jax.tree.map(lambda s: P(None, *s), spec),
    )
  )
  put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
  args = (put(params, spec), put(x, data), put(y, data))
  history = run(*args)
  del state_specs
  return jax.tree.map(np.asarray, history), run.lower(*args).compile().as_text()


@pytest.mark.parametrize(
  "varying_over_data", [False, True], ids=["P(island)", "P(island,data)"]
)
@pytest.mark.parametrize("method", ["diloco", "local_sgd", "agn"])
def test_islands_match_numpy_reference_under_shard_map(
  method, varying_over_data
):
  sync_period = 3
  x, y = _data(20, 7, replicas=ISLANDS * DATA)
  x = x.reshape(7, ISLANDS, DATA, B, 6)
  y = y.reshape(7, ISLANDS, DATA, B)
  history, text = _island_run(
    _island_tx(method, sync_period), x, y, varying_over_data=varying_over_data
  )
  reference = _np_islands(x, y, sync_period, method=method)
  for t in range(7):
    got = _flat(_at(history, t))
    if varying_over_data:  # every data replica of an island holds the same
      for j in range(DATA):
        np.testing.assert_array_equal(got[:, j], got[:, 0])
      got = got[:, 0]
    np.testing.assert_allclose(
      got,
      reference[t],
      rtol=1e-5,
      atol=1e-6,
      err_msg=f"{method} after step {t + 1}",
    )
  ops = hlo.compiled_collectives(text)
  outside = {
    (op.kind, op.group_size) for op in ops if "conditional" not in op.context
  }
  inside = {
    (op.kind, op.group_size) for op in ops if "conditional" in op.context
  }
  print(
    f"islands {method}, params varying over data={varying_over_data}:"
    f" every step {sorted(outside)}, sync branch {sorted(inside)}"
  )
  # Every step: the inner all-reduce over "data" (groups of 4) at most.
  assert {size for _, size in outside} <= {DATA}
  # The sync: over "island" (groups of 2) only.
  assert inside and {size for _, size in inside} == {ISLANDS}


# --------------------------------------------------------------------------
# Counters: one number per replica, replicated by construction, any typing.


def _shard_map_steps(tx, mesh, steps, *, whole_state_p_axis):
  """Runs agn-like ``tx`` for ``steps`` under shard_map, state passed either
  as P() counters + P(axis) arrays or as a stacked whole state under P(axis)."""
  params = _stack(_p0())
  x, y = _data(30, steps)
  rows = NamedSharding(mesh, P("batch"))
  if whole_state_p_axis:
    state = jax.vmap(tx.init)(params)  # counters of shape (8,)
    specs = jax.tree.map(lambda _: P("batch"), state)
  else:
    state = jax.pmap(tx.init)(params)
    specs = jax.tree.map(lambda _: P("batch"), state)._replace(
      count=P(), sync_count=P(), skipped=P()
    )
    state = state._replace(
      count=state.count[0],
      skipped=state.skipped[0],
      sync_count=state.sync_count[0],
    )

  def step(params, state, x, y):
    grads = jax.vmap(jax.grad(_loss))(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P("batch"), specs, P("batch"), P("batch")),
      out_specs=(P("batch"), specs),
    )
  )
  params = jax.device_put(params, rows)
  state = jax.device_put(
    state,
    jax.tree.map(
      lambda s: NamedSharding(mesh, s),
      specs,
      is_leaf=lambda s: isinstance(s, P),
    ),
  )
  for t in range(steps):
    params, state = jax.block_until_ready(
      step(params, state, *(jax.device_put(v[t], rows) for v in (x, y)))
    )
  return jax.tree.map(np.asarray, (params, state))


@pytest.mark.parametrize(
  "make",
  [
    lambda: shardopt.agn(_local(), "batch", sync_period=3),
    lambda: _diloco(3, num_fragments=2),
    lambda: shardopt.hierarchical_local_sgd(
      _local(), "batch", period_group_sizes={2: 2, 3: 8}
    ),
  ],
  ids=["agn", "streaming", "hierarchical"],
)
def test_whole_state_under_p_axis_with_stacked_counters_matches_pmap(
  mesh, make
):
  """The spelling everyone writes first: every state leaf P(axis), counters
  included (issue 10 item 4)."""
  tx = make()
  params, state = _shard_map_steps(tx, mesh, 6, whole_state_p_axis=True)
  x, y = _data(30, 6)
  want_params, want_state = _at(_pmap_trajectory(tx, x, y), -1)
  assert state.count.shape == (R,) and np.all(state.count == 6)
  np.testing.assert_array_equal(state.sync_count, want_state.sync_count)
  np.testing.assert_allclose(
    _flat(params), _flat(want_params), rtol=1e-6, atol=1e-7
  )


def test_p_unit_counters_still_work_under_shard_map(mesh):
  tx = shardopt.agn(_local(), "batch", sync_period=3)
  params, state = _shard_map_steps(tx, mesh, 6, whole_state_p_axis=False)
  x, y = _data(30, 6)
  want_params, _ = _at(_pmap_trajectory(tx, x, y), -1)
  assert state.count.shape == () and int(state.sync_count) == 2
  np.testing.assert_allclose(
    _flat(params), _flat(want_params), rtol=1e-6, atol=1e-7
  )


def test_a_counter_typed_varying_is_accepted(mesh):
  tx = shardopt.agn(optax.sgd(0.1), "batch", sync_period=1)

  def step(w):
    state = tx.init(w)
    state = state._replace(
      count=jax.lax.pcast(state.count, "batch", to="varying")
    )
    return tx.update(w, state, w)[0]

  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
  )
  w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("batch")))
  # The sync after step 1: center_i = w_i - 0.1 * mean(w) (the center was
  # built from varying params), so the updates are -0.35 everywhere.
  np.testing.assert_allclose(np.asarray(f(w)), -0.35, rtol=1e-6)


def test_a_counter_with_several_elements_names_the_specs():
  tx = shardopt.agn(optax.sgd(0.1), "batch")
  params = jnp.zeros((R, 2))
  state = jax.pmap(tx.init)(params)
  state = state._replace(count=jnp.zeros((R, 2), jnp.int32))
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  with pytest.raises(
    ValueError,
    match=r"shardopt.agn: state.count has shape"
    r" \(2,\).*spec P\(\).*P\('batch'\).*jax.vmap\(tx.init\)",
  ):
    step(params, state)


# --------------------------------------------------------------------------
# A step that does not synchronise copies only what a sync may change.


def test_a_non_sync_step_copies_nothing_once_its_state_is_donated():
  """A step without a sync communicates nothing and, with the state donated
  (what a training loop does), copies no more than plain optax's step. Not
  donated, XLA must copy into fresh output buffers what the step leaves as
  it is: the center and the global optimizer's state (at most)."""
  sizes, big = (16, 32, 8), 10**6
  tree = 4 * (16 * 32 + 32 + 32 * 8 + 8)  # bytes of the params
  plain = optax.adam(1e-3)
  # Param-shaped trees the step leaves unchanged: local_sgd the center;
  # diloco the center and the outer momentum; agn the center and the global
  # Adam's two moments; hierarchical the center (its last group average).
  cases = {
    "plain adam": (plain, 0),
    "local_sgd(adam)": (shardopt.local_sgd(plain, "batch", sync_period=big), 1),
    "diloco(adam)": (shardopt.diloco(plain, "batch", sync_period=big), 2),
    "agn(adam)": (shardopt.agn(plain, "batch", sync_period=big), 3),
    "streaming diloco(adam)": (
      shardopt.diloco(plain, "batch", sync_period=big, num_fragments=4),
      2,
    ),
    # Every leaf's last axis as its "layers": each fragment is a strided
    # piece of every leaf, read and written in place inside its cond.
    "streaming diloco(adam) over layers": (
      shardopt.diloco(
        plain, "batch", sync_period=big, num_fragments=4, layer_axes=-1
      ),
      None,
    ),
    "streaming diloco(adam) with overlap": (
      shardopt.diloco(
        plain,
        "batch",
        sync_period=big,
        num_fragments=4,
        overlap_steps=1,
        overlap_alpha=0.5,
      ),
      None,
    ),
    # Past a warm-up: its two conds (the mean gradient, the center's copy)
    # hand their operands back untouched.
    "diloco(adam) after a warm-up": (
      shardopt.diloco(plain, "batch", sync_period=big, warmup_steps=3),
      None,
    ),
    "agn(adam) after a warm-up": (
      shardopt.agn(plain, "batch", sync_period=big, warmup_steps=3),
      None,
    ),
    "hierarchical_local_sgd(adam)": (
      shardopt.hierarchical_local_sgd(
        plain, "batch", period_group_sizes={big: 2, 2 * big: 8}
      ),
      1,
    ),
  }
  donated, kept = {}, {}
  # The variants (None) are checked donated only: not donated, they copy
  # what their base transform copies (compiled twice per case, the test's
  # cost).
  for name, (tx, trees) in cases.items():
    donated[name] = non_sync_copied_bytes(tx, sizes, donate=True)
    if trees is not None:
      kept[name] = non_sync_copied_bytes(tx, sizes, donate=False)
  print(
    f"bytes copied by a non-sync step ({tree} B of params): donated"
    f" {donated}, not donated {kept}"
  )
  for name, (_, trees) in cases.items():
    # Scalars (counters, the finite flag) may be copied: a few bytes.
    assert donated[name] <= donated["plain adam"] + 64, (name, donated)
    if trees is not None:
      assert kept[name] <= trees * tree + 64, (name, kept)


def _params_shaped_cond_outputs(tx, axis_env) -> list[int]:
  """For each top-level ``cond`` of ``tx.update``'s jaxpr, how many of its
  outputs have the shape of a params leaf (params of distinct shapes)."""
  params = {"w": jnp.ones((6, 3)), "b": jnp.ones((3,))}
  shapes = {tuple(p.shape) for p in jax.tree.leaves(params)}
  jaxpr = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p), axis_env=axis_env)(
    params, tx.init(params), params
  )
  return [
    sum(tuple(v.aval.shape) in shapes for v in eqn.outvars)
    for eqn in jaxpr.jaxpr.eqns
    if eqn.primitive.name == "cond"
  ]


def test_a_sync_cond_returns_only_what_the_sync_changes():
  """The conds hand back the center and the global state (what a sync
  moves), not this step's updates: XLA does not fuse across a conditional,
  so updates handed through one are written out and read back by
  apply_updates. The sync branch recomputes them instead, except when the
  local optimizer communicates (cross_shard over "data" inside an island
  sync), where recomputing would run the inner all-reduce twice."""
  batch = [("batch", R)]
  islands = [("island", ISLANDS), ("data", DATA)]
  adam = optax.adam(1e-3)
  big = 10**6
  # Per cond: the params-shaped trees a sync changes times the leaves the
  # cond owns (2, or 1 per fragment): local_sgd the center; diloco the center
  # and the outer momentum; agn the center, the accumulator and the global
  # Adam's two moments; hierarchical the center (one cond per level).
  # A communicating local optimizer hands its updates through (+1 tree).
  inner = shardopt.cross_shard(adam, "data")
  cases = {
    # name: (tx, axis_env, params-shaped outputs of each cond)
    "local_sgd": (shardopt.local_sgd(adam, "batch", sync_period=3), batch, [2]),
    "diloco": (shardopt.diloco(adam, "batch", sync_period=3), batch, [4]),
    "agn": (shardopt.agn(adam, "batch", sync_period=3), batch, [8]),
    "hierarchical": (
      shardopt.hierarchical_local_sgd(
        adam, "batch", period_group_sizes={2: 2, big: 8}
      ),
      batch,
      [2, 2],
    ),
    "streaming": (
      shardopt.diloco(adam, "batch", sync_period=4, num_fragments=2),
      batch,
      [2, 2],
    ),
    "diloco(cross_shard) islands": (
      shardopt.diloco(inner, "island", sync_period=3),
      islands,
      [3 * 2],
    ),
  }
  found = {}
  for name, (tx, env, expected) in cases.items():
    found[name] = _params_shaped_cond_outputs(tx, env)
    assert found[name] == expected, (name, found[name])
  print(f"params-shaped outputs of each sync cond: {found}")


def test_streaming_leaves_a_non_finite_replica_out_of_its_fragment_sync():
  """NaN on one replica in fragment 1's leaf: that fragment's sync averages
  the other 7 replicas, the center stays bit-identical on every replica and
  finite, and the other fragment is untouched by the fault."""
  tx = shardopt.diloco(
    optax.sgd(1.0),
    "batch",
    sync_period=2,
    num_fragments=2,
    outer_learning_rate=1.0,
    outer_momentum=0.0,
  )
  params = {"a": jnp.zeros((R, 3)), "b": jnp.zeros((R, 3))}
  step = jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name="batch")
  state = jax.pmap(tx.init)(params)
  moves = -np.tile(np.arange(R, dtype=np.float32)[:, None], (1, 3))
  grads = {"a": moves, "b": moves.copy()}
  grads["b"][5, 0] = np.nan  # fragment 1 ("b") syncs after step 1
  updates, state = jax.block_until_ready(step(params, state, grads))
  params = jax.tree.map(lambda p, u: p + u, params, updates)
  center_b = np.asarray(state.center["b"])
  finite = [i for i in range(R) if i != 5]
  np.testing.assert_allclose(center_b, np.mean(finite))  # replica i moved i
  assert (center_b == center_b[0]).all() and np.isfinite(center_b).all()
  assert int(np.asarray(state.skipped)[0]) == 1
  np.testing.assert_array_equal(np.asarray(state.center["a"]), 0.0)
  # Step 2: fragment 0 ("a") syncs with every replica (all finite).
  updates, state = jax.block_until_ready(
    step(params, state, {"a": moves, "b": moves})
  )
  np.testing.assert_allclose(
    np.asarray(state.center["a"]), 2 * np.mean(range(R))
  )
  np.testing.assert_allclose(np.asarray(state.center["b"]), center_b)
