"""Hostile input for the new transforms, property-based (hypothesis).

* ``shardopt.accumulate`` equals ``optax.MultiSteps`` (the contract's
  reference) for random ``every_k_steps``, trees, dtypes (float32, bfloat16),
  inner optimizers and both ``use_grad_mean``.
* ``shardopt.apply_if_finite`` under random NaN/±inf patterns over replicas
  and steps, under ``pmap`` and a checking ``shard_map``: every replica takes
  the same branch (the whole state bit-identical on every replica after every
  step), the params equal a numpy run that skips the same steps, and
  ``notfinite_count``/``total_notfinite``/``last_finite`` equal numpy's
  bookkeeping with optax's ``max_consecutive_errors`` rule (a run of more than
  ``max_consecutive_errors`` non-finite steps applies the next one).
* Every bad argument of ``accumulate``, ``apply_if_finite`` and
  ``all_finite`` raises a clear error when the transform is built or while
  tracing (``lower`` raises it, so no collective ran), and the caller's
  donated params, state and gradients are neither consumed nor changed.
* ``powersgd`` at full rank is the mean and its error feedback sums to what
  was not sent; ``hierarchical_local_sgd`` and ``diloco(num_fragments=F)``
  equal numpy references for random schedules; invalid schedules are
  rejected.

The sizes below are the ``ci`` profile's (``make test``); ``make fuzz`` runs
this file under ``thorough`` (at least 500 examples each). See
``tests/_hypothesis_profiles.py``. Run with ``pytest -s`` to see the figures.
"""

from __future__ import annotations

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
from _properties import pytrees
from _properties import report
from _properties import settings
from _properties import stateless
from hypothesis import assume
from hypothesis import example
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

LOW_PRECISION_OK = [jnp.float32, jnp.bfloat16]


def _ulps(got, want, dtype):
  """Largest |got - want| in units of dtype's eps times max(1, |want|)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.size == 0:
    return 0.0
  eps = float(jnp.finfo(dtype).eps)
  return float(
    np.max(np.abs(got - want) / (eps * np.maximum(1.0, np.abs(want))))
  )


# --- accumulate == optax.MultiSteps. -------------------------------------------

ACC_INNERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(0.05),
}
_ACC_RUNS = {}


def _accumulate_vs_multisteps(k, mean, inner):
  """jit(scan) of 2k+1 steps of accumulate and MultiSteps on the same grads.

  One jitted function per (k, mean, inner); jax retraces it per tree.
  """
  key = (k, mean, inner)
  if key not in _ACC_RUNS:
    tx = shardopt.accumulate(ACC_INNERS[inner](), k, use_grad_mean=mean)
    ref = optax.MultiSteps(
      ACC_INNERS[inner](), k, use_grad_mean=mean
    ).gradient_transformation()

    def run(params, grads_seq):
      def step(carry, grads):
        state, ref_state = carry
        updates, state = tx.update(grads, state, params)
        want, ref_state = ref.update(grads, ref_state, params)
        return (state, ref_state), (updates, want, state, ref_state)

      return jax.lax.scan(step, (tx.init(params), ref.init(params)), grads_seq)[
        1
      ]

    _ACC_RUNS[key] = jax.jit(run)
  return _ACC_RUNS[key]


def test_accumulate_equals_optax_multisteps_for_random_k_trees_and_dtypes():
  tried, worst = [], {}

  @settings(12)
  @given(
    k=st.integers(1, 5),
    mean=st.booleans(),
    inner=st.sampled_from(sorted(ACC_INNERS)),
    tree=pytrees(dtypes=LOW_PRECISION_OK),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
  )
  # Found by the thorough run: momentum, summed, 1.08 eps apart (XLA fuses
  # the two programs' multiply-adds differently; not bit-identical).
  @example(
    k=2,
    mean=False,
    inner="momentum",
    tree=("dict", [((), jnp.float32)]),
    scale=100.0,
    seed=2,
  )
  def check(k, mean, inner, tree, scale, seed):
    # float16 is left out: optax.MultiSteps with an f16 adam inner returns
    # NaN on mini-steps (its masked inner update overflows), which is
    # optax's behaviour, not a reference.
    kind, specs = tree
    rng = np.random.default_rng(seed)
    steps = 2 * k + 1
    params = build_tree(
      kind, [jnp.asarray(rng.normal(size=s), d) for s, d in specs]
    )
    grads_seq = build_tree(
      kind,
      [jnp.asarray(scale * rng.normal(size=(steps,) + s), d) for s, d in specs],
    )
    updates, want, state, ref_state = jax.tree.map(
      np.asarray, _accumulate_vs_multisteps(k, mean, inner)(params, grads_seq)
    )
    for t in range(steps):
      emit = (t + 1) % k == 0
      assert (
        int(state.mini_step[t]) == int(ref_state.mini_step[t]) == ((t + 1) % k)
      )
      assert (
        int(state.gradient_step[t])
        == int(ref_state.gradient_step[t])
        == (t + 1) // k
      )
      for (_, dtype), u, w, a, ra in zip(
        specs,
        jax.tree.leaves(updates),
        jax.tree.leaves(want),
        jax.tree.leaves(state.acc_grads),
        jax.tree.leaves(ref_state.acc_grads),
      ):
        assert u.dtype == w.dtype == np.dtype(dtype)
        if not emit:  # a mini-step: exactly zero on both
          assert not np.any(u[t]) and not np.any(w[t])
          # the running mean/sum, in float32 (f32 accumulation of bf16)
          worst["acc"] = max(
            worst.get("acc", 0.0), _ulps(a[t], ra[t], jnp.float32)
          )
        worst[inner] = max(worst.get(inner, 0.0), _ulps(u[t], w[t], dtype))
    # The same operations as optax, but XLA may fuse (and contract into
    # FMAs) the two programs differently: a few ulp of float32 before the
    # cast to the gradients' dtype.
    for name, ulps in worst.items():
      assert ulps <= 4.0, (name, ulps)
    for x, y in zip(
      jax.tree.leaves(state.inner_state),
      jax.tree.leaves(ref_state.inner_opt_state),
    ):
      np.testing.assert_allclose(
        np.asarray(x, np.float64),
        np.asarray(y, np.float64),
        rtol=1e-5,
        atol=1e-6 * scale,
      )
    tried.append((k, mean, inner, tuple(np.dtype(d).name for _, d in specs)))

  check()
  report(
    "accumulate == optax.MultiSteps",
    len(tried),
    f" (k {sorted({t[0] for t in tried})}; use_grad_mean both:"
    f" {len({t[1] for t in tried}) == 2}; inners"
    f" {sorted({t[2] for t in tried})}; dtypes"
    f" {sorted({d for t in tried for d in t[3]})}); largest difference"
    f" in eps: { ({n: round(u, 2) for n, u in sorted(worst.items())}) }",
  )


# --- apply_if_finite under random NaN/inf patterns. -----------------------------

FAULT_STEPS = 12
LR, MOMENTUM, FAULT_K = 0.1, 0.9, 2
# A few fixed float32 trees: the NaN/inf patterns are what is drawn at random,
# and a fixed set keeps the number of compiled programs small.
FAULT_TREES = {
  "dict": ("dict", [(2, 3), ()]),
  "list": ("list", [(4,)]),
  "nested": ("nested", [(3,), (2, 2), (1,)]),
}
FAULT_INNERS = {
  "cross_shard(sgd)": lambda: shardopt.cross_shard(optax.sgd(LR), AXIS),
  "cross_shard(momentum)": lambda: shardopt.cross_shard(
    optax.sgd(LR, momentum=MOMENTUM), AXIS
  ),
  "tower(momentum)": lambda: shardopt.tower(
    optax.sgd(LR, momentum=MOMENTUM), AXIS
  ),
  "chain(cross_shard_mean, sgd)": lambda: optax.chain(
    shardopt.cross_shard_mean(AXIS), optax.sgd(LR)
  ),
  f"accumulate(cross_shard(momentum), {FAULT_K})": lambda: shardopt.accumulate(
    shardopt.cross_shard(optax.sgd(LR, momentum=MOMENTUM), AXIS), FAULT_K
  ),
}
_FAULT_RUNS = {}


def _guarded_run(mapping, inner, max_consecutive):
  """One jitted program: FAULT_STEPS guarded steps, every step's output kept.

  ``run(params, state, grads_seq)``: params and state stacked over the R
  replicas, grads_seq leaves ``(FAULT_STEPS, R, ...)``; returns the params
  and the state after every step, ``(FAULT_STEPS, R, ...)``, and each step's
  ``replica_divergence`` of (params, state).
  """
  key = (mapping, inner, max_consecutive)
  if key in _FAULT_RUNS:
    return _FAULT_RUNS[key]
  tx = shardopt.apply_if_finite(
    FAULT_INNERS[inner](), max_consecutive, axis_name=AXIS
  )

  def steps(params, state, grads_seq):
    def step(carry, grads):
      params, state = carry
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      divergence = shardopt.replica_divergence(
        (params, _replicated(inner, state)), AXIS
      )
      divergence = divergence.reshape((1,) if mapping == "shard_map" else ())
      return (params, state), (params, state, divergence)

    return jax.lax.scan(step, (params, state), grads_seq)[1]

  if mapping == "pmap":
    init = jax.pmap(tx.init, axis_name=AXIS)
    run = jax.pmap(steps, axis_name=AXIS, in_axes=(0, 0, 1), out_axes=1)
  else:  # a checking shard_map, the whole state stacked under P(AXIS)
    mesh = jax.make_mesh((R,), (AXIS,))
    init = jax.pmap(tx.init, axis_name=AXIS)
    row, steps_row = P(AXIS), P(None, AXIS)
    mapped = jax.jit(
      jax.shard_map(
        steps, mesh=mesh, in_specs=(row, row, steps_row), out_specs=steps_row
      )
    )

    def run(params, state, grads_seq):
      put = lambda tree, spec: jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree
      )
      out = mapped(put(params, row), put(state, row), put(grads_seq, steps_row))
      return out

  _FAULT_RUNS[key] = (init, run)
  return init, run


def _replicated(inner, state):
  """The part of apply_if_finite's state that must be the same everywhere.

  Its counters, and ``inner``'s state except what is per replica by design:
  ``tower``'s state is each replica's slice, ``accumulate``'s ``acc_grads``
  each replica's local sum.
  """
  inner_state = state.inner_state
  if inner.startswith("tower"):
    inner_state = ()
  elif inner.startswith("accumulate"):
    inner_state = inner_state._replace(acc_grads=())
  return state._replace(inner_state=inner_state)


def _np_guarded(grads, max_consecutive, inner, p0):
  """numpy float64: optax.apply_if_finite's rule around ``inner``.

  grads: (steps, R, N), the flattened leaves; p0: (N,). Returns params per
  step (steps, N) and the counters per step.
  """
  p, trace = p0.astype(np.float64), np.zeros_like(p0, np.float64)
  acc, mini_step = None, 0  # accumulate's per-replica running mean
  count = total = 0
  out = {
    "params": [],
    "notfinite_count": [],
    "total_notfinite": [],
    "last_finite": [],
  }
  with np.errstate(invalid="ignore", over="ignore"):
    for g in grads.astype(np.float64):
      finite = bool(np.all(np.isfinite(g)))
      count = 0 if finite else count + 1
      total += not finite
      if finite or count > max_consecutive:  # optax: apply anyway
        mean = g.mean(axis=0)
        if inner.startswith("accumulate"):
          # Each replica's running mean (Welford's, as optax.MultiSteps: an
          # inf among finite values becomes NaN there), then the mean over
          # the replicas at the emit step.
          acc = acc + (g - acc) / (mini_step + 1) if mini_step else g
          mini_step = (mini_step + 1) % FAULT_K
          mean = None if mini_step else acc.mean(axis=0)
        if mean is not None:
          if "momentum" in inner:
            trace = mean + MOMENTUM * trace
            p = p - LR * trace
          else:
            p = p - LR * mean
      out["params"].append(p)
      out["notfinite_count"].append(count)
      out["total_notfinite"].append(total)
      out["last_finite"].append(finite)
  return {k: np.asarray(v) for k, v in out.items()}


@st.composite
def _fault_patterns(draw):
  """(steps, R) codes: 0 finite, 1 NaN, 2 +inf, 3 -inf; plus a seed.

  Faulty steps at a random density, each with 1 to 3 bad replicas, and a
  burst of consecutive faulty steps (at times longer than
  max_consecutive_errors, so optax's rule applies one anyway).
  """
  density = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5]))
  burst = draw(st.integers(0, 6))
  start = draw(st.integers(0, FAULT_STEPS - 1))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  codes = np.zeros((FAULT_STEPS, R), np.int64)
  for t in range(FAULT_STEPS):
    if rng.random() < density or start <= t < start + burst:
      bad = rng.choice(R, size=rng.integers(1, 4), replace=False)
      codes[t, bad] = rng.integers(1, 4, size=len(bad))
  return codes, seed


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_apply_if_finite_random_nan_inf_patterns_skip_together_and_match_numpy(
  mapping,
):
  tried = {"faulty": 0, "skipped": 0, "forced": 0}

  @settings(8)
  @given(
    pattern=_fault_patterns(),
    tree=st.sampled_from(sorted(FAULT_TREES)),
    inner=st.sampled_from(sorted(FAULT_INNERS)),
    max_consecutive=st.integers(0, 3),
  )
  def check(pattern, tree, inner, max_consecutive):
    codes, seed = pattern
    rng = np.random.default_rng(seed + 1)
    kind, shapes = FAULT_TREES[tree]
    sizes = [int(np.prod(s)) for s in shapes]
    flat = rng.normal(size=(FAULT_STEPS, R, sum(sizes))).astype(np.float32)
    where = rng.integers(0, sum(sizes), size=(FAULT_STEPS, R))
    bad = np.array([0.0, np.nan, np.inf, -np.inf], np.float32)
    t_idx, r_idx = np.nonzero(codes)
    flat[t_idx, r_idx, where[t_idx, r_idx]] = bad[codes[t_idx, r_idx]]
    p0 = rng.normal(size=sum(sizes)).astype(np.float32)

    def unflatten(x, lead):
      parts = np.split(x, np.cumsum(sizes)[:-1], axis=-1)
      return build_tree(
        kind, [part.reshape(lead + s) for part, s in zip(parts, shapes)]
      )

    params = unflatten(np.tile(p0, (R, 1)), (R,))
    init, run = _guarded_run(mapping, inner, max_consecutive)
    state = init(params)
    hist_params, hist_state, divergence = jax.tree.map(
      np.asarray, run(params, state, unflatten(flat, (FAULT_STEPS, R)))
    )
    jax.block_until_ready(hist_params)
    want = _np_guarded(flat, max_consecutive, inner, p0)

    # Every replica took the same branch: (params, state) bit-identical on
    # every replica after every step.
    assert float(divergence.max()) == 0.0, divergence
    for leaf in jax.tree.leaves((hist_params, _replicated(inner, hist_state))):
      for r in range(1, R):
        np.testing.assert_array_equal(leaf[:, r], leaf[:, 0])
    for got, ref in zip(
      jax.tree.leaves(hist_params),
      jax.tree.leaves(unflatten(want["params"], (FAULT_STEPS,))),
    ):
      np.testing.assert_allclose(got[:, 0], ref, rtol=2e-5, atol=2e-6)
    for field in ("notfinite_count", "total_notfinite", "last_finite"):
      np.testing.assert_array_equal(
        getattr(hist_state, field)[:, 0].reshape(FAULT_STEPS),
        want[field],
        err_msg=field,
      )
    faulty = ~want["last_finite"]
    tried["faulty"] += int(faulty.sum())
    forced = faulty & (want["notfinite_count"] > max_consecutive)
    tried["forced"] += int(forced.sum())
    tried["skipped"] += int((faulty & ~forced).sum())
    tried.setdefault("examples", 0)
    tried["examples"] += 1
    tried.setdefault("inners", set()).add(inner)

  check()
  report(
    f"apply_if_finite under random NaN/inf patterns ({mapping})",
    tried["examples"],
    f" over {len(tried['inners'])} inner transforms; {tried['faulty']}"
    f" non-finite steps: {tried['skipped']} skipped on every replica,"
    f" {tried['forced']} applied after more than max_consecutive_errors;"
    " max replica_divergence 0.0; params and counters equal numpy",
  )


# --- Bad arguments: clear errors, raised before any collective runs. -----------

_NOT_INTEGERS = st.one_of(
  st.booleans(),
  st.floats(allow_nan=True),
  st.none(),
  st.text(max_size=3),
  st.lists(st.integers(1, 4), max_size=2),
)


def test_accumulate_every_k_steps_not_a_positive_integer_is_rejected():
  tried = []

  @settings(20)
  @given(value=st.one_of(st.integers(max_value=0), _NOT_INTEGERS))
  def check(value):
    with pytest.raises(ValueError) as info:
      shardopt.accumulate(optax.sgd(0.1), value)
    message = str(info.value)
    for fragment in (
      "shardopt.accumulate",
      f"every_k_steps={value!r}",
      "positive integer",
    ):
      assert fragment in message, (fragment, message)
    tried.append(value)

  check()
  report(
    "accumulate every_k_steps <= 0 or not an integer -> ValueError", len(tried)
  )


def test_accumulate_use_grad_mean_not_a_bool_is_rejected():
  tried = []

  @settings(10)
  @given(
    value=st.one_of(
      st.integers(), st.floats(allow_nan=True), st.none(), st.text(max_size=3)
    )
  )
  def check(value):
    with pytest.raises(TypeError) as info:
      shardopt.accumulate(optax.sgd(0.1), 2, use_grad_mean=value)
    message = str(info.value)
    for fragment in ("shardopt.accumulate", f"use_grad_mean={value!r}"):
      assert fragment in message, (fragment, message)
    tried.append(value)

  check()
  report("accumulate use_grad_mean not a bool -> TypeError", len(tried))


def test_apply_if_finite_max_consecutive_errors_not_a_non_negative_integer_is_rejected():
  tried = []

  @settings(20)
  @given(value=st.one_of(st.integers(max_value=-1), _NOT_INTEGERS))
  def check(value):
    with pytest.raises(ValueError) as info:
      shardopt.apply_if_finite(optax.sgd(0.1), value, axis_name=AXIS)
    message = str(info.value)
    for fragment in (
      "shardopt.apply_if_finite",
      f"max_consecutive_errors={value!r}",
      "non-negative",
    ):
      assert fragment in message, (fragment, message)
    tried.append(value)

  check()
  report(
    "apply_if_finite max_consecutive_errors < 0 or not an integer"
    " -> ValueError",
    len(tried),
  )


NOT_TRANSFORMS = {
  "None": None,
  "int": 3,
  "str": "adam",
  "a function": lambda g: g,
  "optax.adam itself (not called)": optax.adam,
  "a tuple of transforms": (optax.sgd(0.1),),
}


@pytest.mark.parametrize(
  "bad", list(NOT_TRANSFORMS.values()), ids=list(NOT_TRANSFORMS)
)
@pytest.mark.parametrize(
  "name, make",
  [
    ("shardopt.accumulate", lambda inner: shardopt.accumulate(inner, 2)),
    (
      "shardopt.apply_if_finite",
      lambda inner: shardopt.apply_if_finite(inner, 2, axis_name=AXIS),
    ),
    ("shardopt.cross_shard", lambda inner: shardopt.cross_shard(inner, AXIS)),
    ("shardopt.tower", lambda inner: shardopt.tower(inner, AXIS)),
    ("shardopt.agn", lambda inner: shardopt.agn(inner, AXIS)),
  ],
  ids=["accumulate", "apply_if_finite", "cross_shard", "tower", "agn"],
)
def test_inner_not_a_transform_is_rejected_naming_the_transform(
  name, make, bad
):
  with pytest.raises(TypeError) as info:
    make(bad)
  assert f"{name}: inner=" in str(info.value), info.value


WITH_AXIS_NEW = {  # name in the error -> (axis -> transform)
  "shardopt.apply_if_finite": lambda a: shardopt.apply_if_finite(
    shardopt.cross_shard(optax.adam(0.1), AXIS), 2, axis_name=a
  ),
  "shardopt.all_finite": lambda a: stateless(
    lambda t: jax.tree.map(
      lambda x: jnp.where(shardopt.all_finite(t, a), x, 0.0), t
    )
  ),
  # accumulate has no axis of its own: the inner transform's is checked
  # while the emit branch is traced, on every mini-step.
  "shardopt.cross_shard": lambda a: shardopt.accumulate(
    shardopt.cross_shard(optax.adam(0.1), a), 2
  ),
}


@pytest.mark.parametrize("name", sorted(WITH_AXIS_NEW))
def test_wrong_axis_names_of_the_new_transforms_raise_and_change_nothing(
  mesh, name
):
  params = float_params()
  state, specs = init_on_mesh(mesh, WITH_AXIS_NEW[name](AXIS), params)
  tried = []

  @settings(5)
  @given(axis=WRONG_NAMES)
  def check(axis):
    message = assert_fails_cleanly(
      mesh,
      WITH_AXIS_NEW[name](axis),
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


def test_all_finite_invalid_groups_raise_and_change_nothing(mesh):
  params = float_params()
  state, specs = init_on_mesh(mesh, stateless(lambda t: t), params)
  tried = []

  @settings(16)
  @given(data=st.data(), kind=st.sampled_from(INVALID_GROUP_KINDS))
  def check(data, kind):
    groups = data.draw(invalid_groups(kind))
    bad = stateless(
      lambda t: jax.tree.map(
        lambda x: jnp.where(
          shardopt.all_finite(t, AXIS, axis_index_groups=groups), x, 0.0
        ),
        t,
      )
    )
    message = assert_fails_cleanly(
      mesh, bad, state, specs, params, float_params(), ValueError
    )
    for fragment in (
      "shardopt.all_finite",
      "axis_index_groups",
      repr(AXIS),
      f"size {R}",
    ):
      assert fragment in message, (kind, groups, message)
    tried.append(kind)

  check()
  with pytest.raises(
    ValueError,
    match="shardopt.all_finite: axis_index_groups.*needs a named axis",
  ):
    shardopt.all_finite(jnp.ones(3), None, axis_index_groups=[[0]])
  report(
    "all_finite with invalid axis_index_groups -> ValueError",
    len(tried),
    f" ({len(set(tried))} kinds)",
  )


# --- powersgd, hierarchical_local_sgd, diloco(num_fragments=F). -------------


_PMAPPED = {}


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Drops the programs a property compiled once it is done.

  A property compiles a program per drawn tree; under the thorough profile one
  xdist worker would keep all of them (in ``_PMAPPED`` and in jax's caches)
  for the whole ``make fuzz`` run. A worker died once, silently, late in such
  a run; memory is our guess at why (the property passed alone, 3 x 500).
  """
  yield
  _PMAPPED.clear()
  jax.clear_caches()


def _pmap_steps(make_tx, key, params, grads_seq):
  """Steps of ``make_tx()`` under pmap, one call and block_until_ready each.

  params: leaves (R, ...); grads_seq: a list of grads trees, leaves (R, ...).
  ``key`` names the transform's arguments: one pmapped init and step per key
  (jax compiles them again only for a new tree). Returns [(params, updates,
  state)] after every step, as numpy.
  """
  if key not in _PMAPPED:
    tx = make_tx()

    def one(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), updates, state

    _PMAPPED[key] = (
      jax.pmap(tx.init, axis_name=AXIS),
      jax.pmap(one, axis_name=AXIS),
    )
  init, step = _PMAPPED[key]
  state = init(params)
  out = []
  for grads in grads_seq:
    params, updates, state = step(params, state, grads)
    jax.block_until_ready(params)
    out.append(jax.tree.map(np.asarray, (params, updates, state)))
  return out


POWERSGD_SHAPES = [(4, 3), (2, 5), (3, 2, 2), (5, 1), (6,), ()]


def _powersgd_compressed(shape, rank, rate):
  """Design 6.3: compressed iff ndim >= 2 and r*(n+m)*rate < n*m."""
  if len(shape) < 2:
    return False
  n, m = shape[0], int(np.prod(shape[1:]))
  r = min(rank, n, m)
  return r * (n + m) * rate < n * m


def _per_leaf(params, tree):
  """``tree`` (the PowerSGD error, or q) as one entry per leaf of params."""
  treedef = jax.tree.structure(params)
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError):
    entries = list(tree)
    assert len(entries) == treedef.num_leaves, (treedef, tree)
    return entries


def _powersgd_run(rank, rate, shapes, steps, seed, lr=1.0):
  rng = np.random.default_rng(seed)
  params = [np.zeros((R,) + s, np.float32) for s in shapes]
  grads_seq = [
    [rng.normal(size=(R,) + s).astype(np.float32) for s in shapes]
    for _ in range(steps)
  ]
  make = lambda: optax.chain(
    shardopt.powersgd(AXIS, rank=rank, min_compression_rate=rate), optax.sgd(lr)
  )
  return grads_seq, _pmap_steps(
    make, ("powersgd", rank, rate, lr), params, grads_seq
  )


def test_powersgd_at_full_rank_is_the_mean():
  tried = []

  @settings(8)
  @given(
    shapes=st.lists(st.sampled_from(POWERSGD_SHAPES), min_size=1, max_size=3),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
  )
  def check(shapes, steps, seed):
    # rank >= min(n, m) for every leaf; min_compression_rate 0.25 makes every
    # leaf of 2 or more dims compressed even at full rank (r (n+m)/4 < n m).
    rank, rate = max(max(s, default=1) for s in shapes), 0.25
    grads_seq, out = _powersgd_run(rank, rate, shapes, steps, seed)
    for grads, (_, updates, _) in zip(grads_seq, out):
      for g, u in zip(grads, updates):
        want = -g.astype(np.float64).mean(axis=0)
        for r in range(R):  # the same on every replica, bit for bit
          np.testing.assert_array_equal(u[r], u[0])
        np.testing.assert_allclose(
          u[0], want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(g).max())
        )
    tried.append(sum(_powersgd_compressed(s, rank, rate) for s in shapes))

  check()
  report(
    "powersgd at full rank == mean",
    len(tried),
    f" ({sum(tried)} compressed leaves)",
  )


def test_powersgd_error_feedback_sums_to_what_was_not_sent():
  tried = []

  @settings(8)
  @given(
    shapes=st.lists(st.sampled_from(POWERSGD_SHAPES), min_size=1, max_size=3),
    rank=st.integers(1, 3),
    rate=st.sampled_from([0.25, 1.0, 2.0]),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
  )
  def check(shapes, rank, rate, steps, seed):
    grads_seq, out = _powersgd_run(rank, rate, shapes, steps, seed)
    params0 = [np.zeros((R,) + s, np.float32) for s in shapes]
    errors_before = [np.zeros((R,) + s) for s in shapes]
    for grads, (_, updates, state) in zip(grads_seq, out):
      errors = _per_leaf(params0, state[0].error)
      for i, (s, g, u) in enumerate(zip(shapes, grads, updates)):
        approx = -u[0].astype(np.float64)  # sgd(1.0): updates = -approx
        if not _powersgd_compressed(s, rank, rate):
          np.testing.assert_allclose(
            approx, g.astype(np.float64).mean(0), rtol=1e-5, atol=1e-6
          )
          continue
        e = np.asarray(errors[i], np.float64).reshape((R,) + s)
        sent = g.astype(np.float64) + errors_before[i]  # M_i = g_i + e_i
        # sum_i e_i == sum_i M_i - n * approx: what was not sent, in total.
        np.testing.assert_allclose(
          e.sum(0),
          sent.sum(0) - R * approx,
          rtol=1e-4,
          atol=1e-4 * max(1.0, np.abs(sent).sum(0).max()),
        )
        errors_before[i] = e
    tried.append(sum(_powersgd_compressed(s, rank, rate) for s in shapes))

  check()
  report(
    "powersgd: sum of errors == sum of inputs - n * approximation",
    len(tried),
    f" ({sum(tried)} compressed leaves)",
  )


@st.composite
def _hierarchies(draw):
  """{period: size}: periods and sizes (divisors of R) strictly increasing."""
  levels = draw(st.integers(1, 3))
  periods = sorted(
    draw(
      st.lists(st.integers(1, 8), min_size=levels, max_size=levels, unique=True)
    )
  )
  sizes = sorted(
    draw(
      st.lists(
        st.sampled_from([1, 2, 4, 8]),
        min_size=levels,
        max_size=levels,
        unique=True,
      )
    )
  )
  return dict(zip(periods, sizes))


def _np_hierarchical(schedule, p0, grads_seq, lr):
  """numpy: local SGD steps; after step t the largest period dividing t
  wins and params are averaged in contiguous groups of its size."""
  p, out = np.tile(p0.astype(np.float64), (R, 1)), []
  for t, g in enumerate(grads_seq, start=1):
    p = p - lr * g
    winners = [period for period in schedule if t % period == 0]
    if winners:
      size = schedule[max(winners)]
      for start in range(0, R, size):
        p[start : start + size] = p[start : start + size].mean(axis=0)
    out.append(p)
  return out


def _flat_rows(tree):
  return np.concatenate(
    [np.asarray(x).reshape(R, -1) for x in jax.tree.leaves(tree)], axis=1
  )


def test_hierarchical_local_sgd_equals_numpy_for_random_schedules():
  tried = []

  @settings(8)
  @given(
    schedule=_hierarchies(),
    tree=pytrees(dtypes=[jnp.float32]),
    steps=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
  )
  def check(schedule, tree, steps, seed):
    kind, specs = tree
    # No size-0 leaves: jax 0.10.2's pmap fails to compile a function whose
    # outputs are a counter and two size-0 arrays (an XLA "xla.sdy" error;
    # docs/reliability.md), which any periodic transform's init is.
    specs = [(s if s != (0,) else (2,), d) for s, d in specs]
    rng = np.random.default_rng(seed)
    lr = 0.1
    leaves0 = [rng.normal(size=s).astype(np.float32) for s, _ in specs]
    params = build_tree(
      kind, [np.tile(x, (R,) + (1,) * x.ndim) for x in leaves0]
    )
    grads_seq = [
      build_tree(
        kind, [rng.normal(size=(R,) + s).astype(np.float32) for s, _ in specs]
      )
      for _ in range(steps)
    ]
    make = lambda: shardopt.hierarchical_local_sgd(
      optax.sgd(lr), AXIS, period_group_sizes=schedule
    )
    out = _pmap_steps(
      make, ("hierarchical", tuple(schedule.items()), lr), params, grads_seq
    )
    p0 = _flat_rows(params)[0]
    want = _np_hierarchical(
      schedule, p0, [_flat_rows(g) for g in grads_seq], lr
    )
    for t, ((got, _, _), ref) in enumerate(zip(out, want), start=1):
      np.testing.assert_allclose(
        _flat_rows(got),
        ref,
        rtol=1e-5,
        atol=1e-6,
        err_msg=f"step {t}, schedule {schedule}",
      )
    tried.append(len(schedule))

  check()
  report(
    "hierarchical_local_sgd == numpy",
    len(tried),
    f" (levels per schedule: {sorted(set(tried))})",
  )


INVALID_SCHEDULES = {
  "empty": {},
  "periods not increasing": {4: 2, 2: 4},
  "sizes not increasing": {2: 4, 4: 2},
  "size not dividing the axis": {2: 3},
  "period 0": {0: 2},
  "size 0": {2: 0},
  "float period": {2.0: 2},
  "bool size": {2: True},
  "str size": {2: "4"},
  "not a mapping": 4,
}


@pytest.mark.parametrize(
  "schedule", list(INVALID_SCHEDULES.values()), ids=list(INVALID_SCHEDULES)
)
def test_hierarchical_local_sgd_rejects_invalid_schedules(schedule):
  name = "shardopt.hierarchical_local_sgd"
  with pytest.raises((ValueError, TypeError)) as info:
    tx = shardopt.hierarchical_local_sgd(
      optax.sgd(0.1), AXIS, period_group_sizes=schedule
    )
    # A size that does not divide the axis can only be seen while tracing.
    params = np.zeros((R, 3), np.float32)
    state = jax.pmap(tx.init, axis_name=AXIS)(params)
    jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name=AXIS)(
      params, state, params
    )
  assert name in str(info.value) and "period_group_sizes" in str(info.value), (
    info.value
  )


def _np_fragments(nbytes, num_fragments):
  """Leaf ranges of each fragment: contiguous, cut where the cumulative bytes
  come closest to multiples of total/F. None when a cut is ambiguous (a tie)
  or two cuts coincide; the property then draws another example."""
  cumulative = np.cumsum(nbytes)
  total, cuts = cumulative[-1], [0]
  for j in range(1, num_fragments):
    distance = np.abs(cumulative[:-1] - j * total / num_fragments)
    best = np.flatnonzero(distance == distance.min())
    if len(best) > 1 or best[0] + 1 <= cuts[-1]:
      return None
    cuts.append(int(best[0]) + 1)
  cuts.append(len(nbytes))
  return [range(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _np_streaming_diloco(
  leaves0, grads_seq, period, fragments, lr, outer_lr=0.7, momentum=0.9
):
  """numpy: local SGD; fragment f syncs after step t iff t % H == (f H)//F:
  the outer Nesterov step on center - mean(params) of its leaves only."""
  centers = [x.astype(np.float64) for x in leaves0]
  traces = [np.zeros_like(c) for c in centers]
  params = [np.tile(c, (R,) + (1,) * c.ndim) for c in centers]
  out, F = [], len(fragments)
  for t, grads in enumerate(grads_seq, start=1):
    params = [p - lr * g for p, g in zip(params, grads)]
    for f, leaves in enumerate(fragments):
      if t % period != (f * period) // F:
        continue
      for i in leaves:
        delta = centers[i] - params[i].mean(axis=0)
        traces[i] = delta + momentum * traces[i]
        centers[i] = centers[i] - outer_lr * (delta + momentum * traces[i])
        params[i] = np.tile(centers[i], (R,) + (1,) * centers[i].ndim)
    out.append([p.copy() for p in params])
  return out


def test_diloco_fragments_equal_numpy_for_random_periods_and_trees():
  # Every F in 1..min(H, leaves); F = 1 is plain diloco.
  tried = []

  @settings(8)
  @given(
    period=st.integers(1, 6),
    shapes=st.lists(
      st.sampled_from([(), (1,), (3,), (2, 3), (7,)]), min_size=1, max_size=4
    ),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
  )
  def check(period, shapes, data, seed):
    max_f = min(period, len(shapes))
    num_fragments = data.draw(st.integers(1, max_f), label="num_fragments")
    fragments = _np_fragments(
      [4 * int(np.prod(s)) for s in shapes], num_fragments
    )
    assume(fragments is not None)
    steps = data.draw(st.integers(1, 2 * period + 1), label="steps")
    rng = np.random.default_rng(seed)
    lr = 0.1
    leaves0 = [rng.normal(size=s).astype(np.float32) for s in shapes]
    params = [np.tile(x, (R,) + (1,) * x.ndim) for x in leaves0]
    grads_seq = [
      [rng.normal(size=(R,) + s).astype(np.float32) for s in shapes]
      for _ in range(steps)
    ]
    make = lambda: shardopt.diloco(
      optax.sgd(lr),
      AXIS,
      sync_period=period,
      outer_learning_rate=0.7,  # _np_streaming_diloco's outer step
      outer_momentum=0.9,
      num_fragments=num_fragments,
    )
    out = _pmap_steps(
      make, ("diloco", period, num_fragments, lr), params, grads_seq
    )
    want = _np_streaming_diloco(leaves0, grads_seq, period, fragments, lr)
    for t, ((got, _, _), ref) in enumerate(zip(out, want), start=1):
      for i, (x, y) in enumerate(zip(got, ref)):
        np.testing.assert_allclose(
          x,
          y,
          rtol=1e-5,
          atol=1e-5,
          err_msg=f"step {t}, leaf {i}, H={period}, F={num_fragments},"
          f" fragments {fragments}",
        )
    tried.append(num_fragments)

  check()
  report(
    "diloco(num_fragments=F) == numpy",
    len(tried),
    f" (F drawn: {sorted(set(tried))})",
  )


@pytest.mark.parametrize(
  "num_fragments, period, leaves",
  [
    (0, 4, 3),
    (-1, 4, 3),
    (5, 4, 8),
    (4, 4, 3),
    (True, 4, 3),
    (2.0, 4, 3),
    (None, 4, 3),
  ],
  ids=[
    "0",
    "negative",
    "more than H",
    "more than leaves",
    "bool",
    "float",
    "None",
  ],
)
def test_diloco_rejects_invalid_num_fragments(num_fragments, period, leaves):
  with pytest.raises((ValueError, TypeError)) as info:
    tx = shardopt.diloco(
      optax.sgd(0.1), AXIS, sync_period=period, num_fragments=num_fragments
    )
    # More fragments than leaves can only be seen with the params.
    params = [np.zeros((R, 2), np.float32) for _ in range(leaves)]
    state = jax.pmap(tx.init, axis_name=AXIS)(params)
    jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name=AXIS)(
      params, state, params
    )
  assert "shardopt.diloco" in str(info.value) and "num_fragments" in str(
    info.value
  ), info.value
