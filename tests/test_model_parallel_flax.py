"""The deployment, end to end (issue 21, item 6): a Flax nnx transformer with
tensor parallelism over "model", synchronous data parallelism over "data" and
DiLoCo over "island", on a (island=2, data=2, model=2) mesh of the 8 CPU
devices, with ``shardopt.state_specs`` and an orbax checkpoint saved and
restored in the middle of a DiLoCo period.

The params of an island are replicated over "data" (``P("island")``, each
island's copy sharded over "model"); the gradients of a data replica are
reduced over "data" by ``cross_shard`` inside ``diloco``, whose outer step
runs over "island" every ``SYNC`` steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _model_parallel import only_mesh_axes
from _model_parallel import stacked_sharding
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

VOCAB, WIDTH, LAYERS, CONTEXT, BATCH = 32, 16, 2, 8, 2
SYNC, STEPS, SAVE_AT = 4, 10, 6  # step 6 lies between the syncs at 4 and 8
MANUAL = ("island", "data")


class Block(nnx.Module):
  """Pre-norm causal self-attention (one head) and an MLP."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.q, self.k, self.v = (dense(width, width) for _ in range(3))
    self.o = dense(width, width)
    self.up, self.down = dense(width, 4 * width), dense(4 * width, width)

  def __call__(self, x):
    h = self.norm1(x)
    q, k, v = self.q(h), self.k(h), self.v(h)
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + self.o(jnp.einsum("bts,bsd->btd", weights, v))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _model_spec(path) -> P:
  """Tensor parallel (Megatron style): q/k/v/up column-parallel, o/down
  row-parallel, everything else replicated over "model"."""
  names = [getattr(k, "key", None) for k in path]
  if any(n in ("q", "k", "v", "up") for n in names):
    return P(None, "model")
  if any(n in ("o", "down") for n in names):
    return P("model", None)
  return P()


def _setup():
  model = TinyLM(nnx.Rngs(0))
  graphdef, abstract = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(abstract)

  def loss(p, tokens):
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, p)
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  return params, loss


def _tx():
  inner = shardopt.cross_shard(optax.adamw(3e-3), "data")
  return shardopt.diloco(inner, "island", sync_period=SYNC)


def _sharded(mesh, tree, stack: bool):
  """Places ``tree`` on ``mesh``: model axis per _model_spec (if the mesh has
  one), and with ``stack`` the islands' copies concatenated along dim 0."""

  def place(path, x):
    spec = _model_spec(path)
    if stack:
      x = np.concatenate([x] * mesh.shape["island"])
      return jax.device_put(x, stacked_sharding(mesh, ("island",), spec))
    return jax.device_put(x, NamedSharding(mesh, only_mesh_axes(spec, mesh)))

  return jax.tree_util.tree_map_with_path(place, tree)


@functools.cache
def _program(with_model: bool):
  """(mesh, init, step, params, specs), compiled once per mesh."""
  mesh = _mesh(with_model)
  params, loss = _setup()
  tx = _tx()
  local = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    _sharded(mesh, params, stack=False),
  )
  specs = shardopt.state_specs(tx, local, MANUAL, params_axes="island")
  init = jax.jit(
    jax.shard_map(
      tx.init, mesh=mesh, in_specs=P(), out_specs=specs, axis_names=set(MANUAL)
    )
  )

  def step(p, s, tokens):
    grads = jax.grad(loss)(p, tokens)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P("island"), specs, P(MANUAL)),
      out_specs=(P("island"), specs),
      axis_names=set(MANUAL),
    ),
    donate_argnums=(0, 1),
  )
  return mesh, init, step, params, specs


def _tokens():
  rng = np.random.default_rng(3)
  # A learnable stream: each row counts up from a random start (mod VOCAB).
  starts = rng.integers(0, VOCAB, size=(STEPS, 4 * BATCH, 1))
  return ((starts + np.arange(CONTEXT + 1)) % VOCAB).astype(np.int32)


def _run(with_model, first, last, params=None, state=None):
  """Steps ``first``..``last`` (1-based); starts fresh when params is None."""
  mesh, init, step, p0, _ = _program(with_model)
  with jax.set_mesh(mesh):
    if params is None:
      state = init(_sharded(mesh, p0, stack=False))
      params = _sharded(mesh, p0, stack=True)
    tokens = _tokens()
    data = NamedSharding(mesh, P(MANUAL))
    for t in range(first - 1, last):
      params, state = step(params, state, jax.device_put(tokens[t], data))
      jax.block_until_ready(params)
  return params, state


def _mesh(with_model: bool):
  shape = {"island": 2, "data": 2} | ({"model": 2} if with_model else {})
  return jax.make_mesh(
    tuple(shape.values()),
    tuple(shape),
    axis_types=(AxisType.Auto,) * len(shape),
    devices=jax.devices()[: int(np.prod(list(shape.values())))],
  )


def _numpy(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def straight():
  """STEPS steps without interruption, as numpy (params, state)."""
  params, state = _run(True, 1, STEPS)
  return _numpy(params), _numpy(state), state


@pytest.mark.slow
def test_tensor_parallel_data_parallel_diloco_matches_the_run_without_model(
  straight,
):
  params, _, state = straight
  reference, _ = _run(False, 1, STEPS)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
    params,
    _numpy(reference),
  )
  # The center (the outer params) is bit-identical on every device that holds
  # the same model shard of it (every island and data replica).
  for leaf in jax.tree.leaves(state.center):
    by_index = {}
    for shard in leaf.addressable_shards:
      key = str(shard.index)
      by_index.setdefault(key, []).append(np.asarray(shard.data))
    for copies in by_index.values():
      assert len(copies) >= 4
      for copy in copies[1:]:
        np.testing.assert_array_equal(copy, copies[0])
  # Islands trained apart after the last sync (step 8): they differ.
  w = params["head"]["kernel"]
  assert not np.array_equal(w[:WIDTH], w[WIDTH:])


@pytest.mark.slow
def test_orbax_checkpoint_mid_period_continues_bit_identically(
  straight, tmp_path
):
  params, state = _run(True, 1, SAVE_AT)
  assert int(state.count) % SYNC != 0  # mid-period
  abstract = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, {"params": params, "state": state}
  )
  with ocp.StandardCheckpointer() as checkpointer:  # closed when done
    checkpointer.save(tmp_path / "ckpt", {"params": params, "state": state})
    checkpointer.wait_until_finished()
    del params, state
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  params, state = _run(
    True, SAVE_AT + 1, STEPS, restored["params"], restored["state"]
  )
  jax.tree.map(np.testing.assert_array_equal, _numpy(params), straight[0])
  jax.tree.map(np.testing.assert_array_equal, _numpy(state), straight[1])
