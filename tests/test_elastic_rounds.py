"""shardopt.elastic's rounds, simulated in one process.

N islands each keep their own params and state and take their local steps
with ``split.local_update``; a round builds every island's row
(``rows.plain_row`` / ``rows.healing_row``), stacks them as the all_gather
would (each island gets its own shuffled order: the result must not depend
on it) and applies them on every island (``commit.apply_plain`` /
``heal.heal``). No processes, no collectives over processes.

References are independent of the code under test: the periodic transforms
themselves under ``jax.shard_map`` over N CPU devices (the synchronous
engine), and numpy arithmetic (float64) for the outer optimizer, the mean
over the contributing islands and the int8 wire's decoding.
"""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.elastic import checks
from shardopt.elastic import commit
from shardopt.elastic import heal
from shardopt.elastic import rows
from shardopt.periodic import split

N = 4  # islands
H = 3  # local steps per sync
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
HEADER_BYTES = 40  # 10 int32 fields, documented in rows.HEADER_FIELDS


def _diloco(inner, axis_name, **kwargs):
  """``shardopt.diloco`` with the outer step the numpy references spell
  (Nesterov SGD, OUTER_LR, OUTER_MOMENTUM), whatever the defaults are."""
  return shardopt.diloco(
    inner,
    axis_name,
    outer_learning_rate=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    **kwargs,
  )


# --------------------------------------------------------------------------
# The model: a quadratic pulled toward an island-specific target, plus a
# deterministic per-(island, step) noise, so the gradient depends on the
# params (a round's result changes what the islands do next).


def _params(seed=0, shapes=None):
  shapes = shapes or {"w": (4, 3), "b": (3,)}
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _target(island, like):
  rng = np.random.default_rng([1000, island])
  return jax.tree.map(
    lambda p: rng.normal(size=np.shape(p)).astype(np.float32), like
  )


def _noise(island, step, like):
  rng = np.random.default_rng([island, step])
  return jax.tree.map(
    lambda p: (0.3 * rng.normal(size=np.shape(p))).astype(np.float32), like
  )


def _grads(params, target, noise):
  return jax.tree.map(lambda p, t, n: (p - t) + n, params, target, noise)


# --------------------------------------------------------------------------
# Islands in one process.

_JITS: dict = {}


def _jit(key, make):
  if key not in _JITS:
    _JITS[key] = jax.jit(make())
  return _JITS[key]


def _local_fn(engine):
  def make():
    def step(params, state, target, noise):
      grads = _grads(params, target, noise)
      updates, state = split.local_update(engine, grads, state, params, {})
      return optax.apply_updates(params, updates), state

    return step

  return _jit(("local", engine), make)


def _island_args(fn, i):
  """The row builders' leading island arguments: the island, and where they
  take one, the sending process (here one process per island)."""
  return (i, i) if "process" in inspect.signature(fn).parameters else (i,)


def _plain_rows_fn(engine, sync, islands):
  return _jit(
    ("plain_rows", engine, sync, islands),
    lambda: (
      lambda i, s, p, o: rows.plain_rows(engine, i, i, sync, s, p, o, islands)
    ),
  )


def _weighted_rows_fn(engine, sync, islands):
  return _jit(
    ("weighted_rows", engine, sync, islands),
    lambda: (
      lambda i, s, p, o, w: rows.plain_rows(
        engine, i, i, sync, s, p, o, islands, True, w
      )
    ),
  )


def _exchange(engine, sync, params, rows_by_position, islands=None):
  """The plain round's collective program (``rows.exchange``) under
  ``jax.shard_map`` over as many CPU devices as rows, position ``q`` sending
  ``rows_by_position[q]``: per position, what its process gets."""
  n = len(rows_by_position)
  islands = islands or n
  blocks = [
    np.asarray(r).reshape((-1,) + np.shape(r)[-1:]) for r in rows_by_position
  ]
  sizes = rows.sizes_of(engine, sync, params)
  mesh = Mesh(np.array(jax.devices()[:n]), ("islands",))
  fn = _jit(
    ("exchange", engine, sync, n, islands),
    lambda: jax.shard_map(
      lambda r: rows.exchange(engine, sizes, r, "islands", islands),
      mesh=mesh,
      in_specs=P("islands"),
      out_specs=P(),
      check_vma=False,
    ),
  )
  out = fn(jnp.asarray(np.concatenate(blocks)))
  by_device = {}
  for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    for shard in leaf.addressable_shards:
      by_device.setdefault(shard.device, []).append(shard.data)
  treedef = jax.tree.structure(out)
  home = jax.devices()[0]  # where the islands' params live here
  return [
    jax.device_put(treedef.unflatten(by_device[d]), home) for d in mesh.devices
  ]


def _healing_row_fn(engine, sync, up):
  return _jit(
    ("healing_row", engine, sync, up),
    lambda: (
      lambda i, s, p: rows.healing_row(
        engine, *_island_args(rows.healing_row, i), sync, up, s, p
      )
    ),
  )


def _apply_fn(engine, sync, islands):
  return _jit(
    ("apply", engine, sync, islands),
    lambda: (
      lambda x, p, s, lo, sk, d, c: commit.apply_plain(
        engine, sync, islands, x, p, s, lo, sk, d, c
      )
    ),
  )


def _heal_fn(engine, sync, fresh):
  return _jit(
    ("heal", engine, sync, fresh),
    lambda: (
      lambda g, p, s, lo, sk, d: heal.heal(
        engine, sync, fresh, g, p, s, lo, sk, d
      )
    ),
  )


def _header(row) -> np.ndarray:
  """A row's int32 header, decoded in numpy (of a two-phase wire's rows,
  the first: every row carries the same header)."""
  row = np.asarray(row)
  row = row[0] if row.ndim == 2 else row
  return row[:HEADER_BYTES].copy().view(np.int32)


def _gathered(row_list, rng):
  """The rows stacked in a random order (as some all_gather would)."""
  order = rng.permutation(len(row_list))
  return jnp.stack([row_list[j] for j in order])


class Islands:
  """N islands of one transform: params, states, local steps, rounds."""

  def __init__(self, tx, params_list, *, seed=0):
    self.tx = tx
    self.engine = split.engine_of(tx, "test_elastic_rounds")
    self.params = [jax.tree.map(jnp.asarray, p) for p in params_list]
    self.states = [tx.init(p) for p in self.params]
    self.n = len(params_list)
    self.targets = [_target(i, params_list[0]) for i in range(self.n)]
    self.rng = np.random.default_rng([77, seed])
    self.last_rows = None
    self.last_errors = None

  def local_steps(self, k, *, poison=()):
    """``k`` local steps on every island; ``poison``: ``(island, step)``
    pairs, a NaN in that island's gradient at that (1-based) step."""
    fn = _local_fn(self.engine)
    for _ in range(k):
      for i in range(self.n):
        step = int(self.states[i].count) + 1
        noise = _noise(i, step, self.params[i])
        if (i, step) in poison:
          noise = dict(noise)
          w = np.array(noise["w"])
          w.flat[0] = np.nan
          noise["w"] = w
        self.params[i], self.states[i] = fn(
          self.params[i], self.states[i], self.targets[i], noise
        )

  def due(self):
    syncs = {split.due(self.engine, int(s.count)) for s in self.states}
    assert len(syncs) == 1, syncs
    return syncs.pop()

  def island_steps(self, i, k):
    """``k`` local steps on island ``i`` alone (islands of unequal speed)."""
    fn = _local_fn(self.engine)
    for _ in range(k):
      step = int(self.states[i].count) + 1
      self.params[i], self.states[i] = fn(
        self.params[i],
        self.states[i],
        self.targets[i],
        _noise(i, step, self.params[i]),
      )

  def plain_round(self, weights=None):
    """A plain round over every island, the islands at shuffled positions
    of the collective program's mesh; returns the headers (island order)
    and the sync index. ``weights``: per island, its contribution's weight
    (rounds on the clock; the transform's only sync, due or not)."""
    sync = self.due() if weights is None else 1
    assert sync > 0
    order = self.rng.permutation(self.n)  # position q: island order[q]
    owners = jnp.asarray(rows.islands_of(order, 1))
    if weights is None:
      fn = _plain_rows_fn(self.engine, sync, self.n)
      made = [
        fn(jnp.int32(i), self.states[i], self.params[i], owners)
        for i in range(self.n)
      ]
    else:
      fn = _weighted_rows_fn(self.engine, sync, self.n)
      made = [
        fn(
          jnp.int32(i),
          self.states[i],
          self.params[i],
          owners,
          jnp.int32(weights[i]),
        )
        for i in range(self.n)
      ]
    row_list = [r for r, _ in made]
    dropped = [d for _, d in made]
    got = _exchange(
      self.engine, sync, self.params[0], [row_list[i] for i in order]
    )
    exchanged = {int(i): got[q] for q, i in enumerate(order)}
    heads = np.stack([_header(r) for r in row_list])
    finite = heads[:, rows.FIELD["finite"]] > 0
    skipped = int(np.sum(~finite))
    apply = _apply_fn(self.engine, sync, self.n)
    for i in range(self.n):
      np.testing.assert_array_equal(np.asarray(exchanged[i].header), heads)
      self.params[i], self.states[i] = apply(
        exchanged[i],
        self.params[i],
        self.states[i],
        jnp.asarray(not finite[i]),
        jnp.int32(skipped),
        dropped[i],
        jnp.int32(i),
      )
    self.last_rows, self.last_errors = row_list, dropped
    self.last_exchanged = exchanged
    return heads, sync


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _assert_islands_identical(isl, *, params=True, counts=True):
  """Every island holds the same bits (``counts=False``: but its own local
  step count, as on rounds on the clock)."""
  for i in range(1, isl.n):
    chex.assert_trees_all_equal(isl.states[i].center, isl.states[0].center)
    chex.assert_trees_all_equal(
      isl.states[i].global_state, isl.states[0].global_state
    )
    if counts:
      chex.assert_trees_all_equal(isl.states[i].count, isl.states[0].count)
    chex.assert_trees_all_equal(
      isl.states[i].sync_count, isl.states[0].sync_count
    )
    chex.assert_trees_all_equal(isl.states[i].skipped, isl.states[0].skipped)
    if params:
      chex.assert_trees_all_equal(isl.params[i], isl.params[0])


def _nesterov(center, momentum, outer_grad):
  """optax.sgd(0.7, momentum=0.9, nesterov=True), in numpy: optax's trace
  is ``m = g + 0.9 m``, its Nesterov update ``g + 0.9 m``, scaled by -lr."""
  m = outer_grad + OUTER_MOMENTUM * momentum
  return center - OUTER_LR * (outer_grad + OUTER_MOMENTUM * m), m


# --------------------------------------------------------------------------
# The synchronous reference: the transform itself under shard_map.


def _concat(trees):
  return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *trees)


def _shard_map_reference(tx, params0, targets, n):
  """``step(t)`` runs local step t (1-based) of the synchronous transform
  over n devices; returns (params, state) as global arrays."""
  mesh = Mesh(np.array(jax.devices()[:n]), ("i",))
  block = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params0
  )
  specs = shardopt.state_specs(tx, block, "i", mesh=mesh)

  def step(params, state, target, noise):
    updates, state = tx.update(_grads(params, target, noise), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P("i"), specs, P("i"), P("i")),
      out_specs=(P("i"), specs),
    )
  )
  params = _concat([params0] * n)
  # Every replica starts from tx.init(params0): per-replica leaves are n
  # copies of its blocks, replicated ones one copy.
  one = tx.init(params0)
  state = jax.tree.map(
    lambda x, spec: (
      np.asarray(x)
      if spec == P()
      else np.concatenate([np.asarray(x)] * n, axis=0)
    ),
    one,
    specs,
  )
  target = _concat(targets)
  return (
    params,
    state,
    specs,
    lambda p, s, t: step(
      p, s, target, _concat([_noise(i, t, params0) for i in range(n)])
    ),
  )


def _block(x, i, n, spec):
  """Replica i's block of a global array laid out by spec."""
  x = np.asarray(x)
  if spec == P() or x.ndim == 0:
    return x
  d = x.shape[0] // n
  return x[i * d : (i + 1) * d]


# --------------------------------------------------------------------------
# 1. A plain round is the synchronous transform's sync.


TRANSFORMS = {
  "diloco": lambda: _diloco(optax.adam(1e-2), "i", sync_period=H),
  "local_sgd": lambda: shardopt.local_sgd(optax.adam(1e-2), "i", sync_period=H),
  "agn": lambda: shardopt.agn(optax.adam(1e-2), "i", sync_period=H),
  "diloco_fragments": lambda: _diloco(
    optax.adam(1e-2), "i", sync_period=4, num_fragments=2
  ),
}


def _assert_like_reference(isl, ref_params, ref_state, specs, what, tol):
  fields = ("center", "global_state", "accumulator", "error")
  for i in range(N):
    for got, want in zip(
      jax.tree.leaves(isl.params[i]), jax.tree.leaves(ref_params), strict=True
    ):
      np.testing.assert_allclose(
        got,
        _block(want, i, N, P("i")),
        rtol=tol,
        atol=tol,
        err_msg=f"{what}: params of island {i}",
      )
    for field in fields:
      got_tree = getattr(isl.states[i], field)
      want_tree = getattr(ref_state, field)
      spec_tree = getattr(specs, field)
      for got, want, spec in zip(
        jax.tree.leaves(got_tree),
        jax.tree.leaves(want_tree),
        jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P)),
        strict=True,
      ):
        # Error buffers: a block's scale keeps 17 significant bits, so an
        # input one ulp off (the params agree to 1e-6, not bit for bit,
        # after a round) moves its block's residuals by up to 2^-17 of the
        # block's absmax (1.3e-6 seen on float8): 10x the tolerance there.
        np.testing.assert_allclose(
          np.asarray(got, np.float64),
          np.asarray(_block(want, i, N, spec), np.float64),
          rtol=tol,
          atol=tol * (10 if field == "error" else 1),
          err_msg=f"{what}: state.{field} of island {i}",
        )
    assert int(isl.states[i].count) == int(ref_state.count)
    assert int(isl.states[i].sync_count) == int(ref_state.sync_count)
    assert int(isl.states[i].skipped) == int(ref_state.skipped) == 0


def _run_against_reference(tx, p0, steps, what, tol=1e-6):
  """Islands and the transform's own sync under ``jax.shard_map``, step for
  step; compared after every round. Returns the rounds run."""
  isl = Islands(tx, [p0] * N)
  ref_params, ref_state, specs, ref_step = _shard_map_reference(
    tx, p0, isl.targets, N
  )
  rounds = 0
  for t in range(1, steps + 1):
    ref_params, ref_state = ref_step(ref_params, ref_state, t)
    isl.local_steps(1)
    if isl.due():
      isl.plain_round()
      rounds += 1
      _assert_like_reference(
        isl, ref_params, ref_state, specs, f"{what}, step {t}", tol
      )
      # Streaming: only the synced fragment's params agree after a round.
      _assert_islands_identical(isl, params=isl.engine.num_fragments == 1)
  assert int(isl.states[0].sync_count) == rounds
  # The rounds moved something: the islands do not sit on the start.
  assert not np.allclose(isl.params[0]["w"], p0["w"])
  return rounds


@pytest.mark.parametrize("kind", sorted(TRANSFORMS))
def test_plain_round_matches_diloco_under_shard_map(kind):
  steps = 3 * H if kind != "diloco_fragments" else 8
  rounds = _run_against_reference(TRANSFORMS[kind](), _params(), steps, kind)
  assert rounds == (3 if kind != "diloco_fragments" else 4)


# Every wire the periodic transforms take; error feedback where the wire
# takes it (top-k needs it).
WIRES = {
  "float32": dict(),
  "bfloat16": dict(comm_dtype=jnp.bfloat16),
  "int8": dict(comm_dtype=jnp.int8),
  "int8_ef": dict(
    comm_dtype=shardopt.quantized(jnp.int8, block_size=32), error_feedback=True
  ),
  "float8_ef": dict(comm_dtype=jnp.float8_e4m3fn, error_feedback=True),
  "int4_ef": dict(
    comm_dtype=shardopt.quantized(jnp.int4, block_size=16), error_feedback=True
  ),
  "topk_ef": dict(
    comm_dtype=shardopt.topk(3, chunk_size=32), error_feedback=True
  ),
}


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_plain_rounds_on_every_wire_match_the_transforms_own_sync(wire):
  """A plain round on each wire is the transform's own sync under
  ``jax.shard_map`` (params, center, outer state and error buffers, 1e-6),
  bit-identical on every island, over three rounds."""
  p0 = _params(seed=3, shapes={"w": (20, 16), "b": (16,)})
  tx = _diloco(optax.adam(1e-2), "i", sync_period=H, **WIRES[wire])
  assert _run_against_reference(tx, p0, 3 * H, wire) == 3


def test_plain_rounds_on_a_streaming_int8_wire_match_the_transforms_own_sync():
  p0 = _params(seed=4, shapes={"w": (20, 16), "b": (16,)})
  tx = _diloco(
    optax.adam(1e-2),
    "i",
    sync_period=4,
    num_fragments=2,
    comm_dtype=jnp.int8,
    error_feedback=True,
  )
  assert _run_against_reference(tx, p0, 8, "streaming int8") == 4


# --------------------------------------------------------------------------
# 2. Bit-identical on every island, whatever order the rows arrive in.


@pytest.mark.parametrize("kind", ["diloco", "agn"])
def test_centers_bit_identical_across_islands(kind):
  tx = TRANSFORMS[kind]()
  isl = Islands(tx, [_params()] * N, seed=1)
  for r in range(3):
    isl.local_steps(H)
    # Before the round the islands differ (else the test shows nothing).
    assert not np.array_equal(isl.params[0]["w"], isl.params[1]["w"])
    isl.plain_round()
    _assert_islands_identical(isl)
    assert int(isl.states[0].sync_count) == r + 1
    # The params are the center, bit for bit (not params + (center - params)).
    chex.assert_trees_all_equal(isl.params[0], isl.states[0].center)


# --------------------------------------------------------------------------
# 3. The mean is over the contributing (finite) islands only.


def test_mean_over_contributing_islands_only():
  tx = shardopt.local_sgd(optax.adam(1e-2), "i", sync_period=H)
  isl = Islands(tx, [_params()] * N, seed=2)
  bad = 2
  isl.local_steps(H, poison={(bad, H)})
  local = [_np(p) for p in isl.params]
  assert not np.isfinite(local[bad]["w"]).all()
  assert all(np.isfinite(local[i]["w"]).all() for i in range(N) if i != bad)
  skipped_before = int(isl.states[0].skipped)

  heads, _ = isl.plain_round()

  assert list(heads[:, rows.FIELD["finite"]]) == [
    int(i != bad) for i in range(N)
  ]
  good = [i for i in range(N) if i != bad]
  want = jax.tree.map(
    lambda *xs: np.mean(xs, axis=0), *[local[i] for i in good]
  )
  for i in range(N):
    for k in want:
      np.testing.assert_allclose(
        isl.states[i].center[k],
        want[k],
        rtol=1e-6,
        atol=1e-6,
        err_msg=f"center[{k}] on island {i}",
      )
    assert int(isl.states[i].skipped) == skipped_before + 1
    assert bool(isl.states[i].restart.reshape(())) == (i == bad)
  _assert_islands_identical(isl)
  # The left-out island is back on the (finite) center, and its local state
  # restarts at its next step: its moments are finite again.
  assert np.isfinite(isl.params[bad]["w"]).all()
  assert not all(
    np.isfinite(x).all() for x in jax.tree.leaves(isl.states[bad].local_state)
  )
  isl.local_steps(H)
  assert all(
    np.isfinite(np.asarray(x, np.float64)).all()
    for x in jax.tree.leaves(isl.states[bad].local_state)
  )
  assert not bool(isl.states[bad].restart.reshape(()))
  local = [_np(p) for p in isl.params]
  isl.plain_round()  # everyone contributes again
  want = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *local)
  for k in want:
    np.testing.assert_allclose(
      isl.states[bad].center[k], want[k], rtol=1e-6, atol=1e-6
    )
  assert int(isl.states[0].skipped) == skipped_before + 1
  _assert_islands_identical(isl)


@pytest.mark.parametrize("wire", ["float32", "int8"])
def test_rounds_on_the_clock_weigh_each_island_by_its_steps(wire):
  """Issue 42: islands of unequal speed take different numbers of steps per
  round, and the round is the mean of their outer gradients weighted by
  those steps (an island with none contributes nothing), then diloco's
  outer Nesterov step: three rounds against numpy (1e-6; the int8 wire's
  quantization against the same numpy arithmetic on what the wire
  delivers, so only the float32 wire is compared to the exact mean), and
  bit-identical centers on every island. On the int8 wire the delivered
  sums (each island's decoded ``Exchanged.totals``: the bytes of phase 2,
  decoded by the wire) are the weighted sum of the contributions within the
  wire's error, and the center is numpy's division by the weights and
  Nesterov step of exactly those sums (1e-6)."""
  comm = None if wire == "float32" else jnp.int8
  tx = _diloco(optax.adam(1e-2), "i", sync_period=1000, comm_dtype=comm)
  isl = Islands(tx, [_params()] * N, seed=5)
  center = _np(isl.params[0])
  momentum = jax.tree.map(np.zeros_like, center)
  schedule = [(1, 2, 4, 3), (4, 0, 2, 1), (2, 2, 2, 2)]
  for steps in schedule:
    for i, k in enumerate(steps):
      isl.island_steps(i, k)
    local = [_np(p) for p in isl.params]
    heads, _ = isl.plain_round(weights=steps)
    assert list(rows.weights(heads)) == list(steps)
    _assert_islands_identical(isl, counts=False)
    total = float(sum(steps))
    if wire != "float32":
      _check_delivered(isl, center, momentum, local, steps, total)
      continue
    for k in center:
      g = (
        sum(
          np.float64(w) * (center[k] - local[i][k]) for i, w in enumerate(steps)
        )
        / total
      )
      momentum[k] = OUTER_MOMENTUM * momentum[k] + g
      center[k] = center[k] - OUTER_LR * (g + OUTER_MOMENTUM * momentum[k])
      for i in range(N):
        np.testing.assert_allclose(
          isl.states[i].center[k], center[k], rtol=1e-6, atol=1e-6
        )
        np.testing.assert_allclose(
          isl.params[i][k], center[k], rtol=1e-6, atol=1e-6
        )


def _check_delivered(isl, center, momentum, local, steps, total):
  """One weighted round on a lossy wire against numpy: the sums every
  island received are the weighted sum of the outer gradients within the
  wire's error (int8 twice: 2% of the largest), the same on every island,
  and the new center is numpy's mean and Nesterov step of those sums.
  Updates ``center`` and ``momentum`` in place."""
  keys = sorted(center)  # jax.tree.leaves order of the dict: "b", "w"
  delivered = [np.asarray(t, np.float64) for t in isl.last_exchanged[0].totals]
  for i in range(1, N):
    for got, want in zip(
      isl.last_exchanged[i].totals, isl.last_exchanged[0].totals, strict=True
    ):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for k, sent in zip(keys, delivered, strict=True):
    exact = sum(
      np.float64(w) * (center[k] - local[i][k]) for i, w in enumerate(steps)
    ).reshape(-1)
    np.testing.assert_allclose(
      sent, exact, rtol=0, atol=0.02 * np.abs(exact).max()
    )
    g = (sent / total).reshape(np.shape(center[k]))
    momentum[k] = OUTER_MOMENTUM * momentum[k] + g
    center[k] = center[k] - OUTER_LR * (g + OUTER_MOMENTUM * momentum[k])
    for i in range(N):
      np.testing.assert_allclose(
        isl.states[i].center[k], center[k], rtol=1e-6, atol=1e-6
      )


def test_a_weight_of_one_everywhere_is_the_plain_round_bit_for_bit():
  """Rounds every sync_period steps send weight 1: the weighted arithmetic
  with weights 1 gives the same bits as the flag-weighted mean."""
  tx = _diloco(optax.adam(1e-2), "i", sync_period=H)
  plain = Islands(tx, [_params()] * N, seed=6)
  weighted = Islands(tx, [_params()] * N, seed=6)
  for isl in (plain, weighted):
    isl.local_steps(H)
  plain.plain_round()
  weighted.plain_round(weights=[1] * N)
  for a, b in zip(plain.states, weighted.states, strict=True):
    chex.assert_trees_all_equal(a.center, b.center)
    chex.assert_trees_all_equal(a.global_state, b.global_state)


def test_no_contributing_island_leaves_the_center_where_it_was():
  tx = _diloco(optax.sgd(1e-2), "i", sync_period=H)
  isl = Islands(tx, [_params()] * 3, seed=3)
  isl.local_steps(H)
  isl.plain_round()
  center = jax.tree.map(np.asarray, isl.states[0].center)
  outer = jax.tree.map(np.asarray, isl.states[0].global_state)
  isl.local_steps(H, poison={(i, 2 * H) for i in range(3)})
  heads, _ = isl.plain_round()
  assert not heads[:, rows.FIELD["finite"]].any()
  chex.assert_trees_all_equal(
    jax.tree.map(np.asarray, isl.states[0].center), center
  )
  chex.assert_trees_all_equal(
    jax.tree.map(np.asarray, isl.states[0].global_state), outer
  )
  assert int(isl.states[0].skipped) == 3
  assert int(isl.states[0].sync_count) == 2
  assert all(bool(s.restart.reshape(())) for s in isl.states)
  _assert_islands_identical(isl)


# --------------------------------------------------------------------------
# 4. Healing: a fresh island joins with weight 0 and adopts everything.


def _heal_round(isl, fresh, rng):
  """A healing round: ``fresh[i]`` islands build a weight-0 row with sync 0
  and their init state; the others their due sync."""
  up_islands = [i for i in range(isl.n) if not fresh[i]]
  syncs = {split.due(isl.engine, int(isl.states[i].count)) for i in up_islands}
  sync = syncs.pop() if syncs else 0
  assert not syncs
  row_list = []
  for i in range(isl.n):
    if fresh[i]:
      fn = _healing_row_fn(isl.engine, 0, False)
    else:
      fn = _healing_row_fn(isl.engine, sync, True)
    row_list.append(fn(jnp.int32(i), isl.states[i], isl.params[i]))
  row_list, dropped = [r for r, _ in row_list], [d for _, d in row_list]
  heads = np.stack([_header(r) for r in row_list])
  up = heads[:, rows.FIELD["up_to_date"]] > 0
  contributing = up & (heads[:, rows.FIELD["finite"]] > 0)
  skipped = int(np.sum(up & ~contributing))
  for i in range(isl.n):
    isl.params[i], isl.states[i] = _heal_fn(isl.engine, sync, fresh[i])(
      _gathered(row_list, rng),
      isl.params[i],
      isl.states[i],
      jnp.asarray(bool(up[i] and not contributing[i])),
      jnp.int32(skipped),
      dropped[i],
    )
  return heads, sync


def test_a_healing_round_spends_the_error_buffer_as_a_plain_round_does():
  """On the top-k wire a healing round carries what a plain round's wire
  would deliver (in float32), and error feedback keeps what it drops: from
  the same islands and states, a healing round (every island up to date)
  and a plain round give the same center, outer state and error buffers
  (1e-6). Sending the whole contribution instead dumped the error buffer,
  most of every outer gradient since the last rounds, on the center at once
  (an elastic run's loss jumped 0.21 -> 5.85 at a heal)."""
  tx = _diloco(
    optax.adam(1e-2),
    "i",
    sync_period=H,
    comm_dtype=shardopt.topk(3, chunk_size=32),
    error_feedback=True,
  )
  p0 = _params(seed=5, shapes={"w": (20, 16), "b": (16,)})
  plain = Islands(tx, [p0] * N, seed=31)
  healed = Islands(tx, [p0] * N, seed=31)
  for _ in range(2):  # build up an error buffer first
    plain.local_steps(H)
    plain.plain_round()
  healed.params, healed.states = list(plain.params), list(plain.states)
  plain.local_steps(H)
  healed.local_steps(H)
  assert np.abs(_flat(plain.states[0].error)).max() > 0
  plain.plain_round()
  _heal_round(healed, [False] * N, np.random.default_rng(3))
  for i in range(N):
    for field in ("center", "global_state", "error"):
      np.testing.assert_allclose(
        _flat(getattr(healed.states[i], field)),
        _flat(getattr(plain.states[i], field)),
        rtol=1e-6,
        atol=1e-6,
        err_msg=f"{field} of island {i}",
      )


def test_healing_round_adopts_center_and_counters():
  tx = _diloco(optax.adam(1e-2), "i", sync_period=H)
  p0 = _params()
  isl = Islands(tx, [p0] * N, seed=4)
  # Two plain rounds among the first N-1 (the last one is not there yet):
  # simulate them with an (N-1)-island group, then add the fresh one.
  group = Islands(tx, [p0] * (N - 1), seed=4)
  momentum = jax.tree.map(lambda p: np.zeros(np.shape(p)), _np(p0))
  center = _np(p0)
  for _ in range(2):
    group.local_steps(H)
    local = [_np(p) for p in group.params]
    g = jax.tree.map(lambda c, *xs: c - np.mean(xs, axis=0), center, *local)
    center, momentum = (
      jax.tree.map(
        lambda c, m, gg: _nesterov(c, m, gg)[0], center, momentum, g
      ),
      jax.tree.map(
        lambda c, m, gg: _nesterov(c, m, gg)[1], center, momentum, g
      ),
    )
    group.plain_round()
  group.local_steps(H)
  sync = split.due(group.engine, int(group.states[0].count))
  assert sync == 1
  # A plain round over the same N-1 up-to-date islands, for comparison.
  twin = Islands(tx, [p0] * (N - 1), seed=5)
  twin.params, twin.states = list(group.params), list(group.states)
  twin.plain_round()

  fresh_params = _params(seed=99)
  isl.params = list(group.params) + [jax.tree.map(jnp.asarray, fresh_params)]
  isl.states = list(group.states) + [tx.init(isl.params[-1])]
  local = [_np(p) for p in group.params]
  g = jax.tree.map(lambda c, *xs: c - np.mean(xs, axis=0), center, *local)
  want_center = jax.tree.map(
    lambda c, m, gg: _nesterov(c, m, gg)[0], center, momentum, g
  )
  want_momentum = jax.tree.map(
    lambda c, m, gg: _nesterov(c, m, gg)[1], center, momentum, g
  )

  fresh = [False] * (N - 1) + [True]
  heads, used = _heal_round(isl, fresh, np.random.default_rng(6))
  assert used == sync
  assert list(heads[:, rows.FIELD["up_to_date"]]) == [1] * (N - 1) + [0]

  new = N - 1
  for i in range(N - 1):
    chex.assert_trees_all_equal(isl.params[new], isl.params[i])
  _assert_islands_identical(isl)
  assert int(isl.states[new].count) == 3 * H
  assert int(isl.states[new].sync_count) == 3
  assert int(isl.states[new].skipped) == 0
  for k in want_center:
    np.testing.assert_allclose(
      isl.states[new].center[k], want_center[k], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
      jax.tree.leaves(isl.states[new].global_state)[0 if k == "b" else 1],
      want_momentum[k],
      rtol=1e-6,
      atol=1e-6,
    )
  chex.assert_trees_all_equal(isl.params[new], isl.states[new].center)
  # The fresh island's inner optimizer restarted from init at the center.
  chex.assert_trees_all_equal(
    isl.states[new].local_state, tx.init(isl.params[new]).local_state
  )
  # The survivors' own inner state is kept.
  chex.assert_trees_all_equal(
    isl.states[0].local_state, group.states[0].local_state
  )
  # What a plain round among the up-to-date islands alone would have given.
  for k in want_center:
    np.testing.assert_allclose(
      isl.states[0].center[k], twin.states[0].center[k], rtol=1e-6, atol=1e-6
    )
  # And the healed group trains on together.
  isl.local_steps(H)
  isl.plain_round()
  _assert_islands_identical(isl)
  assert int(isl.states[new].sync_count) == 4


def test_healing_restarts_the_fresh_islands_inner_state_at_its_new_params():
  """A fresh island's inner optimizer restarts (``optimizer.init``) at the
  params it then trains from, as a left-out replica's does in the engine
  (``_local_step``: ``optimizer.init(params)`` at its next step). Schedule-
  free AdamW keeps a copy of the params in its state (``z``): after the
  healing round it must be the island's new params (the center after the
  outer step), not the center before it."""
  tx = _diloco(optax.contrib.schedule_free_adamw(1e-2), "i", sync_period=H)
  p0 = _params()
  group = Islands(tx, [p0] * (N - 1), seed=12)
  group.local_steps(H)
  isl = Islands(tx, [p0] * N, seed=12)
  fresh_params = jax.tree.map(jnp.asarray, _params(seed=98))
  isl.params = list(group.params) + [fresh_params]
  isl.states = list(group.states) + [tx.init(fresh_params)]
  _heal_round(isl, [False] * (N - 1) + [True], np.random.default_rng(13))
  new = N - 1
  chex.assert_trees_all_equal(isl.params[new], isl.params[0])
  chex.assert_trees_all_equal(isl.states[new].local_state.z, isl.params[new])


def test_an_up_to_date_island_keeps_its_own_step_count_through_a_heal():
  """Islands that step at their own pace (rounds on the clock) hold
  different counts: in a healing round an up-to-date island keeps its own
  (issue 52: a mutation giving it the source's count passed every fast
  test), and the fresh island takes the source's (the lowest up-to-date
  island's); the round's counters (sync_count, skipped) are the source's
  for everyone."""
  tx = _diloco(optax.adam(1e-2), "i", sync_period=1000)
  isl = Islands(tx, [_params()] * 3, seed=14)
  isl.island_steps(0, 3)
  isl.island_steps(1, 5)
  assert [int(s.count) for s in isl.states] == [3, 5, 0]
  _heal_round(isl, [False, False, True], np.random.default_rng(15))
  assert [int(s.count) for s in isl.states] == [3, 5, 3]
  assert {int(s.sync_count) for s in isl.states} == {0}
  # No sync was due: the up-to-date islands keep their params; the fresh
  # one takes the center.
  _assert_islands_identical(isl, params=False, counts=False)
  chex.assert_trees_all_equal(isl.params[2], isl.states[0].center)


def test_job_start_handshake_adopts_the_lowest_island():
  tx = _diloco(optax.adam(1e-2), "i", sync_period=H)
  starts = [_params(seed=10 + i) for i in range(N)]
  isl = Islands(tx, starts, seed=7)
  heads, sync = _heal_round(isl, [True] * N, np.random.default_rng(8))
  assert sync == 0
  assert list(heads[:, rows.FIELD["up_to_date"]]) == [0] * N
  for i in range(N):
    chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, isl.params[i]), starts[0]
    )
    chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, isl.states[i].center), starts[0]
    )
    assert int(isl.states[i].sync_count) == 0
    assert int(isl.states[i].count) == 0
    chex.assert_trees_all_equal(
      isl.states[i].global_state, tx.init(starts[0]).global_state
    )
  _assert_islands_identical(isl)
  isl.local_steps(H)
  isl.plain_round()
  _assert_islands_identical(isl)
  assert int(isl.states[0].sync_count) == 1


# --------------------------------------------------------------------------
# 5. An island of several processes counts once.


def test_an_island_of_two_processes_counts_once_in_the_mean():
  """Two processes per island send the same rows; the round's mean counts
  each island once (rows.counted: up to date, finite, its island's first
  process), in the count as in the sum: against a numpy mean over the
  islands and a count equal to the number of islands."""
  tx = _diloco(optax.adam(1e-2), "i", sync_period=H, comm_dtype=jnp.int8)
  isl = Islands(tx, [_params()] * N, seed=21)
  isl.local_steps(H)
  k, engine, sync = 2, isl.engine, isl.due()
  processes = isl.rng.permutation(N * k)  # mesh position q: process
  owners = jnp.asarray(rows.islands_of(processes, k))
  made = {
    int(p): jax.jit(
      lambda s, x, o, p=int(p): rows.plain_rows(
        engine, p // k, p, sync, s, x, o, N
      )
    )(isl.states[p // k], isl.params[p // k], owners)
    for p in processes
  }
  got = _exchange(
    engine, sync, isl.params[0], [made[int(p)][0] for p in processes], N
  )
  head = np.asarray(got[0].header)
  np.testing.assert_array_equal(
    head[:, rows.FIELD["process"]], np.arange(N * k)
  )
  combined, count = rows.combined_plain(engine, got[0], isl.params[0], sync)
  assert float(count) == N
  # The islands' mean of what they sent, from the one-process-per-island
  # rows decoded in numpy would need the int8 codec; the float32 centers
  # minus params, averaged, bound it instead: within the int8 wire's error.
  want = np.mean(
    [_flat(isl.states[i].center) - _flat(isl.params[i]) for i in range(N)],
    axis=0,
  )
  np.testing.assert_allclose(_flat(combined), want, atol=2e-2, rtol=0)
  for q in range(1, N * k):  # every process decodes the same bits
    chex.assert_trees_all_equal(got[q].totals, got[0].totals)


def _flat(tree):
  return np.concatenate(
    [np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)]
  )


# --------------------------------------------------------------------------
# 6. Streaming DiLoCo: one fragment per round.


def test_fragments_sync_one_fragment_per_round():
  period, fragments = 4, 2
  tx = _diloco(
    optax.adam(1e-2), "i", sync_period=period, num_fragments=fragments
  )
  engine = split.engine_of(tx, "test")
  for t in range(1, 13):
    want = 0
    for f in range(fragments):
      if t % period == (f * period) // fragments:
        want = f + 1
    assert split.due(engine, t) == want, t
  p0 = _params()
  names = list(jax.tree_util.tree_flatten_with_path(p0)[0])
  keys = [path[0].key for path, _ in names]  # jax.tree.leaves order
  assert keys == ["b", "w"]  # so fragment 0 is "b", fragment 1 is "w"
  isl = Islands(tx, [p0] * 3, seed=11)
  center = _np(p0)
  momentum = [
    jax.tree.map(lambda p: np.zeros(np.shape(p)), _np(p0))
    for _ in range(fragments)
  ]
  fired = []
  for t in range(1, 9):
    isl.local_steps(1)
    sync = isl.due()
    if not sync:
      continue
    frag = sync - 1
    moved = keys[frag]
    fired.append((t, frag))
    before_params = [jax.tree.map(np.asarray, p) for p in isl.params]
    before_center = jax.tree.map(np.asarray, isl.states[0].center)
    before_outer = jax.tree.map(np.asarray, isl.states[0].global_state)
    local = [_np(p)[moved] for p in isl.params]
    g = center[moved] - np.mean(local, axis=0)
    c, m = _nesterov(center[moved], momentum[frag][moved], g)
    center[moved], momentum[frag][moved] = c, m
    isl.plain_round()
    for i in range(3):
      for k in keys:
        if k == moved:
          np.testing.assert_allclose(isl.params[i][k], c, rtol=1e-6, atol=1e-6)
          np.testing.assert_allclose(
            isl.states[i].center[k], c, rtol=1e-6, atol=1e-6
          )
        else:
          chex.assert_trees_all_equal(
            np.asarray(isl.params[i][k]), before_params[i][k]
          )
          chex.assert_trees_all_equal(
            np.asarray(isl.states[i].center[k]), before_center[k]
          )
      outer = isl.states[i].global_state
      assert isinstance(outer, tuple) and len(outer) == fragments
      chex.assert_trees_all_equal(outer[1 - frag], before_outer[1 - frag])
      np.testing.assert_allclose(
        jax.tree.leaves(outer[frag])[0], m, rtol=1e-6, atol=1e-6
      )
    _assert_islands_identical(isl, params=False)
  assert fired == [(2, 1), (4, 0), (6, 1), (8, 0)]


# --------------------------------------------------------------------------
# 7. What the split cannot run is refused, with the fix.


@pytest.mark.parametrize(
  "make, error, names",
  [
    (
      lambda: shardopt.hierarchical_local_sgd(
        optax.sgd(0.1), "i", period_group_sizes={2: 2, 4: 4}
      ),
      ValueError,
      ["shardopt.hierarchical_local_sgd", "hierarchical", "without"],
    ),
    (
      lambda: _diloco(
        optax.sgd(0.1),
        "i",
        sync_period=4,
        num_fragments=2,
        overlap_steps=1,
        overlap_alpha=0.5,
      ),
      ValueError,
      ["shardopt.diloco", "overlap_steps", "without"],
    ),
    (
      lambda: _diloco(optax.sgd(0.1), "i", sync_period=4, warmup_steps=2),
      ValueError,
      ["shardopt.diloco", "warmup_steps", "without"],
    ),
    (
      lambda: shardopt.local_sgd(
        optax.sgd(0.1), "i", sync_period=4, axis_index_groups=[[0, 1], [2, 3]]
      ),
      ValueError,
      ["shardopt.local_sgd", "axis_index_groups", "without"],
    ),
    (
      lambda: optax.adam(1e-3),
      TypeError,
      ["my_where", "shardopt.diloco", "directly"],
    ),
    (
      lambda: optax.chain(_diloco(optax.sgd(0.1), "i", sync_period=4)),
      TypeError,
      ["my_where", "optax.chain", "directly"],
    ),
  ],
  ids=["hierarchical", "overlap", "warmup", "groups", "adam", "chain"],
)
def test_engine_of_refuses_unsupported(make, error, names):
  tx = make()
  with pytest.raises(error) as info:
    split.engine_of(tx, "my_where")
  message = str(info.value)
  for name in names:
    assert name in message, (name, message)
  if error is ValueError:
    assert message.startswith("my_where: ")


def test_engine_of_accepts_what_the_islands_run():
  for tx in [
    _diloco(optax.adam(1e-2), "i", sync_period=4),
    _diloco(optax.adam(1e-2), "i", sync_period=4, num_fragments=2),
    _diloco(
      optax.adam(1e-2),
      "i",
      sync_period=4,
      comm_dtype=jnp.int8,
      error_feedback=True,
    ),
    shardopt.local_sgd(optax.sgd(0.1), "i", sync_period=4),
    shardopt.agn(optax.sgd(0.1), "i", sync_period=4),
  ]:
    assert isinstance(split.engine_of(tx, "test"), split.Engine)


def test_engine_of_names_overlap_alpha_when_it_is_what_was_set():
  """overlap_alpha > 0 with overlap_steps=0 is a valid diloco (the merge
  mixes params and center at the sync itself); the split cannot run it, and
  its refusal must name what the user set, not overlap_steps."""
  tx = _diloco(
    optax.sgd(0.1), "i", sync_period=4, num_fragments=2, overlap_alpha=0.5
  )
  with pytest.raises(ValueError) as info:
    split.engine_of(tx, "my_where")
  assert "overlap_alpha" in str(info.value), str(info.value)


def test_island_local_step_runs_cross_shard_inside_the_islands_shard_map():
  """diloco(cross_shard(adam, "data"), "island"): the island-local step
  (what ``Island.tx.update`` runs) inside a checking shard_map over the
  island's own "data" axis is cross_shard(adam) there, bit for bit: the mean
  gradient over the island's devices, then Adam. The island axis is never
  bound."""
  mesh = jax.make_mesh((4,), ("data",))
  inner = shardopt.cross_shard(optax.adam(1e-2), "data")
  engine = split.engine_of(_diloco(inner, "island", sync_period=4), "test")
  params = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}
  grads = {
    "w": np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
  }  # 4 devices x a (2, 3) block each
  grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("data")))

  def run(update, state):
    def step(p, s, g):
      u, s = update(g, s, p)
      return optax.apply_updates(p, u), s

    specs = jax.tree.map(lambda _: P(), state)
    return jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs),
      )
    )(params, state, grads)

  local = lambda g, s, p: split.local_update(engine, g, s, p, {})  # noqa: E731
  state = _diloco(inner, "island", sync_period=4).init(params)
  got, new_state = run(local, state)
  want, _ = run(inner.update, inner.init(params))
  chex.assert_trees_all_equal(got, want)
  assert int(new_state.count) == 1
  chex.assert_trees_all_equal(new_state.center, params)  # no sync ran


def test_healing_hands_over_an_outer_adam_state_bit_for_bit():
  """diloco(outer_optimizer=optax.adam): the outer state (with its int32
  count) travels in the healing row; the fresh island ends with the same
  outer state, center and params as the survivors."""
  tx = shardopt.diloco(
    optax.adam(1e-2), "i", sync_period=H, outer_optimizer=optax.adam(0.05)
  )
  p0 = _params()
  group = Islands(tx, [p0] * (N - 1), seed=4)
  for _ in range(2):
    group.local_steps(H)
    group.plain_round()
  group.local_steps(H)
  isl = Islands(tx, [p0] * N, seed=4)
  isl.params = list(group.params) + [jax.tree.map(jnp.asarray, _params(9))]
  isl.states = list(group.states) + [tx.init(isl.params[-1])]
  _heal_round(isl, [False] * (N - 1) + [True], np.random.default_rng(1))
  _assert_islands_identical(isl)
  assert int(isl.states[-1].global_state[0].count) == 3  # three outer steps
  chex.assert_trees_all_equal(isl.params[-1], isl.params[0])


# --------------------------------------------------------------------------
# 8. What a plain round sends: about twice the payload, however many islands.


@pytest.mark.parametrize("islands", [2, 4, 8])
def test_a_plain_round_sends_a_ring_all_reduces_bytes(islands):
  """The compiled round (rows.exchange, float32 wire) is one all-to-all and
  one all-gather; one island sends 2 (n - 1) / n of its payload plus the
  headers, (n - 1) x 32 bytes (a ring: what shardopt.measure.traffic reads,
  against the arithmetic)."""
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  tx = shardopt.diloco(optax.adam(1e-3), "i", sync_period=H)
  engine = split.engine_of(tx, "test")
  state = jax.eval_shape(tx.init, params)
  shaped = jax.eval_shape(
    lambda s, p, o: rows.plain_rows(engine, 0, 0, 1, s, p, o, islands)[0],
    state,
    params,
    jnp.zeros(islands, jnp.int32),
  )
  mesh = Mesh(np.array(jax.devices()[:islands]), ("islands",))
  sizes = rows.sizes_of(engine, 1, params)
  fn = jax.jit(
    jax.shard_map(
      lambda r: rows.exchange(engine, sizes, r, "islands", islands),
      mesh=mesh,
      in_specs=P("islands"),
      out_specs=P(),
      check_vma=False,
    )
  )
  rows_in = jax.ShapeDtypeStruct(
    (islands * shaped.shape[0], shaped.shape[1]), jnp.uint8
  )
  traffic = shardopt.measure.traffic(fn, rows_in, num_devices=islands)
  kinds = sorted(c.kind for c in traffic.collectives)
  assert kinds == ["all-gather", "all-to-all"], kinds
  payload = (64 * 32 + 32) * 4
  chunk = -(-64 * 32 // islands) + -(-32 // islands)  # elements per island
  n = islands
  want = (n - 1) * (HEADER_BYTES + 4 * chunk) + (n - 1) * 4 * chunk
  assert traffic.per_step == want
  assert traffic.per_step <= 2 * (n - 1) / n * payload + (n - 1) * (
    HEADER_BYTES + 8 * 2
  )


@pytest.mark.parametrize(
  ("seconds", "work", "fragments", "error", "names"),
  [
    (0, 1, 1, ValueError, ["round_seconds=0", "> 0"]),
    ("5", 1, 1, ValueError, ["round_seconds='5'", "seconds"]),
    (5.0, 0, 1, ValueError, ["work_per_step=0", ">= 1"]),
    (5.0, 1, 2, ValueError, ["num_fragments", "round_seconds"]),
  ],
)
def test_rounds_on_the_clock_refuse_what_they_cannot_run(
  seconds, work, fragments, error, names
):
  """Issue 42: a bad deadline or weight, and Streaming DiLoCo's fragments
  (which have no deadlines of their own), are refused with the fix."""
  tx = _diloco(optax.adam(1e-2), "i", sync_period=4, num_fragments=fragments)
  engine = split.engine_of(tx, "test")
  with pytest.raises(error) as e:
    checks.round_seconds(seconds, work, engine)
  for name in names:
    assert name in str(e.value), str(e.value)
