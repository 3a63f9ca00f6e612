"""The sparse top-k wire against a numpy reference, its identity, its bytes.

The reference below is written from the spec in ``shardopt.sparse``'s
docstring with numpy and Python integers only: chunks of ``chunk_size``
(a shorter leaf is one chunk keeping ``ceil(k * size / chunk_size)``), a
stable argsort of ``-|x|`` for the top k, the documented quantizer (17-bit
scales rounded up, ``L = 2 ** (bits - 1)`` magnitude levels), the indices
and codes packed into one Python integer each, least significant bit first.
The codec must match it byte for byte; ``cross_shard_mean`` on the wire must
match a numpy simulation of error feedback (``e = beta e + g``, send the top
k of ``e``, ``e -= sent``, average what was sent in member order) bit for
bit under pmap and a checking shard_map, with and without groups; every
member of a group must hold the same bits (the periodic family's centers,
model-parallel replicas included); the compiled step must gather the
payload's bytes, once.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _model_parallel import make_mesh
from _model_parallel import train
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt import sparse

N = 8
AXIS = "batch"
GROUPS = {
  "no_groups": None,
  "strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
}
# The fast tier (make test-fast) keeps one case of each reference test; the
# other mappings, groups and decays are marked slow.
SLOW = pytest.mark.slow
MAPPINGS = ["pmap", pytest.param("shard_map_check_vma", marks=SLOW)]
GROUP_CASES = ["no_groups", pytest.param("strided", marks=SLOW)]


# --------------------------------------------------------------------------
# The numpy reference.


def np_layout(size, k, chunk_size):
  """(chunk, chunks, keep, index_bits) of a leaf of ``size`` elements."""
  if size >= chunk_size:
    chunk, keep = chunk_size, k
  else:
    chunk, keep = size, int(np.ceil(k * size / chunk_size))
  index_bits = max(1, int(np.ceil(np.log2(chunk))))
  return chunk, int(np.ceil(size / chunk)), keep, index_bits


def np_formula_bytes(size, k, chunk_size, value_bits):
  chunk, chunks, keep, index_bits = np_layout(size, k, chunk_size)
  per_chunk = (
    int(np.ceil(keep * index_bits / 8))
    + int(np.ceil(keep * value_bits / 8))
    + (0 if value_bits in RAW_BITS else 4)  # raw values: no scale
  )
  return chunks * per_chunk


def np_round_up_17_bits(scale):
  bits = np.asarray(scale, np.float32).view(np.uint32)
  return ((bits + np.uint32(127)) & ~np.uint32(127)).view(np.float32)


def np_pairwise_sum(x):
  width = 1
  while width < len(x):
    width *= 2
  x = np.concatenate([x, np.zeros(width - len(x), np.float32)])
  while len(x) > 1:
    x = x[: len(x) // 2] + x[len(x) // 2 :]
  return x[0]


def np_pack(values, bits):
  """Little-endian bit stream of ``values``, ``bits`` each, as bytes."""
  number = 0
  for i, v in enumerate(values):
    number |= int(v) << (i * bits)
  return np.frombuffer(
    number.to_bytes(-(-len(values) * bits // 8), "little"), np.uint8
  )


RAW_BITS = (16, 32)


def np_bfloat16(values):
  """(little-endian bfloat16 bytes, their float32 values) of finite or
  infinite float32 ``values``: the top 16 bits, rounded to nearest, ties to
  even."""
  bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
  high = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
  back = (high.astype(np.uint32) << 16).view(np.float32)
  return high.astype("<u2").tobytes(), back


def np_encode_raw(padded, chunk, chunks, keep, index_bits, value_bits):
  """:func:`np_encode` at 16 or 32 bits: indices, then the values as they
  are (bfloat16 or float32, little-endian), no scale, no flag."""
  payload, dense = [], np.zeros_like(padded)
  for c in range(chunks):
    row = padded[c * chunk : (c + 1) * chunk]
    key = np.where(np.isnan(row), np.inf, np.abs(row))
    index = np.argsort(-key, kind="stable")[:keep]  # ties: lower index
    values = row[index]
    if value_bits == 32:
      raw, sent = values.astype("<f4").tobytes(), values
    else:
      raw, sent = np_bfloat16(values)
    payload += [np_pack(index, index_bits), np.frombuffer(raw, np.uint8)]
    dense[c * chunk + index] = sent
  return np.concatenate(payload), dense


def np_encode(x, k, chunk_size, value_bits):
  """(payload bytes, the dense float32 leaf it stands for)."""
  flat = np.asarray(x, np.float32).reshape(-1)
  chunk, chunks, keep, index_bits = np_layout(flat.size, k, chunk_size)
  padded = np.zeros(chunks * chunk, np.float32)
  padded[: flat.size] = flat
  if value_bits in RAW_BITS:
    payload, dense = np_encode_raw(
      padded, chunk, chunks, keep, index_bits, value_bits
    )
    return payload, dense[: flat.size]
  levels = 2 ** (value_bits - 1)
  payload, dense = [], np.zeros_like(padded)
  for c in range(chunks):
    row = padded[c * chunk : (c + 1) * chunk]
    key = np.where(np.isnan(row), np.inf, np.abs(row))
    index = np.argsort(-key, kind="stable")[:keep]  # ties: lower index
    values = row[index]
    magnitude = np.abs(values)
    empty = int((magnitude == 0).sum())  # zeros sort last
    if value_bits == 1:
      count = np.float32(max(keep - empty, 1))
      scale = np_pairwise_sum(magnitude) * (np.float32(1) / count)
    else:
      scale = magnitude.max()
    scale = np_round_up_17_bits(scale)
    if not np.isfinite(values).all():
      scale = np.float32(np.nan)
    if np.isfinite(scale) and scale > 0:
      inverse = np.float32(levels) / scale
      level = np.clip(np.rint(magnitude * inverse), 1, levels).astype(int)
    else:  # a zero or NaN scale: level 1 (standing for 0 or NaN)
      level = np.ones(keep, int)
    negative = values < 0
    code = (negative.astype(int) << (value_bits - 1)) | (level - 1)
    fields = index.copy()
    scale_bits = int(np.float32(scale).view(np.uint32))
    if empty:  # the trailing zeros stand for nothing: flag and count
      fields[-1] = empty - 1
      scale_bits |= 1
    payload += [
      np_pack(fields, index_bits),
      np_pack(code, value_bits),
      np.frombuffer(scale_bits.to_bytes(4, "little"), np.uint8),
    ]
    kept = (level.astype(np.float32) * scale) * np.float32(1.0 / levels)
    kept = np.where(negative, -kept, kept)
    dense[c * chunk + index] = np.where(magnitude == 0, 0.0, kept)
  return np.concatenate(payload), dense[: flat.size]


CODEC_CASES = {
  # name: (size, k, chunk_size, value_bits)
  "partial_last_chunk": (21, 3, 8, 2),
  "one_bit": (37, 4, 16, 1),
  "one_bit_odd_k": (50, 5, 16, 1),
  "four_bits": (64, 5, 16, 4),
  "eight_bits": (100, 7, 32, 8),
  "sparseloco": (10000, 64, 4096, 2),
  "short_leaf": (10, 4, 64, 2),
  "keep_all": (9, 8, 8, 2),
  "chunk_of_two": (5, 1, 2, 4),
  "sparse_input": (40, 6, 16, 1),
  "scalar": (1, 3, 8, 2),
  "float32_values": (100, 7, 32, 32),
  "bfloat16_values": (37, 4, 16, 16),
  "bfloat16_short_leaf": (10, 4, 64, 16),
  "float32_sparse_input": (40, 6, 16, 32),
}


def _codec_input(size, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(size) * 10.0 ** rng.integers(-2, 3)
  if size >= 16:
    x[: size // 4] = rng.integers(-2, 3, size // 4)  # ties, zeros, negatives
    x[size // 2 : size // 2 + 8] = 0.0  # a run of zeros
  if size == 40:  # fewer non-zeros than k in most chunks
    x[rng.permutation(size)[:30]] = 0.0
  return x.astype(np.float32)


@pytest.mark.parametrize("case", CODEC_CASES)
def test_encode_decode_match_the_numpy_reference_byte_for_byte(case):
  size, k, chunk_size, value_bits = CODEC_CASES[case]
  spec = shardopt.topk(k, chunk_size=chunk_size, value_bits=value_bits)
  for seed in range(3):
    x = _codec_input(size, seed)
    want_payload, want_dense = np_encode(x, k, chunk_size, value_bits)
    payload = np.asarray(jax.jit(sparse.encode, static_argnums=1)(x, spec))
    np.testing.assert_array_equal(payload, want_payload)
    dense = jax.jit(sparse.decode, static_argnums=(1, 2))(payload, spec, size)
    np.testing.assert_array_equal(np.asarray(dense), want_dense)


def _round_trip(x, spec):
  return jax.jit(
    lambda x: sparse.decode(sparse.encode(x, spec), spec, np.size(x))
  )(x)


def test_ties_go_to_the_lower_index_and_an_all_zero_chunk_decodes_to_zero():
  spec = shardopt.topk(2, chunk_size=8, value_bits=8)
  x = np.array([0, 3, 0, -3, 3, 0, 0, 0] + [0] * 8, np.float32)
  dense = np.asarray(_round_trip(x, spec))
  np.testing.assert_array_equal(dense, [0, 3, 0, -3] + [0] * 12)


def test_a_chunk_with_fewer_than_k_non_zeros_sends_exactly_them():
  spec = shardopt.topk(4, chunk_size=8, value_bits=2)
  x = np.array([0, 0, 3, 0, 0, 0, 0, -6] + [0] * 8, np.float32)
  np.testing.assert_array_equal(np.asarray(_round_trip(x, spec)), x)
  spec = shardopt.topk(3, chunk_size=4, value_bits=1)  # the mean of 2 and 2
  x = np.array([0, 2, -2, 0], np.float32)
  np.testing.assert_array_equal(np.asarray(_round_trip(x, spec)), x)


def test_a_non_finite_chunk_decodes_to_nan_at_its_k_entries():
  spec = shardopt.topk(2, chunk_size=4)
  x = np.array([1, np.nan, 2, 0, 5, 1, 0, 0], np.float32)
  dense = np.asarray(_round_trip(x, spec))
  assert np.isnan(dense[[1, 2]]).all() and (dense[[0, 3]] == 0).all()
  np.testing.assert_array_equal(dense[4:], [5, 2.5, 0, 0])  # levels 2.5, 5
  _, want = np_encode(x, 2, 4, 2)
  np.testing.assert_array_equal(dense, want)


@pytest.mark.parametrize("value_bits", RAW_BITS)
def test_raw_values_travel_as_they_are_nan_and_inf_included(value_bits):
  spec = shardopt.topk(2, chunk_size=4, value_bits=value_bits)
  x = np.array([1, np.nan, 2, 0, 5, -np.inf, 0, 0.25], np.float32)
  dense = np.asarray(_round_trip(x, spec))
  assert np.isnan(dense[1])
  np.testing.assert_array_equal(dense[[0, 2, 3]], [0, 2, 0])
  np.testing.assert_array_equal(dense[4:], [5, -np.inf, 0, 0])
  # 3 + 1/128 is a bfloat16 tie between 3 and 3 + 1/64: to even, 3.
  x = np.array([3 + 2.0**-7, 0, 0, 0], np.float32)
  want = 3.0 if value_bits == 16 else x[0]
  assert np.asarray(_round_trip(x, spec))[0] == want


@pytest.mark.parametrize("case", CODEC_CASES)
def test_the_residual_is_the_contribution_less_what_its_payload_decodes_to(
  case,
):
  """Error feedback's residual (computed as a select with the encoding's
  own arithmetic, not from the bytes) against the numpy codec, bit for bit:
  ties, zeros, chunks with fewer than k non-zeros, and a NaN and an inf in
  one chunk (whose residual is 0)."""
  size, k, chunk_size, value_bits = CODEC_CASES[case]
  spec = shardopt.topk(k, chunk_size=chunk_size, value_bits=value_bits)
  encode_whole = jax.jit(shardopt.wire.of(spec).encode_whole)
  for seed in range(3):
    x = _codec_input(size, seed)
    if seed == 2 and size >= 4:
      x[[1, 3]] = [np.nan, -np.inf]
    _, sent = np_encode(x, k, chunk_size, value_bits)
    with np.errstate(invalid="ignore"):
      want = x - sent
    want = np.where(np.isfinite(want), want, np.float32(0))
    _, (dropped,) = encode_whole([x])
    np.testing.assert_array_equal(
      np.asarray(dropped).view(np.uint32), want.view(np.uint32)
    )


@pytest.mark.parametrize("case", CODEC_CASES)
def test_payload_bytes_follow_the_formula(case):
  size, k, chunk_size, value_bits = CODEC_CASES[case]
  spec = shardopt.topk(k, chunk_size=chunk_size, value_bits=value_bits)
  want = np_formula_bytes(size, k, chunk_size, value_bits)
  assert sparse.payload_bytes(size, spec) == want
  shape = jax.eval_shape(
    lambda x: sparse.encode(x, spec), jax.ShapeDtypeStruct((size,), jnp.float32)
  ).shape
  assert shape == (want,)


# --------------------------------------------------------------------------
# cross_shard_mean on the wire against a numpy simulation.


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


SHAPES = {"kernel": (37, 29), "bias": (13,)}
K, CHUNK = 24, 256


def _gradients(steps, seed=0):
  """{leaf: (steps, N, *shape)} float32."""
  rng = np.random.default_rng(seed)
  return {
    name: rng.standard_normal((steps, N) + shape).astype(np.float32)
    for name, shape in SHAPES.items()
  }


def _transform_run(spec, grads, mapping, groups=None, reduction="mean"):
  """Every step's output and the last error, each with a replica axis."""
  make = (
    shardopt.cross_shard_mean
    if reduction == "mean"
    else shardopt.cross_shard_sum
  )
  tx = make(
    AXIS, axis_index_groups=groups, comm_dtype=spec, error_feedback=True
  )

  def run(tree):
    steps = tree["g"]  # (steps, ...) per leaf
    state = tx.init(jax.tree.map(lambda g: g[0], steps))
    if mapping == "shard_map_check_vma":  # per-replica state
      state = jax.tree.map(
        lambda s: jax.lax.pcast(s, AXIS, to="varying"), state
      )
    state, outputs = jax.lax.scan(
      lambda state, g: tx.update(g, state)[::-1], state, steps
    )
    return {"out": outputs, "error": state.error}

  per_replica = {"g": jax.tree.map(lambda g: np.moveaxis(g, 1, 0), grads)}
  out = _run(_mapped(run, mapping), mapping, per_replica)
  return out["out"], out["error"]  # out: (N, steps, ...)


def np_simulation(grads, k, chunk_size, value_bits, decay, groups, divide):
  """Each replica: e = decay e + g; sent = top-k of e; e -= sent; each
  group's members get sum(sent in member order) / group size."""
  steps = next(iter(grads.values())).shape[0]
  groups = groups or [list(range(N))]
  error = {n: np.zeros(g.shape[1:], np.float32) for n, g in grads.items()}
  outputs = {
    n: np.zeros((N, steps) + g.shape[2:], np.float32) for n, g in grads.items()
  }
  for t in range(steps):
    for name, g in grads.items():
      sent = np.zeros_like(error[name])
      for r in range(N):
        c = (
          g[t, r] + np.float32(decay) * error[name][r]
          if decay != 1
          else (g[t, r] + error[name][r])
        )
        _, dense = np_encode(c, k, chunk_size, value_bits)
        sent[r] = dense.reshape(c.shape)
        error[name][r] = c - sent[r]
      for group in groups:
        total = np.zeros_like(sent[0])
        for r in group:
          total = total + sent[r]
        if divide:
          total = total * np.float32(1.0 / len(group))
        for r in group:
          outputs[name][r, t] = total
  return outputs, error


@pytest.mark.parametrize("mapping", MAPPINGS)
@pytest.mark.parametrize("groups_name", GROUP_CASES)
@pytest.mark.parametrize(
  "decay, value_bits, reduction",
  [
    (1.0, 2, "mean"),
    pytest.param(0.5, 2, "sum", marks=SLOW),
    pytest.param(0.5, 1, "mean", marks=SLOW),
    pytest.param(1.0, 4, "mean", marks=SLOW),
    pytest.param(0.95, 2, "mean", marks=SLOW),
    pytest.param(1.0, 32, "mean", marks=SLOW),
    pytest.param(0.5, 16, "sum", marks=SLOW),
  ],
)
def test_cross_shard_matches_the_numpy_simulation_bit_for_bit(
  mapping, groups_name, decay, value_bits, reduction
):
  """Decays 1 and 0.5 make ``decay * e`` exact, so a fused multiply-add
  (XLA's) and numpy's multiply then add agree to the bit; at 0.95 the
  error buffers may differ by an ulp (what was sent, coarse, does not)."""
  groups = GROUPS[groups_name]
  grads = _gradients(steps=4, seed=value_bits)
  spec = shardopt.topk(
    K, chunk_size=CHUNK, value_bits=value_bits, error_decay=decay
  )
  out, error = _transform_run(spec, grads, mapping, groups, reduction)
  want_out, want_error = np_simulation(
    grads, K, CHUNK, value_bits, decay, groups, reduction == "mean"
  )
  for name in SHAPES:
    np.testing.assert_array_equal(out[name], want_out[name], err_msg=name)
    if decay in (1.0, 0.5):
      np.testing.assert_array_equal(error[name], want_error[name], name)
    else:
      np.testing.assert_allclose(error[name], want_error[name], atol=2e-6)


@pytest.mark.parametrize("mapping", MAPPINGS)
@pytest.mark.parametrize("groups_name", GROUP_CASES)
def test_members_beyond_the_unrolled_ones_are_added_in_a_loop_same_bits(
  monkeypatch, mapping, groups_name
):
  """Past ``UNROLLED_MEMBERS`` members the payloads are added in a
  ``fori_loop``, one member at a time in member order: the numpy
  simulation's bits still (here with the limit lowered to 1, so the 8 or 4
  members of a group take the loop)."""
  monkeypatch.setattr(sparse, "UNROLLED_MEMBERS", 1)
  groups = GROUPS[groups_name]
  grads = _gradients(steps=3, seed=11)
  spec = shardopt.topk(K, chunk_size=CHUNK, value_bits=2, error_decay=1.0)
  out, error = _transform_run(spec, grads, mapping, groups)
  want_out, want_error = np_simulation(grads, K, CHUNK, 2, 1.0, groups, True)
  for name in SHAPES:
    np.testing.assert_array_equal(out[name], want_out[name], err_msg=name)
    np.testing.assert_array_equal(error[name], want_error[name], name)


@pytest.mark.parametrize("unrolled", [8, 1], ids=["unrolled", "loop"])
def test_the_program_holds_one_member_s_scatter_past_the_unrolled_ones(
  monkeypatch, unrolled
):
  """The compiled update of 8 members holds a scatter-add per member when
  unrolled, one (in a ``while`` loop's body, after the first member's)
  past the limit: the program does not grow with the group."""
  from benchmarks.perf import wire_cost

  monkeypatch.setattr(sparse, "UNROLLED_MEMBERS", unrolled)
  spec = shardopt.topk(K, chunk_size=CHUNK)
  text = wire_cost.compiled_update(spec, True, [(1024,)], _mesh()).as_text()
  adds = len(re.findall(r"= f32\[\d+\]\{0\} scatter\(", text))
  loops = len(re.findall(r" while\(", text))
  if unrolled == 8:
    assert (adds, loops) == (N, 0), (adds, loops)
  else:
    assert (adds, loops) == (2, 1), (adds, loops)


@pytest.mark.parametrize("count", [False, True], ids=["sum", "senders"])
def test_the_loop_and_the_unrolled_sum_give_the_same_bits(monkeypatch, count):
  """``_sum_payloads`` on random payloads of 8 members, some rows left out
  (``keep``), with and without the count of senders (DeMo's mean over
  senders): the loop's bits are the unrolled sum's."""
  spec = shardopt.topk(K, chunk_size=CHUNK)
  rng = np.random.default_rng(5)
  leaves = [
    jnp.asarray(rng.standard_normal((N, 700)).astype(np.float32)),
    jnp.asarray(rng.standard_normal((N, 37)).astype(np.float32)),
  ]
  layouts = [sparse.layout(700, spec), sparse.layout(37, spec)]
  payloads = jax.vmap(lambda *xs: sparse._encode_leaves(list(xs), spec)[3])(
    *leaves
  )
  keep = jnp.asarray([True, False, True, True, True, False, True, True])

  def summed(limit):
    monkeypatch.setattr(sparse, "UNROLLED_MEMBERS", limit)
    return jax.jit(
      lambda g, k: sparse._sum_payloads(g, layouts, spec, k, count=count)
    )(payloads, keep)

  unrolled, looped = summed(8), summed(1)
  assert unrolled[1] == looped[1]  # the starts
  chex.assert_trees_all_equal(unrolled[0], looped[0])
  if count:
    chex.assert_trees_all_equal(unrolled[2], looped[2])
    assert float(jnp.max(unrolled[2])) >= 2  # some entry from several


def test_one_trace_decodes_every_member_s_payload(monkeypatch):
  """8 members' payloads, added unrolled: one member's decoding is traced
  once and reused for the others (it was traced per member, 8 times)."""
  spec = shardopt.topk(K, chunk_size=CHUNK)
  layouts = [sparse.layout(700, spec), sparse.layout(37, spec)]
  width = sum(lay.chunks * lay.bytes_per_chunk(spec) for lay in layouts)
  traced, decode = [], sparse._decode_member

  def counting(*args, **kwargs):
    traced.append(1)
    return decode(*args, **kwargs)

  monkeypatch.setattr(sparse, "_decode_member", counting)
  gathered = jax.ShapeDtypeStruct((N, width), jnp.uint8)
  jax.jit(lambda g: sparse._sum_payloads(g, layouts, spec, None)).lower(
    gathered
  )
  assert len(traced) == 1, len(traced)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_every_replica_gets_the_same_bits_at_the_default_decay(mapping):
  grads = _gradients(steps=3, seed=7)
  out, _ = _transform_run(shardopt.topk(K, chunk_size=CHUNK), grads, mapping)
  for name in SHAPES:
    np.testing.assert_array_equal(
      out[name], np.broadcast_to(out[name][0], out[name].shape)
    )


@pytest.mark.parametrize(
  "decay", [0.95, pytest.param(1.0, marks=SLOW), pytest.param(0.8, marks=SLOW)]
)
def test_what_was_sent_plus_the_last_error_is_what_came_in(decay):
  """sum_t decay^(T - t) (sum_j sent_j,t) + sum_j error_j,T = sum_t
  decay^(T - t) sum_j g_j,t: nothing is lost, only delayed (and decayed).
  With 8 members, 8 x mean is the exact sum of what was sent."""
  steps = 6
  grads = _gradients(steps=steps, seed=11)
  spec = shardopt.topk(K, chunk_size=CHUNK, value_bits=2, error_decay=decay)
  out, error = _transform_run(spec, grads, "pmap")
  weights = decay ** np.arange(steps - 1, -1, -1, dtype=np.float64)
  for name, g in grads.items():
    sent = N * out[name][0].astype(np.float64)  # (steps, ...)
    lhs = np.tensordot(weights, sent, 1) + error[name].astype(np.float64).sum(0)
    rhs = np.tensordot(weights, g.astype(np.float64).sum(1), 1)
    np.testing.assert_allclose(lhs, rhs, rtol=0, atol=2e-5 * np.abs(rhs).max())
    # Most of it went: the error buffers are not the whole input.
    assert np.abs(sent).sum() > 0.3 * np.abs(rhs).sum()


# --------------------------------------------------------------------------
# The periodic family on the wire: centers bit-identical within groups.


PERIODIC = {
  "local_sgd": lambda **kw: shardopt.local_sgd(
    optax.sgd(0.1), AXIS, sync_period=2, **kw
  ),
  "diloco": lambda **kw: shardopt.diloco(
    optax.adam(0.05), AXIS, sync_period=2, outer_momentum=0.5, **kw
  ),
  "agn": lambda **kw: shardopt.agn(optax.sgd(0.1), AXIS, sync_period=2, **kw),
}


@pytest.mark.parametrize("groups_name", GROUP_CASES)
@pytest.mark.parametrize(
  "name",
  [
    "diloco",
    pytest.param("local_sgd", marks=SLOW),
    pytest.param("agn", marks=SLOW),
  ],
)
def test_periodic_centers_are_bit_identical_within_groups(name, groups_name):
  groups = GROUPS[groups_name]
  tx = PERIODIC[name](
    axis_index_groups=groups,
    comm_dtype=shardopt.topk(8, chunk_size=64),
    error_feedback=True,
  )
  rng = np.random.default_rng(2)
  params = {
    "w": rng.standard_normal((N, 16, 12)).astype(np.float32),
    "b": np.zeros((N, 12), np.float32),
  }
  params = jax.tree.map(lambda p: np.broadcast_to(p[:1], p.shape), params)
  grads = jax.tree.map(
    lambda p: rng.standard_normal((5,) + p.shape).astype(np.float32), params
  )

  def run(params, grads):
    state = tx.init(params)

    def step(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(step, (params, state), grads)
    return params, state

  steps = jax.tree.map(lambda g: np.moveaxis(g, 1, 0), grads)
  _, state = jax.pmap(run, axis_name=AXIS)(params, steps)
  assert int(state.sync_count[0]) == 2
  center = jax.tree.map(np.asarray, state.center)
  for group in groups or [list(range(N))]:
    for r in group[1:]:
      chex.assert_trees_all_equal(
        jax.tree.map(lambda c, g=group: c[g[0]], center),
        jax.tree.map(lambda c, r=r: c[r], center),
      )
  start = jax.tree.map(lambda p: p[0], params)
  assert not np.array_equal(center["w"][0], start["w"])  # it moved
  if groups is not None:  # the groups saw different data
    assert not np.array_equal(center["w"][0], center["w"][1])
  error = np.asarray(state.error["w"])
  assert np.isfinite(error).all() and np.abs(error).max() > 0


# --------------------------------------------------------------------------
# The bytes on the wire, from the compiled HLO.

_COLLECTIVE = re.compile(
  r"=\s*(\w+)\[([\d,]*)\][^=]*?\s(all-gather|all-reduce|reduce-scatter"
  r"|all-to-all|collective-permute)(?:-start)?\("
)


def _collectives(hlo):
  """(kind, dtype, elements) of every collective of a compiled HLO text."""
  found = []
  for dtype, dims, kind in _COLLECTIVE.findall(hlo):
    elements = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    found.append((kind, dtype, elements))
  return found


@SLOW  # HLO structure, not numbers
@pytest.mark.parametrize("mapping", ["pmap", "shard_map_check_vma"])
def test_the_compiled_step_gathers_the_payload_bytes_once(mapping):
  spec = shardopt.topk(16, chunk_size=256, value_bits=2)
  tx = shardopt.cross_shard_mean(AXIS, comm_dtype=spec, error_feedback=True)
  shapes = {"w": (40, 25), "b": (210,)}
  grads = {k: jnp.zeros((N,) + s, jnp.float32) for k, s in shapes.items()}

  def update(g, s):
    return tx.update(g, s)

  if mapping == "pmap":
    state = jax.pmap(tx.init, axis_name=AXIS)(grads)
    compiled = jax.pmap(update, axis_name=AXIS).lower(grads, state).compile()
  else:
    g_spec = {k: P(AXIS) for k in shapes}
    s_spec = shardopt.ErrorFeedbackState(g_spec, P())
    f = jax.jit(
      jax.shard_map(
        lambda g, s: update(jax.tree.map(lambda x: x[0], g), s),
        mesh=_mesh(),
        in_specs=(g_spec, s_spec),
        out_specs=(P(), s_spec),
      )
    )
    flat = {k: jnp.zeros((N * s[0],) + s[1:]) for k, s in shapes.items()}
    state = shardopt.ErrorFeedbackState(flat, optax.EmptyState())
    compiled = f.lower(_shard(grads), _shard(state)).compile()
  found = _collectives(compiled.as_text())
  payload = sum(
    np_formula_bytes(int(np.prod(s)), 16, 256, 2) for s in shapes.values()
  )
  assert found == [("all-gather", "u8", N * payload)], found
  dense = sum(int(np.prod(s)) for s in shapes.values()) * 4
  assert payload * 20 < dense  # the wire's point: 1/20 of the float32 bytes


# --------------------------------------------------------------------------
# Inside model-parallel replicas.


@SLOW  # a model-parallel training run
def test_model_parallel_replicas_are_bit_identical_on_the_wire():
  """A (data=4, model=2) mesh, params sharded over "model" (Auto), the
  top-k wire over "data": every data replica holds the same bits."""
  make_tx = lambda: shardopt.cross_shard(
    optax.adam(0.05),
    "data",
    comm_dtype=shardopt.topk(16, chunk_size=128),
    error_feedback=True,
  )
  history, _, state = train(
    make_tx, make_mesh({"data": 4, "model": 2}), ("data",)
  )
  for params in history:
    for name, value in params.items():
      np.testing.assert_array_equal(
        value, np.broadcast_to(value[0], value.shape), err_msg=name
      )
  assert not np.array_equal(history[0]["w1"][0], history[-1]["w1"][0])
  error = np.asarray(state.error["w1"])
  assert np.isfinite(error).all() and np.abs(error).max() > 0


# --------------------------------------------------------------------------
# Bad arguments: clear errors that name the argument and the fix.


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"k": 0}, r"shardopt\.topk: k=0 must be an integer with 1 <= k"),
    ({"k": 5000}, r"k=5000 .*chunk_size \(4096\)"),
    ({"k": 2.0}, r"k=2\.0 must be an integer"),
    ({"k": True}, r"k=True must be an integer"),
    ({"k": 1, "chunk_size": 1}, r"chunk_size=1 must be an integer >= 2"),
    ({"k": 4, "value_bits": 3}, r"value_bits=3 is not supported.*1, 2, 4, 8"),
    ({"k": 4, "error_decay": 0}, r"error_decay=0 must be .*0 < error_decay"),
    ({"k": 4, "error_decay": 1.5}, r"error_decay=1\.5 must be"),
    ({"k": 4, "error_decay": float("nan")}, r"error_decay=nan"),
  ],
)
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, match):
  k = kwargs.pop("k")
  with pytest.raises(ValueError, match=match):
    shardopt.topk(k, **kwargs)


def test_topk_without_error_feedback_is_refused_where_it_is_built():
  spec = shardopt.topk(4)
  match = r"error_feedback=False.*needs error_feedback=True"
  with pytest.raises(ValueError, match="cross_shard_mean: .*" + match):
    shardopt.cross_shard_mean(AXIS, comm_dtype=spec)
  with pytest.raises(ValueError, match="cross_shard: .*" + match):
    shardopt.cross_shard(optax.sgd(1.0), AXIS, comm_dtype=spec)
  for name in PERIODIC:
    with pytest.raises(ValueError, match=f"{name}: .*" + match):
      PERIODIC[name](comm_dtype=spec)
  with pytest.raises(ValueError, match="hierarchical_local_sgd: .*" + match):
    shardopt.hierarchical_local_sgd(
      optax.sgd(1.0), AXIS, period_group_sizes={2: 8}, comm_dtype=spec
    )


def test_stateless_reduce_refuses_topk_and_names_the_stateful_transforms():
  f = jax.pmap(
    lambda g: shardopt.reduce(g, AXIS, comm_dtype=shardopt.topk(2)),
    axis_name=AXIS,
  )
  with pytest.raises(ValueError, match=r"shardopt\.reduce: .*needs error"):
    f(np.zeros((N, 16), np.float32))
  with pytest.raises(ValueError, match=r"cross_shard_mean\(axis, comm_dtype="):
    f(np.zeros((N, 16), np.float32))


def test_tower_and_powersgd_refuse_topk():
  """(shardopt.elastic takes it: tests/test_elastic_rounds.py.)"""
  spec = shardopt.topk(4)
  with pytest.raises(NotImplementedError, match=r"shardopt\.tower: .*top-k"):
    shardopt.tower(optax.sgd(1.0), AXIS, comm_dtype=spec)
  with pytest.raises(ValueError, match=r"shardopt\.powersgd: .*top-k"):
    shardopt.powersgd(AXIS, rank=2, comm_dtype=spec)
