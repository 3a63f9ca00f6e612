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
# # shardopt 03 — `TowerOptimizer`: reduce once, update once, state sharded
#
# TensorFlow's `tf.contrib.estimator.TowerOptimizer` summed the gradients of all
# towers and applied the optimizer *once*. `shardopt.tower(inner, "batch")`
# makes "once" literal and cheap: it reduce-scatters the gradients so each
# replica owns `1/n` of every parameter, runs `inner` only on its slice (with
# optimizer state for that slice only), and all-gathers the update. For
# elementwise optimizers (sgd, momentum, adam, adamw, rmsprop, adagrad, lion)
# the result equals `shardopt.cross_shard(inner)`, with `1/n` of the optimizer
# state per device: ZeRO stage 1.
#
# This notebook uses `jax.shard_map` with replicated params and sharded
# optimizer state.

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
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import shardopt


# The workload of the repository's demo (examples/demo.py), which is no part
# of the package: scikit-learn's digits and a small MLP.
def load_digits_split(seed=0):
  """Digits as float32 features in [0, 1] and int32 labels, 80/20 split."""
  digits = load_digits()
  features = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  return train_test_split(
    features, labels, test_size=0.2, random_state=seed, stratify=labels
  )


def init_mlp(key, sizes):
  """Glorot-initialised MLP parameters as a list of {"w", "b"} dicts."""
  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    w = jax.nn.initializers.glorot_normal()(sub, (fan_in, fan_out), jnp.float32)
    params.append({"w": w, "b": jnp.zeros((fan_out,), jnp.float32)})
  return params


def mlp_logits(params, features):
  h = features
  for layer in params[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  return h @ params[-1]["w"] + params[-1]["b"]


def cross_entropy(params, features, labels):
  logits = mlp_logits(params, features)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


n = len(DEVICES)
mesh = jax.sharding.Mesh(np.array(DEVICES), ("batch",))
replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
x_train, _, y_train, _ = load_digits_split()

# %% [markdown]
# ## Specs: params replicated, optimizer state sharded
#
# `tower`'s state is `inner`'s state over the owned slices: replica `i` owns
# the contiguous block `i` of every leaf (the rows from `i * d / n` up to
# `(i + 1) * d / n` of a leaf whose first dimension `d` divides by `n`; other
# leaves: the `i`-th `1/n` of the leaf flattened and zero-padded to a multiple
# of `n`), so the reduce-scatter and the all-gather move contiguous blocks
# and XLA adds no layout copies around them. In `shard_map` the slices get
# `P("batch")` (the global array is the concatenation of the slices: the full
# moment, for a leaf whose first dimension divides by `n`) and scalar
# counters stay `P()`; `shardopt.state_specs` reads that from JAX's types.

# %%
inner = optax.adam(1e-2)
params = jax.device_put(init_mlp(jax.random.key(0), (64, 128, 10)), replicated)


def make_step(tx, state_specs):
  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), state_specs, P("batch"), P("batch")),
    out_specs=(P(), state_specs, P()),
  )
  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(cross_entropy)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return (
      optax.apply_updates(params, updates),
      state,
      jax.lax.pmean(loss, "batch"),
    )

  init = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs)
  )
  return init, step


tower_tx = shardopt.tower(inner, "batch")
cross_tx = shardopt.cross_shard(inner, "batch")
tower_specs = shardopt.state_specs(tower_tx, params, "batch", mesh=mesh)
tower_init, tower_step = make_step(tower_tx, tower_specs)
cross_init, cross_step = make_step(cross_tx, P())


# %%
def per_device_bytes(tree):
  """Bytes of ``tree`` that live on the first device."""
  first = DEVICES[0]
  return sum(
    s.data.nbytes
    for leaf in jax.tree.leaves(tree)
    for s in leaf.addressable_shards
    if s.device == first
  )


batches = np.random.default_rng(0).integers(0, len(x_train), size=(40, n * 32))
runs = {}
for name, init, step in (
  ("tower", tower_init, tower_step),
  ("cross_shard", cross_init, cross_step),
):
  p, state = params, init(params)
  for idx in batches:
    p, state, loss = step(
      p,
      state,
      jax.device_put(x_train[idx], rows),
      jax.device_put(y_train[idx], rows),
    )
    loss = float(loss)
  runs[name] = (p, state, loss)
  print(
    f"{name:<12} loss {loss:.4f}   optimizer state on one device:"
    f" {per_device_bytes(state):>7,} bytes"
  )

diff = max(
  float(jnp.abs(a - b).max())
  for a, b in zip(
    jax.tree.leaves(runs["tower"][0]), jax.tree.leaves(runs["cross_shard"][0])
  )
)
print(
  f"max |params(tower) - params(cross_shard)| after {len(batches)} steps: {diff:.2e}"
)
assert diff < 1e-4  # equal up to the order of float additions
assert (
  per_device_bytes(runs["tower"][1]) * n
  <= per_device_bytes(runs["cross_shard"][1]) + 64 * n
)

# %% [markdown]
# ## TensorFlow's loss scaling, and its test oracle
#
# `TowerOptimizer` divided the loss by the number of towers (unless the
# reduction is SUM) and summed the gradients. Both ways of writing it in
# shardopt give TF's numbers (two towers, `c = 10`, loss
# `sum(|features * c - labels|)` with features = labels = `[[1]]` and
# `[[2]]`, gradient descent with learning rate 1): SUM → `c = 7`,
# MEAN → `c = 8.5`.

# %%
two = jax.sharding.Mesh(np.array(DEVICES[:2]), ("batch",))


def tower_oracle(reduction, scale_loss_first):
  tx = shardopt.tower(
    optax.sgd(1.0), "batch", reduction="sum" if scale_loss_first else reduction
  )

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=two, in_specs=(P(), P("batch")), out_specs=P()
  )
  def step(c, features):
    def loss(c):
      per_tower = jnp.sum(jnp.abs(features * c - features))
      return (
        shardopt.scale_loss(per_tower, "batch", reduction=reduction)
        if scale_loss_first
        else per_tower
      )

    grads = jax.grad(loss)(jax.lax.pcast(c, "batch", to="varying"))
    updates, _ = tx.update(grads, tx.init(c), c)
    return optax.apply_updates(c, updates)

  features = jax.device_put(
    jnp.array([[1.0], [2.0]]), NamedSharding(two, P("batch"))
  )
  return float(step(jnp.float32(10.0), features))


for reduction, want in (("sum", 7.0), ("mean", 8.5)):
  literal, jax_style = (
    tower_oracle(reduction, True),
    tower_oracle(reduction, False),
  )
  print(
    f"{reduction}: TF literal (scale_loss + tower sum) c = {literal},"
    f"  JAX style (tower {reduction}) c = {jax_style}"
  )
  assert literal == jax_style == want

# %% [markdown]
# ## Whole-tree statistics need the sharding-aware version
#
# Inside `tower`, `inner` sees only this replica's slice. Elementwise
# transforms don't care, but `optax.clip_by_global_norm` would clip every slice
# by *its own* norm. `shardopt.clip_by_global_norm(max_norm, "batch")` adds the
# slices' squared norms across replicas first, so it clips by the norm of the
# full gradient.

# %%
grads = {"w": jnp.arange(1.0, 17.0)}  # the same on every replica; norm ~ 38.7


def tower_update(inner):
  tx = shardopt.tower(inner, "batch")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
  def update(g):
    g = jax.lax.pcast(g, "batch", to="varying")  # each replica's own gradient
    return tx.update(g, tx.init(g), g)[0]

  return np.asarray(update(grads)["w"])


full = np.asarray(
  optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]["w"]
)
aware = tower_update(shardopt.clip_by_global_norm(1.0, "batch"))
naive = tower_update(optax.clip_by_global_norm(1.0))
print("norm of the update, sharding-aware clip:", np.linalg.norm(aware))
print("norm of the update, optax clip per slice:", np.linalg.norm(naive))
np.testing.assert_allclose(aware, full, rtol=1e-6)
assert np.linalg.norm(naive) > 1.5

# %% [markdown]
# Safe inside `tower`: `sgd` (with momentum), `adam`, `adamw`, `rmsprop`,
# `adagrad`, `lion`, `clip`, `scale`, schedules, and
# `shardopt.clip_by_global_norm(max_norm, axis)`. Not safe: anything reading a
# whole-tree or whole-leaf statistic (`optax.clip_by_global_norm`, `lamb`/`lars`
# trust ratios, `adafactor`'s factored moments).
