# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # shardopt 04 — sync schedules: hierarchy, islands, fragments
#
# `agn`, `local_sgd` and `diloco` synchronise everything, over the whole axis,
# every T steps. Real deployments do three other things, and shardopt's
# periodic engine runs all of them as a *schedule* (which leaves, over which
# group of replicas, after which step), with every collective inside the
# sync branch of one `lax.cond` per sync; the conds' predicates come from one
# index, so at most one of them fires on a step:
#
# 1. **hierarchical local SGD**: average often within small groups, rarely
#    over everyone (`shardopt.hierarchical_local_sgd`);
# 2. **DiLoCo across islands**: synchronous data parallelism inside each
#    island, DiLoCo across islands, on a 2-D mesh `("island", "data")`;
# 3. **Streaming DiLoCo**: one fragment of the params at a time
#    (`shardopt.diloco(..., num_fragments=F)`).
#
# Runs on a Colab TPU, a multi-GPU machine, or a CPU (8 virtual devices).

# %%
# Setup: install shardopt on Colab (only there), then pick the devices.
import glob
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  # shardopt has no PyPI release. This cell installs the wheel you upload to
  # Colab's files (build it with `make wheel`: dist/shardopt-*.whl). To install
  # from the git repository instead, set SHARDOPT_PIP_SPEC (here or in the
  # environment) to its URL, "git+https://github.com/OWNER/shardopt.git".
  SHARDOPT_PIP_SPEC = os.environ.get("SHARDOPT_PIP_SPEC", "")
  if not SHARDOPT_PIP_SPEC:
    wheels = glob.glob("shardopt-*.whl") + glob.glob("/content/shardopt-*.whl")
    if not wheels:
      raise FileNotFoundError(
        "Upload dist/shardopt-*.whl (from `make wheel`) to Colab's files, or"
        " set SHARDOPT_PIP_SPEC to the repository URL (git+https://...)."
      )
    SHARDOPT_PIP_SPEC = max(wheels, key=os.path.getmtime)
  print(f"Installing shardopt from {SHARDOPT_PIP_SPEC}")
  subprocess.run(
    [sys.executable, "-m", "pip", "install", "-q", SHARDOPT_PIP_SPEC],
    check=True,
  )

# With no TPU/GPU (or a single one), train on 8 virtual CPU devices. XLA reads
# this flag when JAX starts its backends, so it must be set before the first
# JAX computation; it only changes the CPU backend, never a TPU or GPU.
NUM_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" {_FLAG}={NUM_DEVICES}"
  ).strip()

import jax

if jax.default_backend() in ("tpu", "gpu") and jax.device_count() > 1:
  DEVICES = jax.devices()[:NUM_DEVICES]  # a TPU slice or a multi-GPU box
else:
  DEVICES = jax.devices("cpu")[:NUM_DEVICES]
print(f"JAX {jax.__version__}: {len(DEVICES)} x {DEVICES[0].device_kind}")

# %%
import functools

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

n = len(DEVICES)
pmap = functools.partial(jax.pmap, axis_name="batch", devices=DEVICES)

# The HLO reader under shardopt.measure.traffic: shardopt's internal door
# for the benchmarks and the tests (its names may change between releases).
from shardopt.measure import hlo

rng = np.random.default_rng(0)
true_w = rng.normal(size=(16,)).astype(np.float32)


def batches(steps, *lead):
  """Regression data, one batch per replica per step: (steps, *lead, 32, 16)."""
  x = rng.normal(size=(steps, *lead, 32, 16)).astype(np.float32)
  y = x @ true_w + 0.1 * rng.normal(size=(steps, *lead, 32)).astype(np.float32)
  return x, y


def loss_fn(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# %% [markdown]
# ## 1. Hierarchical local SGD
#
# `period_group_sizes={2: 2, 4: 4, 8: 8}`: after every 2nd local step the
# replicas average in pairs (0-1, 2-3, ...), after every 4th in fours, after
# every 8th all together. After step `t` the largest period dividing `t`
# wins. The params are averaged directly, as PyTorch's
# `HierarchicalModelAverager` does (shardopt averages after steps T, 2T, ...;
# PyTorch counts from 0, so start its `step` at 1 to get the same schedule).

# %%
tx = shardopt.hierarchical_local_sgd(
  optax.sgd(0.05), "batch", period_group_sizes={2: 2, 4: 4, 8: 8}
)


def train_step(params, state, x, y):
  grads = jax.grad(loss_fn)(params, x, y)
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  # How many distinct values of w[0] are there across replicas?
  gathered = jax.lax.all_gather(params["w"][0], "batch")
  return params, state, gathered


train_step = pmap(train_step)
params = pmap(lambda _: {"w": jnp.zeros(16), "b": jnp.zeros(())})(np.arange(n))
state = pmap(tx.init)(params)
x, y = batches(8, n)
for t in range(8):
  params, state, gathered = train_step(params, state, x[t], y[t])
  jax.block_until_ready((params, state))  # CPU collectives: one step at a time
  groups = len(np.unique(np.round(np.asarray(gathered[0]), 5)))
  print(
    f"after step {t + 1}: {groups} distinct replica values,"
    f" syncs so far {int(state.sync_count[0])}"
  )

# %% [markdown]
# Each level's collectives run within its groups only. The compiled HLO of the
# step has one `conditional` per level (its false branch: no sync; then one for
# the local state's restart, which communicates nothing); the replica groups of
# each sync branch's all-reduce say who talks to whom:

# %%
text = train_step.lower(params, state, x[0], y[0]).compile().as_text()
conds = hlo.branch_collectives(text, outermost=True)
for level, (no_sync, sync) in enumerate(conds):
  sizes = sorted({op.group_size for op in sync if op.kind == "all-reduce"})
  print(
    f"cond {level}: {len(no_sync)} collectives without a sync,"
    f" {len(sync)} in the sync branch, group sizes {sizes}"
  )
outside = [op for op in hlo.compiled_collectives(text) if op.context == "top"]
print(
  f"outside the conds: {[op.kind for op in outside]}"
  " (the all-gather above is this notebook's own diagnostic)"
)

# %% [markdown]
# ## 2. DiLoCo across islands
#
# DiLoCo as deployed: a 2-D mesh `("island", "data")`. Inside each island the
# replicas run synchronous data parallelism (`cross_shard(adamw, "data")`
# all-reduces the gradients over `"data"` every step); across islands DiLoCo
# syncs every H steps over `"island"`. The params are `P("island")`: one copy
# per island, replicated over `"data"`.

# %%
ISLANDS, DATA, H = 2, n // 2, 4
mesh = jax.make_mesh((ISLANDS, DATA), ("island", "data"), devices=DEVICES)
tx = shardopt.diloco(
  shardopt.cross_shard(optax.adamw(0.05), "data"), "island", sync_period=H
)
params = {
  "w": np.zeros((ISLANDS, 16), np.float32),
  "b": np.zeros((ISLANDS,), np.float32),
}
# One island's params, (1, ...) blocks of the P("island") arrays; they are
# replicated over "data" (params_axes). state_specs says which state leaves
# are per island (the local AdamW state) and which are shared (the center).
one_island = {"w": jnp.zeros((1, 16)), "b": jnp.zeros((1,))}
specs = shardopt.state_specs(
  tx, one_island, ("island", "data"), mesh=mesh, params_axes="island"
)


def island_step(params, state, x, y):  # params: this island's copy, (1, ...)
  grads = jax.grad(
    lambda p: loss_fn(jax.tree.map(lambda v: v[0], p), x[0, 0], y[0, 0])
  )(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


data_spec = P("island", "data")
init = jax.jit(  # every island starts from the same params: in_specs P()
  jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
)
island_step = jax.jit(
  jax.shard_map(
    island_step,
    mesh=mesh,
    in_specs=(P("island"), specs, data_spec, data_spec),
    out_specs=(P("island"), specs),
  )
)
put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
state = init(put(one_island, P()))
params = put(params, P("island"))
x, y = batches(3 * H, ISLANDS, DATA)
for t in range(3 * H):
  params, state = island_step(
    params, state, put(x[t], data_spec), put(y[t], data_spec)
  )
  jax.block_until_ready(params)
island0 = jax.tree.map(lambda v: np.asarray(v)[0], params)
loss = float(loss_fn(island0, x.reshape(-1, 16), y.reshape(-1)))
print(
  f"after {3 * H} steps: {int(state.sync_count)} outer steps, loss {loss:.4f}"
)

# %% [markdown]
# Bytes per step over each axis, read from the compiled HLO: the all-reduce
# over `"data"` (groups of 4) runs on every step, outside the conds; the one
# over `"island"` (groups of 2) runs inside the sync branch, once every H steps.

# %%
text = (
  island_step.lower(params, state, put(x[0], data_spec), put(y[0], data_spec))
  .compile()
  .as_text()
)
param_bytes = sum(v.size * 4 for v in jax.tree.leaves(params)) // ISLANDS
per_axis = {}
for op in hlo.compiled_collectives(text):
  axis = {DATA: "data", ISLANDS: "island"}[op.group_size]
  every = H if "conditional" in op.context else 1
  per_axis.setdefault(axis, []).append((op.kind, op.buffer_bytes, every))
for axis, ops in per_axis.items():
  per_step = sum(b / every for _, b, every in ops)
  print(
    f'over "{axis}": {[(k, b) for k, b, _ in ops]}, every'
    f" {ops[0][2]} step(s): {per_step:.0f} bytes per step on average"
    f" ({param_bytes} param bytes)"
  )

# %% [markdown]
# `local_sgd` nests the same way. `agn` accumulates the gradients it is
# given, so reduce them over `"data"` first:
# `optax.chain(shardopt.cross_shard_mean("data"), shardopt.agn(opt, "island"))`.
# Islands need `jax.shard_map`: JAX's `pmap` does not nest.
#
# ## 3. Streaming DiLoCo
#
# `num_fragments=F` splits the leaves into F fragments (contiguous in
# `jax.tree.leaves` order, balanced by bytes); fragment f syncs after the
# steps t with `t % H == (f * H) // F`. Each sync all-reduces one fragment, so
# the peak bytes of a step drop to about 1/F of DiLoCo's.


# %%
def mlp_init(key):
  sizes = [16, 48, 48, 48, 48, 48, 1]
  keys = jax.random.split(key, len(sizes) - 1)
  return {
    f"layer{i}": {
      "w": jax.random.normal(k, (a, b)) / np.sqrt(a),
      "b": jnp.zeros(b),
    }
    for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
  }


def mlp_loss(params, x, y):
  h = x
  for i in range(len(params)):
    h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    h = jax.nn.relu(h) if i < len(params) - 1 else h
  return jnp.mean((h[..., 0] - y) ** 2)


H = 8
x, y = batches(64, n)
results = {}
for fragments in (1, 4):
  tx = shardopt.diloco(
    optax.adam(3e-3), "batch", sync_period=H, num_fragments=fragments
  )

  def step(params, state, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = pmap(step)
  params = pmap(lambda _: mlp_init(jax.random.key(0)))(np.arange(n))
  state = pmap(tx.init)(params)
  text = step.lower(params, state, x[0], y[0]).compile().as_text()
  conds = hlo.branch_collectives(text, outermost=True)
  per_sync = [sum(op.buffer_bytes for op in c[1]) for c in conds if c[1]]
  for t in range(len(x)):
    params, state = step(params, state, x[t], y[t])
    jax.block_until_ready(params)
  center = jax.tree.map(lambda v: v[0], state.center)
  loss = float(mlp_loss(center, x.reshape(-1, 16), y.reshape(-1)))
  results[fragments] = (per_sync, loss)
  print(
    f"F={fragments}: bytes per sync branch {per_sync}; peak"
    f" {max(per_sync)} bytes, mean {sum(per_sync) / H:.0f} bytes per step;"
    f" loss of the center after {len(x)} steps {loss:.4f}"
  )

peak_ratio = max(results[4][0]) / max(results[1][0])
print(f"peak bytes, F=4 / F=1: {peak_ratio:.2f}")

# %% [markdown]
# ## 4. Streaming DiLoCo on a scanned transformer
#
# A transformer written with `nnx.scan` keeps its L blocks in a few *stacked*
# leaves (each weight once, with a leading layer axis), which whole-leaf
# fragments cannot split. `layer_axes`, a pytree prefix of the params (`0`
# for the blocks' leaves, `None` for the others), gives each leaf's layer
# axis:
#
# * **layer fragments, strided**: layer `l` of the stack belongs to fragment
#   `l % F`, so every fragment holds layers from the bottom to the top of the
#   network, as in the paper; the leaves that are not stacks (embeddings,
#   final norm, unembedding) are split into F contiguous groups balanced by
#   bytes. Fragment f syncs after the steps t with `t % H == (f * H) // F`
#   and has its own outer Nesterov momentum.
# * **overlap** (`overlap_steps=tau`, `overlap_alpha=alpha`): after a
#   fragment's sync the replicas keep training on their own params; `tau`
#   steps later each replica's fragment becomes
#   `alpha * local + (1 - alpha) * center`. With `tau >= 1` the sync of step
#   t runs inside the update of step t + 1 from the params that update is
#   given, so its collective does not depend on that step's forward and
#   backward pass (`state.center` shows it one call later).
# * **int4 wire** (`comm_dtype=jnp.int4`): the outer gradient travels as
#   4-bit integers with one float32 scale per block, in two collectives of
#   uint8 rows: an all-to-all (each replica sums one chunk of everyone's),
#   then an all-gather of the re-quantized chunks, so every replica ends with
#   the same center, bit for bit. With `error_feedback=True` each replica
#   keeps what the rounding dropped from its contribution (`state.error`)
#   and adds it to its next one.
#
# Here: `L = 4` blocks, `F = 4`, `H = 8`, `tau = 1`, `alpha = 0.5`, plain SGD
# inside, on 8 replicas that each see their own token sequences.

# %%
from flax import nnx

VOCAB, WIDTH, LAYERS, CONTEXT, BATCH = 16, 16, 4, 8, 4
# XLA:CPU spends most of a compilation in LLVM's optimisation passes, which
# programs this small do not need: skip them on the CPU.
COMPILER_OPTIONS = (
  {"xla_backend_optimization_level": 0} if DEVICES[0].platform == "cpu" else {}
)


class Block(nnx.Module):
  """Pre-norm causal self-attention (one head) and an MLP."""

  def __init__(self, rngs: nnx.Rngs):
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
    self.norm1 = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.norm2 = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.qkv, self.o = dense(WIDTH, 3 * WIDTH), dense(WIDTH, WIDTH)
    self.up, self.down = dense(WIDTH, 2 * WIDTH), dense(2 * WIDTH, WIDTH)

  def __call__(self, x):
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(WIDTH)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + self.o(jnp.einsum("bts,bsd->btd", weights, v))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class ScannedLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

    # The blocks: created by nnx.vmap over split rngs, so each of their
    # weights is one leaf with a leading axis of LAYERS.
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_blocks(rngs: nnx.Rngs):
      return Block(rngs)

    self.blocks = create_blocks(rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):  # applies the blocks one after the other
      return block(x)

    return self.head(self.norm(forward(self.embed(tokens), self.blocks)))


graphdef, abstract = nnx.split(
  nnx.eval_shape(lambda: ScannedLM(nnx.Rngs(0))), nnx.Param
)
lm_params = (
  jax.jit(
    lambda: nnx.to_pure_dict(nnx.state(ScannedLM(nnx.Rngs(0)), nnx.Param))
  )
  .lower()
  .compile(COMPILER_OPTIONS)()
)
layer_axes = {k: 0 if k == "blocks" else None for k in lm_params}
print(jax.tree.map(jnp.shape, lm_params))


def lm_loss(p, tokens):
  state = jax.tree.map(lambda x: x, abstract)
  nnx.replace_by_pure_dict(state, p)
  logits = nnx.merge(graphdef, state)(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def token_batches(steps):
  """Rows that count up from a random start (mod VOCAB): (steps, n, BATCH,
  CONTEXT + 1), every replica its own rows."""
  starts = rng.integers(0, VOCAB, size=(steps, n, BATCH, 1))
  return ((starts + np.arange(CONTEXT + 1)) % VOCAB).astype(np.int32)


# %% [markdown]
# The step, compiled once; the bytes each replica sends, read from its HLO.
# There is one `lax.cond` per fragment (in fragment order), and all of a
# sync's collectives sit in its branch. Bytes sent per replica in
# bandwidth-optimal algorithms over g replicas: an all-reduce of a buffer of
# B bytes `2 (g - 1) / g * B`, an all-to-all or all-gather `(g - 1) / g * B`.
# Plain DiLoCo (`F = 1`, float32) and synchronous training (an all-reduce of
# every gradient every step, `cross_shard_mean`) are compiled only to read
# their bytes.

# %%
LM_H, LM_F, TAU, ALPHA = 8, 4, 1, 0.5


def sent(op):
  share = (op.group_size - 1) / op.group_size * op.buffer_bytes
  return 2 * share if op.kind == "all-reduce" else share


def sync_bytes(text):
  """Bytes sent per replica: (top level, [per cond: its sync branch])."""
  ops = hlo.compiled_collectives(text, num_devices=n)
  top = sum(sent(op) for op in ops if op.context == "top")
  conds = hlo.branch_collectives(text, num_devices=n, outermost=True)
  return top, [sum(sent(op) for op in cond[1]) for cond in conds]


def update_text(tx):
  """Compiled HLO of tx.update alone (grads = params)."""
  update = pmap(lambda p, s: tx.update(p, s, p))
  p = jax.tree.map(lambda v: np.broadcast_to(v, (n, *v.shape)), lm_params)
  return update.lower(p, pmap(tx.init)(p)).compile(COMPILER_OPTIONS).as_text()


tx = shardopt.diloco(
  optax.sgd(0.5),
  "batch",
  sync_period=LM_H,
  num_fragments=LM_F,
  overlap_steps=TAU,
  overlap_alpha=ALPHA,
  layer_axes=layer_axes,
  comm_dtype=jnp.int4,
  error_feedback=True,
)


def lm_step(params, state, tokens):
  loss, grads = jax.value_and_grad(lm_loss)(params, tokens)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


params = jax.tree.map(lambda v: np.broadcast_to(v, (n, *v.shape)), lm_params)
state = pmap(tx.init)(params)
tokens = token_batches(24)
lm_step = (
  pmap(lm_step).lower(params, state, tokens[0]).compile(COMPILER_OPTIONS)
)
_, per_fragment = sync_bytes(lm_step.as_text())
first_sync = hlo.branch_collectives(lm_step.as_text(), outermost=True)[0][1]
sync_top, _ = sync_bytes(
  update_text(optax.chain(shardopt.cross_shard_mean("batch"), optax.sgd(0.5)))
)
_, (diloco_sync,) = sync_bytes(
  update_text(shardopt.diloco(optax.sgd(0.5), "batch", sync_period=LM_H))
)
param_bytes = sum(v.nbytes for v in jax.tree.leaves(lm_params))
print(f"{param_bytes} param bytes (float32)")
print(f"bytes sent per replica by each fragment's sync: {per_fragment}")
print(
  "fragment 0's sync:",
  [(op.kind, *op.dtypes, op.buffer_bytes) for op in first_sync],
  "(the float32 scalar is the finite flag)",
)

# %%
phases = [(f * LM_H) // LM_F for f in range(LM_F)]
sent_per_step = []
print("step  sync of fragment  bytes sent  mean loss")
for t in range(1, len(tokens) + 1):
  params, state, loss = lm_step(params, state, tokens[t - 1])
  jax.block_until_ready(params)  # CPU collectives: one step at a time
  # With tau >= 1 the sync of step t - 1 runs in the update of step t.
  s = t - min(TAU, 1)
  due = [f for f, ph in enumerate(phases) if s >= 1 and s % LM_H == ph]
  sent_per_step.append(sum(per_fragment[f] for f in due))
  print(
    f"{t:4d}  {' '.join(map(str, due)) or '-':>16}"
    f"  {sent_per_step[-1]:10.0f}  {float(np.mean(loss)):9.3f}"
  )
same = all(
  (np.asarray(c) == np.asarray(c)[:1]).all()
  for c in jax.tree.leaves(state.center)
)
print(f"centers bit-identical on the {n} replicas: {same}")

peak = max(sent_per_step)
print(
  f"peak bytes of a step: {peak:.0f}; DiLoCo (F = 1, float32)"
  f" {diloco_sync:.0f} ({diloco_sync / peak:.0f}x more); synchronous"
  f" {sync_top:.0f} ({sync_top / peak:.0f}x more)"
)
print(
  f"mean bytes per step: {np.mean(sent_per_step):.0f}; DiLoCo"
  f" {diloco_sync / LM_H:.0f}; synchronous {sync_top:.0f}"
)

# %% [markdown]
# DiLoCo already sends `1/H` of synchronous training's bytes on average, but
# all of them on one step. Streaming DiLoCo's peak is one fragment's sync:
# about `1/F` of the params (the stacked layers split evenly; each fragment
# also carries the non-stacked leaves it got), and the int4 wire sends about
# an eighth of float32's bytes plus the block scales (one per block of each
# fragment piece's chunks, which weighs on tiny leaves such as norm scales).
