"""Streaming DiLoCo on a scanned Flax nnx transformer language model.

The model keeps its L = 4 blocks in one set of stacked leaves (created with
``nnx.vmap`` over split rngs, applied with ``nnx.scan``: the flax "scan over
layers" idiom), next to non-stacked leaves (token and position embeddings,
the final norm, the unembedding). ``shardopt.diloco(..., num_fragments=4,
layer_axes=...)`` deals layer ``l`` of the stack to fragment ``l % 4`` and
splits the other leaves into 4 contiguous groups balanced by bytes.

Checked here, on 8 replicas under ``jax.pmap`` (each replica its own random
tokens):

a. the bytes each fragment's sync branch all-reduces (compiled HLO) against
   an expectation computed from the leaf sizes with the rule above;
b. the params after every step against a float64 numpy reference of the
   algorithm whose only use of jax is the gradient oracle (``jax.grad`` of
   the model's loss at the reference's own params);
c. a checkpoint taken between a fragment's sync and its merge (through numpy
   and back) continues bit for bit;
d. an int4 outer gradient with error feedback: the run trains, the centers
   stay bit-identical, and the lowered StableHLO moves the outer gradient as
   uint8 (all_to_all + all_gather), with no float32 all-reduce of a
   fragment's size.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _streaming_reference import np_streaming_diloco
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure import hlo

R = 8  # replicas
VOCAB, WIDTH, LAYERS, CONTEXT, BATCH = 16, 16, 4, 8, 2
H, F = 4, 4  # sync period, fragments
LR = 0.05  # inner SGD
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
RTOL, ATOL = 1e-4, 1e-5


# --------------------------------------------------------------------------
# The model: a scanned nnx transformer LM.


class Block(nnx.Module):
  """Pre-norm (RMS) causal self-attention (one head) and an MLP."""

  def __init__(self, rngs: nnx.Rngs):
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
    self.norm1 = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.norm2 = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.qkv = dense(WIDTH, 3 * WIDTH)
    self.o = dense(WIDTH, WIDTH)
    self.up, self.down = dense(WIDTH, 2 * WIDTH), dense(2 * WIDTH, WIDTH)

  def __call__(self, x):
    h = self.norm1(x)
    q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(WIDTH)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + self.o(jnp.einsum("bts,bsd->btd", weights, v))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class ScannedLM(nnx.Module):
  """Embeddings, LAYERS blocks stacked along axis 0 of their leaves, a
  final norm and an unembedding."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.pos = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (CONTEXT, WIDTH))
    )

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_blocks(rngs: nnx.Rngs):
      return Block(rngs)

    self.blocks = create_blocks(rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[-1]]

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return self.head(self.norm(forward(x, self.blocks)))


# XLA:CPU spends most of a compilation in LLVM's optimisation passes; at
# level 0 the programs here compile several times faster (the HLO passes,
# which place the collectives the tests read, still run). Runs call the
# executable compiled once, so a whole run is one compilation.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _compile(lowered):
  return lowered.compile(compiler_options=FAST_COMPILE)


@functools.cache
def _model():
  """(params as a pure dict of numpy arrays, loss(params, tokens),
  layer_axes)."""
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: ScannedLM(nnx.Rngs(0))), nnx.Param
  )

  def create():
    return nnx.to_pure_dict(nnx.state(ScannedLM(nnx.Rngs(0)), nnx.Param))

  params = jax.tree.map(np.asarray, _compile(jax.jit(create).lower())())

  def loss(p, tokens):
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, p)
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  # A pytree prefix of the params: every block leaf stacks its layers along
  # axis 0; the others are not stacks.
  layer_axes = {k: 0 if k == "blocks" else None for k in params}
  return params, loss, layer_axes


def test_the_blocks_are_one_stack_of_layers():
  params, _, layer_axes = _model()
  shapes = jax.tree.map(np.shape, params)
  print(f"params: {shapes}")
  blocks = jax.tree.leaves(params["blocks"])
  assert len(blocks) == 6 and all(b.shape[0] == LAYERS for b in blocks)
  others = [k for k, a in layer_axes.items() if a is None]
  assert sorted(others) == ["embed", "head", "norm", "pos"]


def _random_tokens(steps, seed):
  """(steps, R, BATCH, CONTEXT + 1): every replica its own random tokens."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, VOCAB, (steps, R, BATCH, CONTEXT + 1), np.int32)


def _counting_tokens(steps, seed):
  """A learnable stream: each row counts up from a random start."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, VOCAB, (steps, R, BATCH, 1))
  return ((starts + np.arange(CONTEXT + 1)) % VOCAB).astype(np.int32)


# --------------------------------------------------------------------------
# Training under pmap.


def _diloco(**kwargs):
  return shardopt.diloco(
    optax.sgd(kwargs.pop("lr", LR)),
    "batch",
    sync_period=H,
    outer_learning_rate=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    nesterov=True,
    **kwargs,
  )


def _streaming(**kwargs):
  return _diloco(num_fragments=F, layer_axes=_model()[2], **kwargs)


def _replicated(params):
  return jax.tree.map(lambda p: np.broadcast_to(p, (R,) + p.shape), params)


def _step_fn(tx):
  _, loss, _ = _model()

  def step(params, state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  return step


@functools.cache
def _program(**kwargs):
  """Streaming DiLoCo with ``kwargs``, compiled once: (init, step, compiled
  HLO text, lowered StableHLO text). ``step(params, state, tokens)`` is the
  pmapped step's executable (one compilation for the whole run); it returns
  the new params, state and this replica's loss before the step."""
  tx = _streaming(**dict(kwargs))
  init = jax.pmap(tx.init, axis_name="batch")
  params = _replicated(_model()[0])
  lowered = jax.pmap(_step_fn(tx), axis_name="batch").lower(
    params, init(params), _random_tokens(1, 0)[0]
  )
  step = _compile(lowered)
  return init, step, step.as_text(), lowered.as_text()


def _run(program, tokens, first=1, last=None, params=None, state=None):
  """Steps ``first``..``last`` (1-based) of ``program``: numpy (params,
  state) after every step, the losses (steps, R), and the last (params,
  state) on the devices."""
  init, step, _, _ = program
  if params is None:
    params = _replicated(_model()[0])
    state = init(params)
  history, losses = [], []
  for t in range(first - 1, last or len(tokens)):
    params, state, value = step(params, state, tokens[t])
    jax.block_until_ready(params)  # CPU collectives: one step at a time
    history.append(jax.tree.map(np.asarray, (params, state)))
    losses.append(np.asarray(value))
  return history, np.stack(losses), (params, state)


# --------------------------------------------------------------------------
# Fragment membership, computed here from the rule, and the numpy reference.


def _balanced_groups(nbytes, num_fragments):
  """Contiguous non-empty groups of leaf indices: the k-th cut goes where the
  cumulative bytes come closest to k * total / F (the first such place on a
  tie), with room left for the groups after it."""
  n = len(nbytes)
  if n < num_fragments:
    return [[j] for j in range(n)] + [[] for _ in range(num_fragments - n)]
  cumulative = np.cumsum(nbytes)
  cuts = [0]
  for k in range(1, num_fragments):
    target = k * cumulative[-1] / num_fragments
    allowed = np.arange(cuts[-1] + 1, n - (num_fragments - k) + 1)
    distance = np.abs(cumulative[allowed - 1] - target)
    cuts.append(int(allowed[np.argmin(distance)]))
  cuts.append(n)
  return [list(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]


def _fragment_ids(params, layer_axes, num_fragments):
  """Per leaf (tree order) an int array of the leaf's shape: each element's
  fragment. Layer l of a stack: l % F; the other leaves: balanced groups."""
  axes = jax.tree.leaves(
    jax.tree.broadcast(layer_axes, params, is_leaf=lambda x: x is None),
    is_leaf=lambda x: x is None,
  )
  leaves = jax.tree.leaves(params)
  ids = [None] * len(leaves)
  plain = [i for i, a in enumerate(axes) if a is None]
  groups = _balanced_groups([leaves[i].nbytes for i in plain], num_fragments)
  for f, group in enumerate(groups):
    for j in group:
      ids[plain[j]] = np.full(leaves[plain[j]].shape, f)
  for i, axis in enumerate(axes):
    if axis is not None:
      shape = leaves[i].shape
      view = [1] * len(shape)
      view[axis] = shape[axis]
      layer = np.arange(shape[axis]).reshape(view) % num_fragments
      ids[i] = np.broadcast_to(layer, shape)
  return ids


def _flat(tree, lead):
  """Leaves (*lead, ...) -> (*lead, N) float64, leaves in tree order."""
  return np.concatenate(
    [
      np.asarray(v, np.float64).reshape(lead + (-1,))
      for v in jax.tree.leaves(tree)
    ],
    axis=-1,
  )


def _unflat(vectors, like):
  """(R, N) -> the params' tree with leaves (R, ...) float32."""
  leaves, treedef = jax.tree.flatten(like)
  sizes = np.cumsum([0] + [leaf.size for leaf in leaves])
  return treedef.unflatten(
    [
      vectors[:, a:b].reshape((len(vectors),) + leaf.shape).astype(np.float32)
      for leaf, a, b in zip(leaves, sizes[:-1], sizes[1:])
    ]
  )


@functools.cache
def _grads_oracle():
  """Per replica the gradient of the loss: (R, ...) params, (R, BATCH,
  CONTEXT + 1) tokens -> (R, ...) float32 gradients."""
  params, loss, _ = _model()
  grad = jax.jit(jax.vmap(jax.grad(loss)))
  return _compile(grad.lower(_replicated(params), _random_tokens(1, 0)[0]))


def _np_streaming(tokens, num_fragments, tau, alpha, layer_axes):
  """The algorithm in float64 numpy (tests/_streaming_reference.py); jax
  only gives the gradient of the loss at the reference's params."""
  params0, _, _ = _model()
  ids = np.concatenate(
    [i.reshape(-1) for i in _fragment_ids(params0, layer_axes, num_fragments)]
  )
  grad = _grads_oracle()
  return np_streaming_diloco(
    _flat(params0, ()),
    lambda params, t: _flat(
      grad(_unflat(params, params0), tokens[t - 1]), (R,)
    ),
    len(tokens),
    ids,
    num_fragments=num_fragments,
    period=H,
    tau=tau,
    alpha=alpha,
    lr=LR,
    outer_lr=OUTER_LR,
    outer_momentum=OUTER_MOMENTUM,
    replicas=R,
  )


# --------------------------------------------------------------------------
# a. Bytes per sync, from the compiled HLO.


def _sync_branch_bytes(text):
  """All-reduce-equivalent bytes of the sync branch of every outermost
  conditional of a compiled step that communicates, in program order."""
  top = [op for op in hlo.compiled_collectives(text) if op.context == "top"]
  assert not top, top
  per_branch = []
  for cond in hlo.branch_collectives(text, outermost=True):
    sizes = [sum(hlo.allreduce_equivalent_bytes(op) for op in b) for b in cond]
    assert len(sizes) == 2 and sizes[0] == 0, sizes  # (no sync, sync)
    if sizes[1]:
      per_branch.append(sizes[1])
  return per_branch


@functools.cache
def _diloco_text():
  """Compiled HLO of plain DiLoCo's (F = 1) ``update`` alone (grads =
  params) under pmap."""
  tx = _diloco()
  params = _replicated(_model()[0])
  step = jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="batch")
  return _compile(step.lower(params, jax.pmap(tx.init)(params))).as_text()


def _expected_fragment_bytes():
  params, _, layer_axes = _model()
  ids = _fragment_ids(params, layer_axes, F)
  return [sum(4 * int(np.sum(i == f)) for i in ids) for f in range(F)]


@pytest.mark.parametrize(
  "tau, alpha", [(1, 0.5), (0, 0.0)], ids=["tau1", "tau0"]
)
def test_each_sync_branch_moves_its_fragment(tau, alpha):
  params = _model()[0]
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  blocks = sum(leaf.nbytes for leaf in jax.tree.leaves(params["blocks"]))
  expected = _expected_fragment_bytes()
  plain = [e - blocks // F for e in expected]
  whole = _sync_branch_bytes(_diloco_text())
  streaming = _sync_branch_bytes(
    _program(overlap_steps=tau, overlap_alpha=alpha)[2]
  )
  print(
    f"tau={tau}: param bytes {total} (blocks {blocks}, others"
    f" {total - blocks}); F=1 sync branch {whole}; F=4 sync branches"
    f" {streaming}; expected per fragment {expected} (blocks/4 ="
    f" {blocks // F} + non-stacked {plain})"
  )
  allowance = 16  # the finite flag (a float32 scalar) and slack
  assert len(whole) == 1 and total <= whole[0] <= total + allowance
  # One branch per fragment, in the schedule's order, each its layers of
  # the stack plus its non-stacked leaves.
  assert len(streaming) == F
  for got, want in zip(streaming, expected):
    assert want <= got <= want + allowance, (streaming, expected)
  assert max(streaming) < 0.3 * whole[0]


# --------------------------------------------------------------------------
# b. The params after every step equal the numpy reference.


@pytest.mark.parametrize(
  "tau, alpha", [(1, 0.5), (0, 0.0)], ids=["tau1", "tau0"]
)
def test_params_match_numpy_reference(tau, alpha):
  steps = 9
  tokens = _random_tokens(steps, seed=10 + tau)
  history, _, _ = _run(_program(overlap_steps=tau, overlap_alpha=alpha), tokens)
  ref_params, ref_centers = _np_streaming(tokens, F, tau, alpha, _model()[2])
  for t in range(1, steps + 1):
    params, state = history[t - 1]
    np.testing.assert_allclose(
      _flat(params, (R,)),
      ref_params[t - 1],
      rtol=RTOL,
      atol=ATOL,
      err_msg=f"params after step {t} (tau={tau}, alpha={alpha})",
    )
    centers = _flat(state.center, (R,))
    np.testing.assert_array_equal(
      centers, np.broadcast_to(centers[0], centers.shape)
    )
    # With tau >= 1 the sync of step t runs in the call of step t + 1.
    lagged = t if tau == 0 else t - 1
    np.testing.assert_allclose(
      centers[0],
      ref_centers[lagged],
      rtol=RTOL,
      atol=ATOL,
      err_msg=f"center after call {t} vs reference step {lagged}",
    )
  # The replicas diverge between syncs, and every fragment moved its center.
  spread = np.abs(ref_params[-1] - ref_params[-1].mean(0)).max()
  moved = np.abs(ref_centers[-1] - ref_centers[0])
  ids = np.concatenate(
    [i.reshape(-1) for i in _fragment_ids(_model()[0], _model()[2], F)]
  )
  print(
    f"tau={tau}: replica spread {spread:.2e}; center moved per fragment"
    f" {[float(moved[ids == f].max()) for f in range(F)]}"
  )
  assert spread > 1e-3
  assert all(moved[ids == f].max() > 1e-4 for f in range(F))


# --------------------------------------------------------------------------
# c. A checkpoint between a fragment's sync and its merge.


def test_checkpoint_between_sync_and_merge_continues_bit_for_bit(mesh):
  steps, save_at = 10, 6
  # tau = 2: after step 6, fragment 1 (synced after step 5) merges after
  # step 7, fragment 2's sync of step 6 runs in the call of step 7.
  tokens = _random_tokens(steps, seed=20)
  program = _program(overlap_steps=2, overlap_alpha=0.5)
  straight, _, _ = _run(program, tokens)
  _, _, (params, state) = _run(program, tokens, 1, save_at)
  saved = jax.tree.map(np.asarray, (params, state))
  del params, state
  assert int(saved[1].sync_count[0]) == save_at - 1  # one sync pending
  # Device arrays rebuilt from numpy: every leaf one row per replica.
  replicas = NamedSharding(mesh, P("batch"))
  params, state = jax.tree.map(lambda x: jax.device_put(x, replicas), saved)
  resumed, _, _ = _run(program, tokens, save_at + 1, steps, params, state)
  for t in range(save_at + 1, steps + 1):
    chex.assert_trees_all_equal(resumed[t - save_at - 1], straight[t - 1])


# --------------------------------------------------------------------------
# d. An int4 outer gradient with error feedback.


def test_int4_outer_gradient_with_error_feedback_trains():
  steps = 16
  tokens = _counting_tokens(steps, seed=30)
  program = _program(
    lr=0.5,
    overlap_steps=1,
    overlap_alpha=0.5,
    comm_dtype=jnp.int4,
    error_feedback=True,
  )
  history, losses, _ = _run(program, tokens)
  params, state = history[-1]
  print(f"int4 + error feedback: mean loss per step {losses.mean(1).round(3)}")
  assert losses[-4:].mean() < 0.8 * losses[:4].mean(), losses.mean(1)
  for leaf in jax.tree.leaves(state.center):
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
  errors = jax.tree.leaves(state.error)
  assert errors and all(e.dtype == np.float32 for e in errors)
  assert any(not np.array_equal(e[0], e[1]) for e in errors)  # per replica

  # The wire, in the lowered StableHLO (the CPU backend widens narrow dtypes
  # when it compiles).
  ops = hlo.lowered_collectives(program[3])
  print(
    "lowered collectives:"
    f" {[(op.kind, op.dtypes, op.buffer_bytes) for op in ops]}"
  )
  kinds = {(op.kind, op.dtypes) for op in ops}
  assert ("all-to-all", ("ui8",)) in kinds, kinds
  assert ("all-gather", ("ui8",)) in kinds, kinds
  # No all-reduce of a fragment's size: the only ones left are the float32
  # finite flags (the block scales travel in the uint8 rows).
  smallest = min(_expected_fragment_bytes())
  big = [
    op
    for op in ops
    if op.kind == "all-reduce" and op.buffer_bytes >= smallest / 8
  ]
  assert not big, big
