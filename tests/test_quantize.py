"""Quantized collectives against a numpy reference, their bound and their bytes.

The reference below is written from the spec in ``shardopt.quantize``'s
docstring with numpy and ml_dtypes only: flatten, pad to ``n`` chunks of whole
blocks, per-block ``absmax / qmax`` float32 scales, round to nearest (ties to
even), sum the dequantized chunks in float32 in member order, divide, and
requantize. The quantized reduction must match it bit for bit (every dtype,
with and without groups, under pmap and a checking shard_map), stay within the
stated error bound of the exact float64 mean, give every member of a group the
same bits, and put the stated bytes on the wire.
"""

import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt import quantize

N = 8
AXIS = "batch"
DTYPES = {
  "int8": jnp.int8,
  "float8_e4m3fn": jnp.float8_e4m3fn,
  "float8_e5m2": jnp.float8_e5m2,
  "int4": jnp.int4,
}
QMAX = {"int8": 127.0, "int4": 7.0, "float8_e4m3fn": 448.0}
QMAX["float8_e5m2"] = 57344.0
# Mantissa bits and smallest normal exponent of the float8 dtypes.
FLOAT8 = {"float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}
GROUPS = {
  "no_groups": None,
  "strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
  "pairs": [[0, 1], [2, 3], [4, 5], [6, 7]],
}
BLOCK = 16
SHAPES = {"kernel": (37, 5), "bias": (3,), "scalar": (), "wide": (300,)}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  tree = {
    name: (rng.standard_normal((N,) + shape) * 10.0 ** rng.integers(-2, 3))
    for name, shape in SHAPES.items()
  }
  tree["wide"][:, 40:80] = 0.0  # all-zero blocks: scale 0
  return {k: v.astype(np.float32) for k, v in tree.items()}


# --------------------------------------------------------------------------
# The numpy reference.


def np_layout(size, members, name, block_size):
  per = -(-size // members)
  if name == "int4":
    per += per % 2
  block = min(block_size, per)
  return block, -(-per // block)


def np_quantize(values, name):
  """(..., blocks, block) float32 -> (dequantized, scales), both float32."""
  absmax = np.max(np.abs(values), axis=-1)
  scale = (absmax * np.float32(1.0 / QMAX[name])).astype(np.float32)
  # Rounded up to 17 significant bits: q * scale is then exact in float32.
  mask = np.uint32((1 << 7) - 1)
  scale = ((scale.view(np.uint32) + mask) & ~mask).view(np.float32)
  with np.errstate(divide="ignore"):
    inverse = np.where(scale > 0, np.float32(1.0) / scale, 0).astype(np.float32)
  y = np.clip(values * inverse[..., None], -QMAX[name], QMAX[name])
  if name in FLOAT8:
    q = y.astype(getattr(ml_dtypes, name)).astype(np.float32)
  else:
    q = np.round(y).astype(np.int8).astype(np.float32)  # half to even
  return (q * scale[..., None]).astype(np.float32), scale


def np_two_phase(stacked, groups, reduction, name, block_size):
  """The reduction of every replica's leaf; (results, in_scales, out_scales)
  with the scales broadcast back onto the elements."""
  members = N if groups is None else len(groups[0])
  groups = groups or [list(range(N))]
  shape = stacked.shape[1:]
  size = int(np.prod(shape))
  block, blocks = np_layout(size, members, name, block_size)
  padded = members * blocks * block
  out = np.zeros_like(stacked)
  in_scales = np.zeros(stacked.shape, np.float32)
  out_scales = np.zeros(stacked.shape, np.float32)
  for group in groups:
    chunks, scales = [], []
    for i in group:
      flat = np.zeros(padded, np.float32)
      flat[:size] = stacked[i].reshape(-1)
      deq, s = np_quantize(flat.reshape(members, blocks, block), name)
      chunks.append(deq)
      scales.append(np.repeat(s.reshape(-1), block)[:size].reshape(shape))
    reduced = []
    for j in range(members):
      total = chunks[0][j]
      for k in range(1, members):
        total = (total + chunks[k][j]).astype(np.float32)
      if reduction == "mean":
        total = (total * np.float32(1.0 / members)).astype(np.float32)
      reduced.append(total)
    deq, s = np_quantize(np.stack(reduced), name)
    result = deq.reshape(-1)[:size].reshape(shape)
    s_out = np.repeat(s.reshape(-1), block)[:size].reshape(shape)
    for k, i in enumerate(group):
      out[i] = result
      in_scales[i] = np.stack(scales)[k]  # replica i's own scales
      out_scales[i] = s_out
  return out, in_scales, out_scales


# --------------------------------------------------------------------------
# Harness: one compiled function per (mapping, groups), every dtype and both
# reductions inside it.


def _mesh():
  return jax.make_mesh((N,), (AXIS,))


def _shard(tree):
  return jax.device_put(tree, NamedSharding(_mesh(), P(AXIS)))


def _mapped(per_replica, mapping):
  if mapping == "pmap":
    return jax.pmap(per_replica, axis_name=AXIS)

  def body(tree):
    out = per_replica(jax.tree.map(lambda x: x[0], tree))
    return jax.tree.map(lambda x: x[None], out)

  return jax.jit(
    jax.shard_map(body, mesh=_mesh(), in_specs=P(AXIS), out_specs=P(AXIS))
  )


def _run(fn, mapping, tree):
  return jax.device_get(fn(tree if mapping == "pmap" else _shard(tree)))


_CACHE = {}


def _all_reductions(mapping, groups_name):
  """{(dtype, reduction, block): tree} for one mapping and group layout."""
  key = (mapping, groups_name)
  if key not in _CACHE:

    def per_replica(tree):
      return {
        f"{name}/{reduction}/{block}": shardopt.reduce(
          tree,
          AXIS,
          reduction=reduction,
          axis_index_groups=GROUPS[groups_name],
          comm_dtype=shardopt.quantized(dtype, block_size=block),
        )
        for name, dtype in DTYPES.items()
        for reduction in ("mean", "sum")
        for block in (BLOCK, 256)
      }

    _CACHE[key] = _run(_mapped(per_replica, mapping), mapping, _inputs())
  return _CACHE[key]


CASES = [
  (mapping, groups_name)
  for mapping in ("pmap", "shard_map_check_vma")
  for groups_name in GROUPS
]


@pytest.mark.parametrize("mapping, groups_name", CASES)
@pytest.mark.parametrize("name", DTYPES)
def test_two_phase_reduction_matches_the_numpy_reference_bit_for_bit(
  mapping, groups_name, name
):
  results = _all_reductions(mapping, groups_name)
  inputs = _inputs()
  for reduction in ("mean", "sum"):
    for block in (BLOCK, 256):
      got = results[f"{name}/{reduction}/{block}"]
      for leaf, stacked in inputs.items():
        want, _, _ = np_two_phase(
          stacked, GROUPS[groups_name], reduction, name, block
        )
        np.testing.assert_array_equal(
          got[leaf], want, err_msg=f"{leaf} {reduction} block={block}"
        )


@pytest.mark.parametrize("mapping, groups_name", CASES)
def test_group_members_end_bit_identical(mapping, groups_name):
  results = _all_reductions(mapping, groups_name)
  for group in GROUPS[groups_name] or [list(range(N))]:
    for key, tree in results.items():
      for leaf, value in tree.items():
        bits = value.view(np.uint32)
        for i in group[1:]:
          np.testing.assert_array_equal(
            bits[i], bits[group[0]], err_msg=f"{key} {leaf} replica {i}"
          )


def _half_step(values, scales, name):
  """Half a quantization step at ``values`` in blocks with ``scales``."""
  if name not in FLOAT8:
    return scales / 2
  mantissa, emin = FLOAT8[name]
  return np.maximum(
    np.abs(values) * 2.0 ** -(mantissa + 1),
    scales * 2.0 ** (emin - mantissa - 1),
  )


@pytest.mark.parametrize("groups_name", GROUPS)
@pytest.mark.parametrize("name", DTYPES)
def test_error_bound_without_feedback(groups_name, name):
  """|result - exact| <= (1/n) sum_i u(x_i, s_i) + u(r, s_out), per element,
  u = half a step (s/2 for integers; the float8 analogue from its mantissa),
  plus float32 rounding of the sum."""
  results = _all_reductions("pmap", groups_name)
  inputs = _inputs()
  groups = GROUPS[groups_name] or [list(range(N))]
  members = len(groups[0])
  for reduction in ("mean", "sum"):
    divide = members if reduction == "mean" else 1
    for leaf, stacked in inputs.items():
      got = results[f"{name}/{reduction}/{BLOCK}"][leaf]
      _, in_scales, out_scales = np_two_phase(
        stacked, GROUPS[groups_name], reduction, name, BLOCK
      )
      x = stacked.astype(np.float64)
      for group in groups:
        exact = x[group].sum(0) / divide
        bound = (
          sum(_half_step(x[i], in_scales[i], name) for i in group) / divide
          + _half_step(exact, out_scales[group[0]], name) * 1.01
          + 1e-6 * np.abs(x[group]).sum(0) / divide
        )
        for i in group:
          err = np.abs(got[i] - exact)
          assert np.all(err <= bound), (
            f"{leaf} {reduction}: worst error {err.max()} vs bound"
            f" {bound[np.argmax(err - bound)]}"
          )


def test_quantizer_round_trip_matches_numpy_and_packs_int4_low_nibble_first():
  rng = np.random.default_rng(1)
  values = rng.standard_normal((3, 5, 8)).astype(np.float32) * 3
  values[1, 2] = 0.0
  for name, dtype in DTYPES.items():
    spec = shardopt.quantized(dtype, block_size=8)
    payload = quantize.encode(jnp.asarray(values), spec)
    assert payload.dtype == jnp.uint8
    assert payload.shape == (3, 5 * 8 * spec.bits // 8 + 5 * 4)
    got = np.asarray(quantize.decode(payload, spec, 8, 5))
    want, _ = np_quantize(values, name)
    np.testing.assert_array_equal(got, want, err_msg=name)
  spec = shardopt.quantized(jnp.int4, block_size=4)
  payload = quantize.encode(jnp.asarray([[[1.0, -2.0, 7.0, -7.0]]]), spec)
  assert np.asarray(payload)[0, :2].tolist() == [0xE1, 0x97]


def test_non_finite_element_makes_its_block_nan_on_every_replica():
  x = np.ones((N, 64), np.float32)
  x[3, 5] = np.inf
  f = jax.pmap(
    lambda g: shardopt.reduce(
      g, AXIS, comm_dtype=shardopt.quantized(jnp.int8, block_size=4)
    ),
    axis_name=AXIS,
  )
  out = np.asarray(f(x))
  assert np.isnan(out[:, 4:8]).all()
  np.testing.assert_allclose(
    np.delete(out, np.s_[4:8], axis=1), 1.0, rtol=2.0**-16
  )


# --------------------------------------------------------------------------
# The wire: dtypes and bytes in the lowered StableHLO and the compiled HLO.


def _operand_types(text, op):
  pattern = (
    r'"stablehlo\.' + op + r'"\(%[^)]*\) <\{.*?\}> : \((tensor<[^>]*>)\)'
  )
  return re.findall(pattern, text, flags=re.S)


def _bytes(tensor_type):
  dims, dtype = re.match(r"tensor<((?:\d+x)*)(\w+)>", tensor_type).groups()
  size = int(np.prod([int(d) for d in dims.split("x") if d]))
  return size * {"ui8": 1, "i8": 1, "f32": 4, "bf16": 2}[dtype]


WIRE_ELEMENTS = 8 * 4096


@pytest.mark.parametrize("name", DTYPES)
def test_wire_carries_the_narrow_bytes_plus_scales(name):
  spec = shardopt.quantized(DTYPES[name])
  x = np.zeros((N, WIRE_ELEMENTS), np.float32)
  f = jax.pmap(lambda g: shardopt.reduce(g, AXIS, comm_dtype=spec), AXIS)
  lowered = f.lower(x)
  text = lowered.as_text()
  sent = _operand_types(text, "all_to_all")
  gathered = _operand_types(text, "all_gather")
  chunk = WIRE_ELEMENTS // N  # 4096 elements per member, 16 blocks of 256
  row = chunk * spec.bits // 8 + (chunk // 256) * 4
  assert sent == [f"tensor<{N}x{row}xui8>"], sent
  assert gathered == [f"tensor<1x{row}xui8>"], gathered
  assert "stablehlo.all_reduce" not in text
  if name in FLOAT8:  # converted to float8, moved as its bytes
    assert re.search(r"f8E\dM\d", text)
  # Per replica: (n - 1) rows out in the all_to_all, (n - 1) rows in the
  # all_gather: a ring all-reduce's 2 (n - 1) / n of the narrow bytes, plus
  # the scales.
  wire = 2 * (N - 1) * row
  ring_f32 = 2 * (N - 1) * WIRE_ELEMENTS * 4 // N
  print(
    f"{name}: all_to_all {sent[0]}, all_gather {gathered[0]};"
    f" {wire} bytes per replica vs {ring_f32} for a float32 ring all-reduce"
    f" ({ring_f32 / wire:.2f}x fewer)"
  )
  assert ring_f32 / wire == pytest.approx(32 / (spec.bits + 32 / 256), rel=1e-9)
  # The CPU backend keeps the bytes; it splits the all-to-all into one
  # operand per destination.
  compiled = lowered.compile().as_text()
  (a2a,) = re.findall(r"= \(([^)]*)\) all-to-all\(", compiled)
  assert a2a.count(f"u8[1,{row}]") == N and "f32" not in a2a, a2a
  assert re.search(rf"u8\[{N},{row}\]\S* all-gather", compiled)


def test_all_leaves_of_a_reduction_share_two_collectives():
  f = jax.pmap(
    lambda t: shardopt.reduce(t, AXIS, comm_dtype=jnp.int8), axis_name=AXIS
  )
  text = f.lower(_inputs()).as_text()
  assert len(_operand_types(text, "all_to_all")) == 1
  assert len(_operand_types(text, "all_gather")) == 1


# --------------------------------------------------------------------------
# Error feedback.


def _running_sum(per_replica, steps, mapping, error_feedback, name="int8"):
  """Sum over ``steps`` of cross_shard_mean's output for constant inputs,
  and the final error buffers."""
  tx = shardopt.cross_shard_mean(
    AXIS,
    comm_dtype=shardopt.quantized(DTYPES[name], block_size=64),
    error_feedback=error_feedback,
  )

  def run(tree):
    g = tree["g"]

    def body(carry, _):
      total, state = carry
      mean, state = tx.update(g, state)
      return (total + mean, state), None

    state = tx.init(g)
    if mapping == "shard_map_check_vma":  # per-replica state
      state = jax.tree.map(
        lambda s: jax.lax.pcast(s, AXIS, to="varying"), state
      )
    (total, state), _ = jax.lax.scan(
      body, (jnp.zeros_like(g), state), None, steps
    )
    error = state.error if error_feedback else jnp.zeros_like(g)
    return {"total": total, "error": error}

  out = _run(_mapped(run, mapping), mapping, {"g": per_replica})
  return out["total"], out["error"]


@pytest.mark.parametrize("mapping", ["pmap", "shard_map_check_vma"])
@pytest.mark.parametrize("name", ["int8", "int4", "float8_e4m3fn"])
def test_error_feedback_keeps_the_running_sum_error_bounded(mapping, name):
  rng = np.random.default_rng(3)
  g = rng.standard_normal((N, 1000)).astype(np.float32)
  exact = g.astype(np.float64).mean(0)
  steps = 100
  block, blocks = np_layout(1000, N, name, 64)
  padded = np.zeros((N, N * blocks * block), np.float32)
  padded[:, :1000] = g
  _, scales = np_quantize(padded.reshape(N, N, blocks, block), name)
  # The largest quantization step at an input (twice the half step).
  scales = np.repeat(scales.reshape(N, -1), block, axis=-1)
  step = 2 * float(_half_step(padded, scales, name).max())
  drift = {}
  for feedback in (False, True):
    total, error = _running_sum(g, steps, mapping, feedback, name)
    np.testing.assert_array_equal(total, np.broadcast_to(total[0], total.shape))
    drift[feedback] = np.abs(total[0] - steps * exact).max()
    if feedback:
      # sum of outputs = sum of exact means - mean of the error buffers.
      np.testing.assert_allclose(
        total[0], steps * exact - error.astype(np.float64).mean(0), atol=2e-3
      )
  one_step = np.abs(_running_sum(g, 1, mapping, False, name)[0][0] - exact)
  print(
    f"{name} {mapping}: running-sum error after {steps} steps without"
    f" feedback {drift[False]:.4f} (one step {one_step.max():.5f}), with"
    f" {drift[True]:.5f}; largest input step {step:.5f}"
  )
  # Without feedback the same rounding repeats: the error grows with steps.
  assert drift[False] == pytest.approx(steps * one_step.max(), rel=1e-3)
  # With feedback it stays within a few quantization steps.
  assert drift[True] <= 3 * step
  assert drift[True] * 10 < drift[False]


def test_error_feedback_state_is_per_replica_float32_in_the_leaf_shape():
  tx = shardopt.cross_shard(
    optax.adam(0.1), AXIS, comm_dtype=jnp.int8, error_feedback=True
  )
  params = {"w": jnp.zeros((4, 3), jnp.bfloat16), "b": jnp.zeros(3)}
  state = tx.init(params)
  assert isinstance(state, shardopt.ErrorFeedbackState)
  chex.assert_trees_all_equal_shapes(state.error, params)
  assert {e.dtype for e in jax.tree.leaves(state.error)} == {
    np.dtype("float32")
  }
  assert len(optax.tree_utils.tree_get_all_with_path(state, "mu")) == 1

  def step(g):
    state = tx.init(params)
    updates, state = tx.update(g, state, params)
    return updates, state.error

  rng = np.random.default_rng(4)
  grads = {
    "w": rng.standard_normal((N, 4, 3)).astype(jnp.bfloat16),
    "b": rng.standard_normal((N, 3)).astype(np.float32),
  }
  updates, error = jax.pmap(step, axis_name=AXIS)(grads)
  assert updates["w"].dtype == jnp.bfloat16
  chex.assert_trees_all_equal(
    jax.tree.map(lambda u: u[0], updates), jax.tree.map(lambda u: u[5], updates)
  )
  # Errors differ between replicas (each keeps its own).
  assert not np.array_equal(error["b"][0], error["b"][1])


def test_a_non_finite_step_does_not_poison_the_error_buffer():
  tx = shardopt.cross_shard_mean(AXIS, comm_dtype=jnp.int8, error_feedback=True)
  good = np.random.default_rng(8).standard_normal((N, 64)).astype(np.float32)
  bad = good.copy()
  bad[2, 7] = np.nan

  def run(bad, good):
    state = tx.init(good)
    first, state = tx.update(bad, state)
    second, state = tx.update(good, state)
    return first, second, state.error

  first, second, error = jax.pmap(run, axis_name=AXIS)(bad, good)
  assert np.isnan(first).any()
  assert np.isfinite(second).all() and np.isfinite(error).all()
  # The module's bound B (int8, the default block of 256) on good's data:
  # second is the quantized mean of good + e1 (e1: the error kept from the
  # first step), within B of it (e1 moves the scales by |e1| / 127, under 5%
  # here), and |mean(e1)| <= B as well: what the first step dropped, whose
  # finite data are good's. So |second - mean(good)| <= 2 B (+ rounding).
  x = good.astype(np.float64)
  _, in_scales, out_scales = np_two_phase(good, None, "mean", "int8", 256)
  bound = sum(_half_step(x[i], in_scales[i], "int8") for i in range(N)) / N
  bound += _half_step(x.mean(0), out_scales[0], "int8")
  err = np.abs(second[0] - x.mean(0))
  assert np.all(err <= 2 * bound * 1.05 + 1e-6), (err.max(), bound.min())


def np_residuals(contributions, name, block_size):
  """Error feedback's residual of every replica for a mean over all N (the
  module's rule): each chunk less what its bytes decode to and, on the chunk
  a replica owns, N x what requantizing the chunk's sum dropped; 0 where not
  finite."""
  size = contributions.shape[1]
  block, blocks = np_layout(size, N, name, block_size)
  flat = np.zeros((N, N * blocks * block), np.float32)
  flat[:, :size] = contributions
  chunks = flat.reshape(N, N, blocks, block)
  with np.errstate(invalid="ignore", over="ignore"):
    sent = np.stack([np_quantize(chunks[i], name)[0] for i in range(N)])
    total = sent[0]
    for i in range(1, N):
      total = (total + sent[i]).astype(np.float32)
    total = (total * np.float32(1.0 / N)).astype(np.float32)
    again = np.float32(N) * (total - np_quantize(total, name)[0])
    out = (chunks - sent).astype(np.float32)
    for i in range(N):
      out[i, i] = out[i, i] + again[i]
    out = np.where(np.isfinite(out), out, np.float32(0.0))
  return out.reshape(N, -1)[:, :size]


@pytest.mark.parametrize("name", ["int8", "int4", "float8_e4m3fn"])
def test_error_feedback_residual_matches_the_numpy_reference_bit_for_bit(name):
  """The error kept after one step, a NaN block and an all-zero block
  included, has the numpy rule's bits on every replica."""
  rng = np.random.default_rng(11)
  g = (rng.standard_normal((N, 1000)) * rng.uniform(0, 4, (N, 1))).astype(
    np.float32
  )
  g[2, 7] = np.nan  # replica 2's first block of chunk 0: NaN, kept as 0
  g[:, 640:704] = 0.0  # every replica's block 10: zeros, scale 0
  tx = shardopt.cross_shard_mean(
    AXIS,
    comm_dtype=shardopt.quantized(DTYPES[name], block_size=64),
    error_feedback=True,
  )
  _, state = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name=AXIS)(g)
  want = np_residuals(g + np.float32(0.0), name, 64)
  np.testing.assert_array_equal(
    np.asarray(state.error).view(np.uint32), want.view(np.uint32)
  )


@pytest.mark.parametrize(
  "wire, padded, unpadded",
  [
    (jnp.int8, 8.0, 22.0),
    (jnp.float8_e4m3fn, 8.0, 22.0),
    (jnp.int4, 8.0, 38.5),
  ],
  ids=["int8", "float8_e4m3fn", "int4"],
)
def test_error_feedback_costs_about_a_read_and_a_write_of_its_buffer(
  wire, padded, unpadded
):
  """XLA's bytes accessed per element (CPU cost analysis, one device) of
  ``cross_shard_mean``'s update, a wire with error feedback less the same
  wire alone.

  On a leaf of 2**18 elements, at least 20.5 on XLA's CPU backend, which
  has no multi-output fusion: ``x + error`` computed once (it reads ``x``
  and the buffer and writes the sum, 12), the residual's pass (it reads the
  sum and writes the buffer, 8; 1/8 of it also reads the owned sum, 0.5).
  Measured 21.5 on the 8-bit wires; it was 37.5 before the absmax read the
  flat contribution (``blocks._encode(flat_absmax=True)``), when each pass
  recomputed ``x + error`` and the donated buffer was copied once. int4
  writes its owned row in place over a copy of the residual (measured 38.1).
  On a leaf of 100,000 (padded chunks: the step without feedback
  materializes the padded contribution too, and the sum fuses into it):
  measured 5.5 and 5.1, under one read and one write of the buffer.
  XLA's GPU backend (not run here) can fuse the encoding and the residual,
  siblings reading the same inputs, into one multi-output loop fusion
  (benchmarks/README.md, section 10c).
  """
  from benchmarks.perf import wire_cost

  def extra(shape):
    base, fed = (
      wire_cost.bytes_per_element(
        wire_cost.compiled_update(wire, ef, [shape]), [shape]
      )
      for ef in (False, True)
    )
    return fed - base

  assert extra((100_000,)) <= padded
  assert extra((1 << 18,)) <= unpadded


@pytest.mark.xfail(
  strict=True,
  reason="issue 54 item 4, open: top-k + EF (126.5) costs more than int8 +"
  " EF (48.1) in XLA's CPU cost analysis, which counts each member's in-place"
  " scatter-add and the gather whole (benchmarks/README.md, section 10c)",
)
def test_topk_with_error_feedback_costs_no_more_than_int8_with_it():
  from benchmarks.perf import wire_cost

  shape = [(1 << 18,)]
  topk, int8 = (
    wire_cost.bytes_per_element(
      wire_cost.compiled_update(wire, True, shape), shape
    )
    for wire in (shardopt.topk(64), jnp.int8)
  )
  assert topk <= int8


def test_error_feedback_under_checking_shard_map_with_replicated_params():
  """P() params, varying gradients: updates typed invariant (out P()),
  the error state per replica (out P(axis))."""
  tx = optax.chain(
    shardopt.cross_shard_mean(AXIS, comm_dtype=jnp.int8, error_feedback=True),
    optax.sgd(1.0),
  )
  params = jnp.zeros(64)
  specs = (shardopt.ErrorFeedbackState(P(AXIS), P()), P())

  def init(p):
    state = tx.init(p)
    return jax.tree.map(lambda s: jax.lax.pcast(s, AXIS, to="varying"), state)

  def step(p, state, g):
    updates, state = tx.update(g[0], state, p)
    return optax.apply_updates(p, updates), state

  state = jax.jit(
    jax.shard_map(init, mesh=_mesh(), in_specs=P(), out_specs=specs)
  )(params)
  assert state[0].error.shape == (N * 64,)
  g = np.random.default_rng(5).standard_normal((N, 64)).astype(np.float32)
  p, state = jax.jit(
    jax.shard_map(
      step,
      mesh=_mesh(),
      in_specs=(P(), specs, P(AXIS)),
      out_specs=(P(), specs),
    )
  )(params, state, _shard(g))
  # One step of sgd(1) from zero error: p = -(the quantized mean), within the
  # module's bound (int8, the default block of 256) of -mean(g).
  x = g.astype(np.float64)
  _, in_scales, out_scales = np_two_phase(g, None, "mean", "int8", 256)
  bound = sum(_half_step(x[i], in_scales[i], "int8") for i in range(N)) / N
  bound += _half_step(x.mean(0), out_scales[0], "int8") * 1.01
  err = np.abs(np.asarray(p) + x.mean(0))
  assert np.all(err <= bound + 1e-6 * np.abs(x).sum(0) / N), (
    err.max(),
    bound.min(),
  )


# --------------------------------------------------------------------------
# The other transforms on a quantized wire; finite flags stay wide.


def test_powersgd_factors_on_an_int8_wire():
  tx = shardopt.powersgd(AXIS, rank=2, comm_dtype=jnp.int8)
  rng = np.random.default_rng(6)
  grads = rng.standard_normal((N, 32, 24)).astype(np.float32)
  exact_tx = shardopt.powersgd(AXIS, rank=2)

  def step(tx):
    def run(g):
      return tx.update(g, tx.init(g))[0]

    return jax.pmap(run, axis_name=AXIS)

  got = np.asarray(step(tx)(grads))
  want = np.asarray(step(exact_tx)(grads))
  np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
  # int8 factors: a rank-2 approximation close to the float32-wire one.
  rel = np.linalg.norm(got[0] - want[0]) / np.linalg.norm(want[0])
  assert rel < 0.05, rel
  text = step(tx).lower(grads).as_text()
  assert _operand_types(text, "all_to_all"), "no quantized wire in the HLO"


@pytest.mark.parametrize("comm_dtype", [jnp.bfloat16, jnp.int8])
def test_periodic_finite_flag_travels_in_float32(comm_dtype):
  """The count of finite replicas never travels in a narrow dtype: a
  bfloat16 sum of 299 ones reads 298, which made ``skipped`` read 2 for one
  non-finite replica of 300. The flag's all-reduce is float32; with 8
  replicas, one non-finite, skipped reads 1."""
  assert (
    float(np.ones(299, ml_dtypes.bfloat16).cumsum(dtype="bfloat16")[-1]) != 299
  )
  tx = shardopt.diloco(
    optax.sgd(0.1), AXIS, sync_period=1, comm_dtype=comm_dtype
  )
  params = jnp.zeros((N, 16))
  state = jax.pmap(tx.init)(params)
  grads = np.ones((N, 16), np.float32)
  grads[2, 3] = np.nan

  def step(p, s, g):
    return tx.update(g, s, p)

  f = jax.pmap(step, axis_name=AXIS)
  text = f.lower(params, state, grads).as_text()
  flags = re.findall(
    r"stablehlo.all_reduce.*?\) -> (tensor<[^>]*>)", text, flags=re.S
  )
  assert "tensor<f32>" in flags, flags
  _, state = f(params, state, grads)
  np.testing.assert_array_equal(state.skipped, 1)
  center = np.asarray(state.center)
  np.testing.assert_array_equal(
    center, np.broadcast_to(center[0], center.shape)
  )


def test_diloco_with_an_int4_outer_gradient_runs_and_agrees():
  tx = shardopt.diloco(
    optax.sgd(0.1),
    AXIS,
    sync_period=2,
    comm_dtype=shardopt.quantized(jnp.int4, block_size=32),
    axis_index_groups=GROUPS["strided"],
  )
  params = jnp.zeros((N, 128))
  state = jax.pmap(tx.init)(params)
  grads = np.random.default_rng(7).standard_normal((N, 128)).astype(np.float32)

  step = jax.pmap(lambda p, s, g: _apply(tx, p, s, g), axis_name=AXIS)
  for _ in range(2):
    params, state = step(params, state, grads)
  # The centers agree bit for bit within a group (the params land on them
  # within a rounding: params + (center - params)).
  center = np.asarray(state.center)
  for group in GROUPS["strided"]:
    for i in group[1:]:
      np.testing.assert_array_equal(center[i], center[group[0]])
  assert not np.array_equal(center[0], center[1])
  assert int(state.sync_count[0]) == 1


def _apply(tx, p, s, g):
  u, s = tx.update(g, s, p)
  return optax.apply_updates(p, u), s


# --------------------------------------------------------------------------
# Errors.


def test_quantized_rejects_bad_dtypes_and_block_sizes():
  with pytest.raises(TypeError, match=r"shardopt.quantized: dtype=int32"):
    shardopt.quantized(jnp.int32)
  with pytest.raises(ValueError, match=r"block_size=0 must be a positive"):
    shardopt.quantized(jnp.int8, block_size=0)
  with pytest.raises(ValueError, match=r"block_size=7 is odd.*int4"):
    shardopt.quantized(jnp.int4, block_size=7)


def test_comm_dtype_that_is_neither_float_nor_quantized_names_the_fix():
  with pytest.raises(
    TypeError,
    match=r"shardopt.cross_shard_mean: comm_dtype=int32 \(the wire dtype of"
    r" reductions over axis 'batch'\) is neither a floating dtype nor a"
    r" quantized one; .*jnp.int8",
  ):
    shardopt.cross_shard_mean(AXIS, comm_dtype=jnp.int32)


def test_error_feedback_needs_a_quantized_wire():
  with pytest.raises(
    ValueError,
    match=r"shardopt.cross_shard: error_feedback=True \(axis 'batch'\).*"
    r"comm_dtype=bfloat16 does not quantize",
  ):
    shardopt.cross_shard(
      optax.sgd(1.0), AXIS, comm_dtype=jnp.bfloat16, error_feedback=True
    )


def np_tower_owned_mean(stacked, name, block_size):
  """tower's quantized reduce-scatter, in numpy: every replica's leaf is
  flattened, zero-padded and cut into N contiguous rows (row j for owner
  j); each row is quantized in blocks of its own (padded to whole blocks);
  owner j sums the rows it receives in member order, times 1/N. Returns
  the whole mean leaf (the owners' chunks side by side)."""
  shape = stacked.shape[1:]
  size = int(np.prod(shape))
  rows = -(-size // N)
  block, blocks = np_layout(N * rows, N, name, block_size)
  flat = np.zeros((N, N * rows), np.float32)
  flat[:, :size] = stacked.reshape(N, -1)
  chunks = np.zeros((N, N, blocks * block), np.float32)
  chunks[:, :, :rows] = flat.reshape(N, N, rows)
  deq, _ = np_quantize(chunks.reshape(N, N, blocks, block), name)
  deq = deq.reshape(N, N, blocks * block)[:, :, :rows]
  owned = []
  for j in range(N):
    total = deq[0, j]
    for i in range(1, N):
      total = (total + deq[i, j]).astype(np.float32)
    owned.append((total * np.float32(1.0 / N)).astype(np.float32))
  return np.concatenate(owned)[:size].reshape(shape)


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn", "int4"])
def test_tower_quantized_reduce_scatter_matches_numpy_bit_for_bit(name):
  """tower(sgd(1)) on a quantized wire: the owner of each chunk sums the
  replicas' quantized rows in float32 (one all-to-all of uint8 bytes, in the
  lowered StableHLO), and the updates come back exact: -(the numpy mean),
  bit for bit, the same on every replica."""
  spec = shardopt.quantized(getattr(jnp, name), block_size=16)
  tx = shardopt.tower(optax.sgd(1.0), AXIS, comm_dtype=spec)
  rng = np.random.default_rng(11)
  grads = {
    "w": rng.standard_normal((N, 10, 7)).astype(np.float32),  # padded rows
    "b": (rng.standard_normal((N, 64)) * 100).astype(np.float32),
  }

  def step(g):
    return tx.update(g, tx.init(g), g)[0]

  mapped = jax.pmap(step, axis_name=AXIS)
  updates = mapped(grads)
  for leaf, stacked in grads.items():
    want = -np_tower_owned_mean(stacked, name, 16)
    got = np.asarray(updates[leaf])
    for i in range(N):
      np.testing.assert_array_equal(got[i], want, err_msg=f"{leaf} {i}")
  text = mapped.lower(grads).as_text()
  assert re.search(r"all_to_all.*tensor<8x\d+xui8>", text), text[-2000:]


def test_tower_quantized_wire_needs_every_axis_varying():
  """A gradient already summed over part of the axes (invariant there) has
  no quantized reduce-scatter: the error names tower and the fix."""
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  tx = shardopt.tower(optax.sgd(1.0), ("a", "b"), comm_dtype=jnp.int8)

  def step(w):
    g = jax.lax.pcast(w, "b", to="varying")  # varying over "b" only
    return tx.update(g, tx.init(w), w)[0]

  f = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P())
  with pytest.raises(NotImplementedError, match=r"shardopt.tower.*bfloat16"):
    jax.jit(f)(jnp.ones((16,)))
