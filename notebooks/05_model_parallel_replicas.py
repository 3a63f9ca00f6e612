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
# # shardopt 05 — inside model-parallel replicas
#
# A replica that does not fit one device is itself sharded: tensor
# parallelism over a "model" axis. shardopt then runs over the data axes of a
# **partial-manual** `jax.shard_map` (`axis_names={"island", "data"}`): its
# collectives run over those axes, and XLA partitions the model over "model"
# as it would without shardopt.
#
# Here a small Flax nnx transformer trains on a `(island=2, data=2, model=2)`
# mesh: tensor parallelism inside each replica, synchronous data parallelism
# inside each island (`cross_shard` over "data"), DiLoCo across the islands.
# `shardopt.state_specs` says which state leaves are per island; an orbax
# checkpoint taken between two syncs restores bit-identically.
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

# %% [markdown]
# ## The model: tensor parallel over "model"
#
# Megatron-style: the q/k/v and MLP-up kernels are split by columns
# (`P(None, "model")`), the attention-out and MLP-down kernels by rows
# (`P("model", None)`); the rest is replicated. That is the model's business:
# shardopt never names the "model" axis.

# %%
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax import numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

VOCAB, WIDTH, LAYERS, CONTEXT, BATCH = 32, 16, 2, 8, 2
SYNC, STEPS, SAVE_AT = 4, 12, 6
MANUAL = ("island", "data")


class Block(nnx.Module):
  def __init__(self, width, rngs):
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
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def model_spec(path):
  names = [getattr(k, "key", None) for k in path]
  if any(n in ("q", "k", "v", "up") for n in names):
    return P(None, "model")
  if any(n in ("o", "down") for n in names):
    return P("model", None)
  return P()


graphdef, abstract = nnx.split(TinyLM(nnx.Rngs(0)), nnx.Param)
params0 = nnx.to_pure_dict(abstract)


def loss_fn(p, tokens):
  state = jax.tree.map(lambda x: x, abstract)
  nnx.replace_by_pure_dict(state, p)
  logits = nnx.merge(graphdef, state)(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


mesh = jax.make_mesh(
  (2, 2, 2),
  ("island", "data", "model"),
  axis_types=(AxisType.Auto,) * 3,
  devices=DEVICES,
)
print(mesh)

# %% [markdown]
# ## The optimizer and its state specs
#
# `diloco(cross_shard(adamw, "data"), "island")`: each island averages its
# gradients over "data" every step and takes an AdamW step; every `SYNC`
# steps the islands' outer gradients are averaged over "island" and the outer
# Nesterov step moves the shared center. The params are per island
# (`P("island")`, replicated over "data"): `params_axes="island"`.
# `state_specs` reads which leaves are per island from JAX's types.

# %%
tx = shardopt.diloco(
  shardopt.cross_shard(optax.adamw(3e-3), "data"), "island", sync_period=SYNC
)


def place(tree, stacked):
  """Model sharding per model_spec; islands' copies concatenated on dim 0."""

  def leaf(path, x):
    spec = model_spec(path)
    if stacked:
      first = ("island",) + ((spec[0],) if len(spec) and spec[0] else ())
      spec, x = P(first, *spec[1:]), np.concatenate([x] * 2)
    return jax.device_put(x, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(leaf, tree)


with jax.set_mesh(mesh):
  one_replica = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    place(params0, stacked=False),
  )
  specs = shardopt.state_specs(tx, one_replica, MANUAL, params_axes="island")
for field in ("count", "center", "local_state", "global_state", "restart"):
  leaves = jax.tree.leaves(
    getattr(specs, field), is_leaf=lambda s: isinstance(s, P)
  )
  print(f"{field:13s}", sorted({str(s) for s in leaves}))

# %% [markdown]
# ## Training, and a checkpoint between two syncs

# %%
init = jax.jit(
  jax.shard_map(
    tx.init, mesh=mesh, in_specs=P(), out_specs=specs, axis_names=set(MANUAL)
  )
)


def step(p, s, tokens):
  loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
  updates, s = tx.update(grads, s, p)
  return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, MANUAL)


step = jax.jit(
  jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P("island"), specs, P(MANUAL)),
    out_specs=(P("island"), specs, P()),
    axis_names=set(MANUAL),
  )
)
rng = np.random.default_rng(3)
starts = rng.integers(0, VOCAB, size=(STEPS, 4 * BATCH, 1))
tokens = ((starts + np.arange(CONTEXT + 1)) % VOCAB).astype(np.int32)


def run(first, last, params=None, state=None):
  with jax.set_mesh(mesh):
    if params is None:
      state = init(place(params0, stacked=False))
      params = place(params0, stacked=True)
    for t in range(first - 1, last):
      batch = jax.device_put(tokens[t], NamedSharding(mesh, P(MANUAL)))
      params, state, loss = step(params, state, batch)
      sync = " (sync)" if (t + 1) % SYNC == 0 else ""
      print(f"step {t + 1:2d}: loss {float(loss):.4f}{sync}")
  return params, state


straight_params, straight_state = run(1, STEPS)

# %% [markdown]
# Now the same run, stopped at step 6 (between the syncs at 4 and 8), saved
# with orbax, restored into fresh arrays with the same shardings, and
# continued: the final params and state equal the straight run's, bit for bit.

# %%
import tempfile

params, state = run(1, SAVE_AT)
checkpointer = ocp.StandardCheckpointer()
path = tempfile.mkdtemp() + "/ckpt"
checkpointer.save(path, {"params": params, "state": state})
checkpointer.wait_until_finished()
abstract_tree = jax.tree.map(
  ocp.utils.to_shape_dtype_struct, {"params": params, "state": state}
)
restored = checkpointer.restore(path, abstract_tree)
params, state = run(SAVE_AT + 1, STEPS, restored["params"], restored["state"])
same = jax.tree.map(
  lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
  (params, state),
  (straight_params, straight_state),
)
print(
  "restored run equals the straight run bit for bit:",
  all(jax.tree.leaves(same)),
)

# %% [markdown]
# `tests/test_model_parallel.py` checks every transform this way against the
# run without the model axis, and reads the compiled step: shardopt adds no
# collective over "model" (beyond a one-element finite flag), and each
# collective over the data axes moves a device's model shard of a leaf.
# `tests/test_model_parallel_flax.py` is this notebook as a test.
