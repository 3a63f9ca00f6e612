"""DeMo (``decoupled_momentum``) against a numpy run of the paper's steps.

The reference (``np_demo``) follows Algorithm 1 of arXiv 2411.19870 and the
tiling of its code (github bloc97/DeMo) in float64, in parameter space, with
nothing of the implementation: per replica ``m = decay m + g``; the tiles'
DCT (``scipy.fft.dct(..., norm="ortho")`` along both tile axes); the ``k``
coefficients of largest magnitude per tile; ``m -= IDCT(selected)``; ``Q``
the mean over the replicas of ``IDCT(selected)``; ``sign(Q)``. The
implementation keeps its momentum in the DCT domain as the sparse wire's
error buffer (decayed by ``decay``): matching the reference's ``Q`` and
momentum checks that algebra. The data are drawn so that no tile has a
near-tie at its k-th coefficient (asserted), so float32 and float64 select
the same ones.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.fft
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.decoupled import DecoupledMomentumState
from shardopt.decoupled import decoupled_momentum
from shardopt.measure import hlo

N = 8
AXIS = "batch"
SHAPES = {
  "kernel": (16, 24),  # 8 x 8 tiles
  "bias": (12,),  # runs of 6 (the largest divisor of 12 up to 8)
  "odd": (5, 7),  # one 5 x 7 tile
  "conv": (2, 3, 16),  # a (6, 16) matrix: 6 x 8 tiles
  "prime": (11,),  # 11 > 8 is prime: tiles of 1, every entry sent
  "scalar": (),
}
CHUNK, K, DECAY, STEPS = 8, 3, 0.9, 4


# --------------------------------------------------------------------------
# The numpy reference.


def np_side(length, chunk):
  """The reference code's ``_get_smaller_split``: among the sorted divisors
  of ``length``, ``chunk`` itself, else the one before the first above it,
  else ``length``."""
  divisors = [d for d in range(1, length + 1) if length % d == 0]
  for i, d in enumerate(divisors):
    if d == chunk:
      return d
    if d > chunk:
      return divisors[i - 1] if i else d
  return length


def np_matrix(shape):
  if len(shape) < 2:
    return 1, (shape[0] if shape else 1)
  return int(np.prod(shape[:-1])), shape[-1]


def np_tiles_dct(x, chunk=CHUNK):
  """A leaf -> its ``(tiles, tile)`` DCT coefficients, the tile grid and
  the in-tile order row-major."""
  rows, cols = np_matrix(np.shape(x))
  a, b = np_side(rows, chunk), np_side(cols, chunk)
  t = np.reshape(x, (rows // a, a, cols // b, b)).transpose(0, 2, 1, 3)
  t = scipy.fft.dct(
    scipy.fft.dct(t, norm="ortho", axis=2), norm="ortho", axis=3
  )
  return t.reshape(-1, a * b)


def np_from_tiles(t, shape, chunk=CHUNK):
  """Inverse of :func:`np_tiles_dct`: a leaf of ``shape``."""
  rows, cols = np_matrix(shape)
  a, b = np_side(rows, chunk), np_side(cols, chunk)
  t = np.reshape(t, (rows // a, cols // b, a, b))
  t = scipy.fft.idct(
    scipy.fft.idct(t, norm="ortho", axis=2), norm="ortho", axis=3
  )
  return t.transpose(0, 2, 1, 3).reshape(shape)


def np_demo(grads, k, chunk, decay, groups=None, mean="replicas"):
  """Per step the update ``Q`` (before the sign) of every replica, and the
  final momentum of every replica in parameter space. ``mean="senders"``:
  the DeMo authors' rule (their ``decompress``: ``scatter_reduce(...,
  reduce="mean", include_self=False)`` over the gathered coefficients):
  each DCT coefficient is the mean over the replicas that sent it, 0 where
  none did."""
  groups = groups or [list(range(N))]
  steps = next(iter(grads.values())).shape[0]
  momentum = {n: np.zeros(g.shape[1:]) for n, g in grads.items()}
  out = {
    n: np.zeros(g.shape[1:2] + g.shape[:1] + g.shape[2:])
    for n, g in grads.items()
  }
  margin = np.inf
  for t in range(steps):
    for name, g in grads.items():
      sent = np.zeros_like(momentum[name])
      coefficients_sent, senders = [], []
      for r in range(N):
        m = decay * momentum[name][r] + g[t, r].astype(np.float64)
        c = np_tiles_dct(m, chunk)
        keep = min(k, c.shape[1])
        selected = np.zeros_like(c)
        for row, coefficients in enumerate(c):
          order = np.argsort(-np.abs(coefficients), kind="stable")
          selected[row, order[:keep]] = coefficients[order[:keep]]
          if keep < len(order):  # how far the k-th is from the next one
            gap = np.abs(coefficients[order[keep - 1]]) - np.abs(
              coefficients[order[keep]]
            )
            margin = min(margin, gap)
        sent[r] = np_from_tiles(selected, m.shape, chunk)
        momentum[name][r] = m - sent[r]
        coefficients_sent.append(selected)
        went = np.zeros(c.shape, bool)
        for row, coefficients in enumerate(c):
          order = np.argsort(-np.abs(coefficients), kind="stable")
          went[row, order[:keep]] = True
        senders.append(went)
      for group in groups:
        if mean == "senders":
          total = sum(coefficients_sent[r] for r in group)
          count = sum(senders[r].astype(np.float64) for r in group)
          averaged = np.where(count > 0, total / np.maximum(count, 1), 0.0)
          update = np_from_tiles(averaged, sent.shape[1:], chunk)
        else:
          update = sent[group].mean(0)
        for r in group:
          out[name][r, t] = update
  assert margin > 1e-4, f"a near-tie at a k-th coefficient ({margin})"
  return out, momentum


def _gradients(seed=0):
  """{leaf: (steps, N, *shape)} float32, a different gradient per replica."""
  rng = np.random.default_rng(seed)
  return {
    name: rng.standard_normal((STEPS, N) + shape).astype(np.float32)
    for name, shape in SHAPES.items()
  }


# --------------------------------------------------------------------------
# Running the transform: pmap, a checking shard_map, or vmap.


def _mesh():
  return jax.make_mesh((N,), (AXIS,))


def _mapped(per_replica, mapping):
  if mapping == "pmap":
    return jax.pmap(per_replica, axis_name=AXIS)
  if mapping == "vmap":  # the studies' replicas on one device
    return jax.jit(jax.vmap(per_replica, axis_name=AXIS))

  def body(tree):
    out = per_replica(jax.tree.map(lambda x: x[0], tree))
    return jax.tree.map(lambda x: x[None], out)

  return jax.jit(
    jax.shard_map(body, mesh=_mesh(), in_specs=P(AXIS), out_specs=P(AXIS))
  )


def _run(tx, grads, mapping):
  """Every step's updates and the final state, each with a replica axis."""

  def run(steps):
    state = tx.init(jax.tree.map(lambda g: g[0], steps))
    if mapping == "shard_map":  # per-replica state
      state = jax.tree.map(
        lambda s: jax.lax.pcast(s, AXIS, to="varying"), state
      )
    state, outputs = jax.lax.scan(
      lambda state, g: tx.update(g, state)[::-1], state, steps
    )
    return {"out": outputs, "state": state}

  per_replica = jax.tree.map(lambda g: np.moveaxis(g, 1, 0), grads)
  if mapping == "shard_map":
    per_replica = jax.device_put(per_replica, NamedSharding(_mesh(), P(AXIS)))
  out = jax.device_get(_mapped(run, mapping)(per_replica))
  return out["out"], out["state"]  # out: (N, steps, ...)


# --------------------------------------------------------------------------
# The paper's algorithm.


def test_the_reference_dct_is_the_orthonormal_dct_ii():
  """Its basis against the formula: C[u, a] = w_u cos(pi (2a + 1) u / 2s)."""
  s = 6
  a = np.arange(s)
  want = np.cos(np.pi * (2 * a + 1) * a[:, None] / (2 * s)) * np.sqrt(2 / s)
  want[0] /= np.sqrt(2)
  np.testing.assert_allclose(
    scipy.fft.dct(np.eye(s), norm="ortho", axis=0), want, atol=1e-12
  )
  assert [np_side(n, 8) for n in (16, 12, 5, 11, 1, 100)] == [8, 6, 5, 1, 1, 5]


@pytest.mark.parametrize("mapping", ["pmap", "shard_map", "vmap"])
def test_updates_and_momentum_match_the_papers_steps_in_numpy(mapping):
  grads = _gradients(seed=1)
  want_q, want_m = np_demo(grads, K, CHUNK, DECAY)
  tx = decoupled_momentum(AXIS, k=K, chunk_size=CHUNK, decay=DECAY, sign=False)
  q, state = _run(tx, grads, mapping)
  for name in SHAPES:
    scale = np.abs(want_q[name]).max()
    np.testing.assert_allclose(
      q[name], want_q[name], rtol=0, atol=1e-6 * scale, err_msg=name
    )
    momentum = np.stack([np_tiles_dct(want_m[name][r]) for r in range(N)])
    np.testing.assert_allclose(
      state.momentum[name],
      momentum,
      rtol=0,
      atol=1e-6 * max(np.abs(momentum).max(), 1.0),  # prime: all sent
      err_msg=name,
    )
  # Most of every tile's momentum stayed (k of 64), and was not synchronized.
  assert not np.allclose(
    state.momentum["kernel"][0], state.momentum["kernel"][1]
  )
  assert (q["prime"] != 0).all()  # tiles of 1: everything went

  tx = decoupled_momentum(AXIS, k=K, chunk_size=CHUNK, decay=DECAY)
  signs, _ = _run(tx, grads, mapping)
  for name in SHAPES:
    np.testing.assert_array_equal(signs[name], np.sign(want_q[name]), name)


def test_groups_exchange_on_their_own():
  groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
  grads = _gradients(seed=2)
  want_q, _ = np_demo(grads, K, CHUNK, DECAY, groups)
  tx = decoupled_momentum(
    AXIS,
    k=K,
    chunk_size=CHUNK,
    decay=DECAY,
    sign=False,
    axis_index_groups=groups,
  )
  q, _ = _run(tx, grads, "pmap")
  for name in SHAPES:
    scale = np.abs(want_q[name]).max()
    np.testing.assert_allclose(q[name], want_q[name], atol=1e-6 * scale)
  assert not np.array_equal(q["kernel"][0], q["kernel"][1])


@pytest.mark.parametrize("mapping", ["pmap", "shard_map", "vmap"])
def test_the_senders_mean_matches_the_authors_rule_in_numpy(mapping):
  """mean="senders" against np_demo(..., mean="senders") (float64), to
  float32 rounding (atol 1e-6 of the largest |Q|), over 4 steps and every
  leaf; the momentum is the default's (what each replica sent does not
  depend on how the others' are averaged); the signs differ from the
  default rule's where replicas chose different coefficients."""
  grads = _gradients(seed=1)
  want_q, want_m = np_demo(grads, K, CHUNK, DECAY, mean="senders")
  tx = decoupled_momentum(
    AXIS, k=K, chunk_size=CHUNK, decay=DECAY, sign=False, mean="senders"
  )
  q, state = _run(tx, grads, mapping)
  for name in SHAPES:
    scale = np.abs(want_q[name]).max()
    np.testing.assert_allclose(
      q[name], want_q[name], rtol=0, atol=1e-6 * scale, err_msg=name
    )
    momentum = np.stack([np_tiles_dct(want_m[name][r]) for r in range(N)])
    np.testing.assert_allclose(
      state.momentum[name],
      momentum,
      rtol=0,
      atol=1e-6 * max(np.abs(momentum).max(), 1.0),
      err_msg=name,
    )
    for r in range(1, N):
      chex.assert_trees_all_equal(q[name][0], q[name][r])
  signs, _ = _run(
    decoupled_momentum(
      AXIS, k=K, chunk_size=CHUNK, decay=DECAY, mean="senders"
    ),
    grads,
    mapping,
  )
  for name in SHAPES:
    np.testing.assert_array_equal(signs[name], np.sign(want_q[name]), name)
  # The two rules' sign steps differ (kernel: 3 of 64 per tile, 8 replicas).
  default_q, _ = np_demo(grads, K, CHUNK, DECAY)
  differ = np.mean(np.sign(default_q["kernel"]) != np.sign(want_q["kernel"]))
  assert 0.01 < differ < 0.5, differ


def test_the_senders_mean_in_groups_and_with_one_choice_is_the_default():
  """Groups average over their own senders; when every replica sends the
  same coefficients (the same gradient), each was sent by all, and the
  two rules give the same update."""
  groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
  grads = _gradients(seed=2)
  want_q, _ = np_demo(grads, K, CHUNK, DECAY, groups, mean="senders")
  tx = decoupled_momentum(
    AXIS,
    k=K,
    chunk_size=CHUNK,
    decay=DECAY,
    sign=False,
    axis_index_groups=groups,
    mean="senders",
  )
  q, _ = _run(tx, grads, "pmap")
  for name in SHAPES:
    scale = np.abs(want_q[name]).max()
    np.testing.assert_allclose(q[name], want_q[name], atol=1e-6 * scale)
  same = jax.tree.map(lambda g: np.repeat(g[:, :1], N, axis=1), grads)
  by_rule = {
    mean: _run(
      decoupled_momentum(
        AXIS, k=K, chunk_size=CHUNK, decay=DECAY, sign=False, mean=mean
      ),
      same,
      "pmap",
    )[0]
    for mean in ("replicas", "senders")
  }
  for name in SHAPES:
    np.testing.assert_allclose(
      by_rule["senders"][name],
      by_rule["replicas"][name],
      rtol=0,
      atol=1e-6 * np.abs(by_rule["replicas"][name]).max(),
    )


def test_a_bfloat16_wire_keeps_its_rounding_in_the_momentum():
  """value_bits=16: what was sent is the bfloat16 of the coefficient; the
  momentum keeps the rest, so sent + kept = the momentum's coefficients."""
  grads = _gradients(seed=3)
  tx32 = decoupled_momentum(AXIS, k=K, chunk_size=CHUNK, decay=0.0, sign=False)
  tx16 = decoupled_momentum(
    AXIS, k=K, chunk_size=CHUNK, decay=0.0, sign=False, value_bits=16
  )
  one = jax.tree.map(lambda g: g[:1], grads)
  q32, m32 = _run(tx32, one, "pmap")
  q16, m16 = _run(tx16, one, "pmap")
  for name in ("kernel", "bias"):
    assert not np.array_equal(q16[name], q32[name])
    np.testing.assert_allclose(q16[name], q32[name], rtol=0, atol=2e-2)
    # decay 0: the momentum is this step's gradient; bfloat16 rounding stays
    kept = m16.momentum[name] - m32.momentum[name]
    assert 0 < np.abs(kept).max() < 2e-2


# --------------------------------------------------------------------------
# Identity, composition, bytes.


@pytest.mark.parametrize("mapping", ["pmap", "shard_map", "vmap"])
def test_every_replica_gets_the_same_bits(mapping):
  grads = {"w": np.random.default_rng(4).standard_normal((3, N, 128, 96))}
  grads = jax.tree.map(lambda g: g.astype(np.float32), grads)
  tx = decoupled_momentum(AXIS, sign=False)  # the paper's defaults
  q, _ = _run(tx, grads, mapping)
  for r in range(1, N):
    chex.assert_trees_all_equal(q["w"][0], q["w"][r])
  assert np.abs(q["w"]).max() > 0


def test_a_chain_with_a_learning_rate_takes_the_sign_step_with_weight_decay():
  """The reference code's step: p (1 - lr wd) - lr sign(Q)."""
  lr, wd = 0.01, 0.1
  tx = optax.chain(
    decoupled_momentum(AXIS, k=K, chunk_size=CHUNK),
    optax.add_decayed_weights(wd),
    optax.scale_by_learning_rate(lr),
  )
  rng = np.random.default_rng(5)
  params = {"w": np.broadcast_to(rng.standard_normal((16, 24)), (N, 16, 24))}
  params = jax.tree.map(lambda p: p.astype(np.float32), params)
  grads = {"w": rng.standard_normal((N, 16, 24)).astype(np.float32)}

  def step(p, g):
    updates, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, updates), shardopt.replica_divergence(
      optax.apply_updates(p, updates), AXIS
    )

  new, divergence = jax.pmap(step, axis_name=AXIS)(params, grads)
  want_q, _ = np_demo({"w": grads["w"][None]}, K, CHUNK, 0.999)
  want = params["w"][0] * (1 - lr * wd) - lr * np.sign(want_q["w"][0, 0])
  np.testing.assert_allclose(new["w"][0], want, rtol=0, atol=1e-6)
  assert float(divergence[0]) == 0.0


def _payload_bytes(shape, k, chunk, value_bits):
  """By hand: per tile, k' = min(k, tile) indices at ceil(log2(tile)) bits,
  then k' values at value_bits (no scale at 16 or 32 bits)."""
  rows, cols = np_matrix(shape)
  a, b = np_side(rows, chunk), np_side(cols, chunk)
  tile, tiles = a * b, (rows // a) * (cols // b)
  keep = min(k, tile)
  index_bits = max(1, int(np.ceil(np.log2(tile))))
  per_tile = -(-keep * index_bits // 8) + -(-keep * value_bits // 8)
  return tiles * (per_tile + (0 if value_bits >= 16 else 4))


def _step_and_arguments(tx, shapes, mapping):
  """A compiled-ready step of ``tx`` over zero gradients of ``shapes`` and
  its arguments (pmap, or a checking shard_map with the state's specs)."""
  grads = {n: jnp.zeros((N,) + s, jnp.float32) for n, s in shapes.items()}
  if mapping == "pmap":
    state = jax.pmap(tx.init)(grads)
    return jax.pmap(tx.update, axis_name=AXIS), (grads, state)
  specs = shardopt.state_specs(
    tx,
    {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes.items()},
    AXIS,
    mesh=_mesh(),
  )
  assert specs == DecoupledMomentumState({n: P(AXIS) for n in shapes})
  step = jax.jit(
    jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
      mesh=_mesh(),
      in_specs=(P(AXIS), specs),
      out_specs=(P(), specs),
    )
  )
  state = jax.eval_shape(jax.pmap(tx.init), grads)
  state = jax.tree.map(
    lambda s: jnp.zeros((N * s.shape[1],) + s.shape[2:], s.dtype), state
  )
  return step, jax.device_put((grads, state), NamedSharding(_mesh(), P(AXIS)))


@pytest.mark.parametrize("mean", ["replicas", "senders"])
@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_the_compiled_step_gathers_the_payload_once(mapping, mean):
  """At the paper's defaults (64 x 64 tiles, k = 32, float32): a 128 x 192
  kernel is 6 tiles of 48 + 128 bytes, a 192 bias 3 runs of 64, each of 24
  + 128 bytes: 1,512 bytes per replica, one all-gather; the same with
  mean="senders" (its counts come from the gathered indices)."""
  shapes = {"kernel": (128, 192), "bias": (192,)}
  assert [_payload_bytes(s, 32, 64, 32) for s in shapes.values()] == [
    6 * (48 + 128),
    3 * (24 + 128),
  ]
  payload = 6 * 176 + 3 * 152
  step, args = _step_and_arguments(
    decoupled_momentum(AXIS, mean=mean), shapes, mapping
  )
  traffic = shardopt.measure.traffic(step, *args)
  assert [(c.kind, c.dtypes) for c in traffic.collectives] == [
    ("all-gather", ("uint8",))
  ]
  assert traffic.collectives[0].buffer_bytes == N * payload
  assert traffic.per_step == (N - 1) * payload
  dense = sum(int(np.prod(s)) for s in shapes.values()) * 4
  assert 2 * (N - 1) / N * dense > 15 * traffic.per_step  # 16.4x


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_the_senders_mean_adds_no_collective_and_no_byte(mapping):
  """mean="senders" against the default in the compiled HLO: the same
  collectives (kind, replica groups, dtypes, bytes), collective for
  collective, and no conditional."""
  shapes = {"kernel": (128, 192), "bias": (192,), "odd": (5, 7)}
  read = {}
  for mean in ("replicas", "senders"):
    step, args = _step_and_arguments(
      decoupled_momentum(AXIS, mean=mean), shapes, mapping
    )
    read[mean] = shardopt.measure.traffic(step, *args)
  assert read["senders"].collectives == read["replicas"].collectives
  assert read["senders"].per_step == read["replicas"].per_step > 0
  assert len(read["senders"].collectives) == 1
  step, args = _step_and_arguments(
    decoupled_momentum(AXIS, mean="senders"), shapes, mapping
  )
  text = step.lower(*args).compile().as_text()
  ops = hlo.compiled_collectives(text, num_devices=N)
  assert [(op.kind, op.context) for op in ops] == [("all-gather", "top")]


# --------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (
      {"k": 0},
      r"decoupled_momentum: k=0 \(axis 'batch'\) must be an integer >= 1",
    ),
    ({"k": 2.0}, r"k=2\.0 .*must be an integer"),
    ({"k": True}, r"k=True"),
    ({"chunk_size": 0}, r"chunk_size=0 .*integer >= 1.*chunk_size=64"),
    ({"decay": 1.0}, r"decay=1\.0 .*0 <= decay < 1.*decay=0\.999"),
    ({"decay": -0.1}, r"decay=-0\.1"),
    ({"decay": float("nan")}, r"decay=nan"),
    ({"decay": True}, r"decay=True"),
    ({"value_bits": 3}, r"value_bits=3 .*is not supported.*16, 32"),
    (
      {"mean": "sum"},
      r"mean='sum' \(axis 'batch'\) is not supported.*'senders'",
    ),
    ({"mean": None}, r"mean=None .*mean='replicas'"),
  ],
)
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, match):
  with pytest.raises(ValueError, match=match):
    decoupled_momentum(AXIS, **kwargs)


def test_no_axis_and_a_non_bool_sign_are_refused():
  with pytest.raises(ValueError, match=r"axis_name=None.*named axis"):
    decoupled_momentum(None)
  with pytest.raises(TypeError, match=r"sign=1 must be True or False"):
    decoupled_momentum(AXIS, sign=1)


def test_a_replicated_gradient_is_refused_with_the_pcast_fix():
  tx = decoupled_momentum(AXIS, k=2, chunk_size=4)
  f = jax.jit(
    jax.shard_map(
      lambda g: tx.update(g, tx.init(g))[0],
      mesh=_mesh(),
      in_specs=P(),
      out_specs=P(),
    )
  )
  with pytest.raises(ValueError, match=r"invariant over axis 'batch'.*pcast"):
    f(jnp.zeros(8))
