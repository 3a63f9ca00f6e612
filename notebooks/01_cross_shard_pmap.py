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
# # shardopt 01 — `CrossShardOptimizer` in a `jax.pmap` loop
#
# TensorFlow 1's `tf.compat.v1.tpu.CrossShardOptimizer(opt)` combined the
# gradients of all TPU shards before applying `opt`. In shardopt it is an optax
# transform you put in a chain:
#
# ```python
# tx = optax.chain(shardopt.cross_shard_mean("batch"), optax.adam(1e-3))
# # or, as one wrapper around the optimizer:
# tx = shardopt.cross_shard(optax.adam(1e-3), "batch")
# ```
#
# This notebook trains with it in a `pmap` loop, shows TensorFlow's literal
# recipe (scale the loss, sum the gradients), subgroups of replicas
# (`axis_index_groups`, TF's `group_assignment`), per-replica gradient clipping,
# and the same step under `jax.shard_map`.
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

import shardopt

n = len(DEVICES)
pmap = functools.partial(jax.pmap, axis_name="batch", devices=DEVICES)

# %% [markdown]
# ## 1. A data-parallel training loop
#
# Every replica holds the same weights and sees its own shard of the batch.
# `cross_shard_mean("batch")` averages the gradients over the replicas (a
# `pmean`); Adam then applies the same update everywhere, so the replicas stay
# bit-identical, which `shardopt.replica_divergence` checks (0.0 = in sync).

# %%
rng = np.random.default_rng(0)
true_w = rng.normal(size=(8, 1)).astype(np.float32)
# x: [replica, example, feature]
x = rng.normal(size=(n, 64, 8)).astype(np.float32)
y = x @ true_w + 0.01 * rng.normal(size=(n, 64, 1)).astype(np.float32)


def loss_fn(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


tx = optax.chain(shardopt.cross_shard_mean("batch"), optax.adam(0.05))


def train_step(w, opt_state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(w, x, y)  # this replica's gradient
  updates, opt_state = tx.update(grads, opt_state, w)  # averaged, then Adam
  return optax.apply_updates(w, updates), opt_state, loss


train_step = pmap(train_step)
w = pmap(lambda _: jnp.zeros((8, 1)))(np.arange(n))  # the same on every replica
opt_state = pmap(tx.init)(w)
for step in range(150):
  w, opt_state, loss = train_step(w, opt_state, x, y)
  # (waiting for each step also keeps CPU runs snappy)
  loss = float(loss.mean())

divergence = float(
  pmap(lambda w: shardopt.replica_divergence(w, "batch"))(w)[0]
)
print(f"loss {loss:.5f}   max |w - true_w| = {np.abs(w[0] - true_w).max():.4f}")
print(f"replica divergence: {divergence}")
assert divergence == 0.0 and loss < 1e-3

# %% [markdown]
# ## 2. TensorFlow's recipe, literally
#
# `CrossShardOptimizer(reduction=MEAN)` divided the loss by the number of shards
# in `compute_gradients` and *summed* the gradients in `apply_gradients`. The
# literal port is `shardopt.scale_loss` + `shardopt.cross_shard_sum`; it gives
# the same update as `cross_shard_mean` on the unscaled loss. (Scaling the loss
# *and* averaging would divide twice.)

# %%
w0 = pmap(lambda _: jnp.zeros((8, 1)))(np.arange(n))


def first_update(loss_transform, reduce_tx):
  tx = optax.chain(reduce_tx, optax.sgd(0.1))

  def step(w, x, y):
    grads = jax.grad(lambda w: loss_transform(loss_fn(w, x, y)))(w)
    updates, _ = tx.update(grads, tx.init(w), w)
    return updates

  return np.asarray(pmap(step)(w0, x, y)[0])


tf_literal = first_update(
  lambda loss: shardopt.scale_loss(loss, "batch"),
  shardopt.cross_shard_sum("batch"),
)
jax_style = first_update(lambda loss: loss, shardopt.cross_shard_mean("batch"))
print("max |difference|:", np.abs(tf_literal - jax_style).max())
np.testing.assert_allclose(tf_literal, jax_style, rtol=1e-6)

# %% [markdown]
# ## 3. Subgroups of replicas
#
# `axis_index_groups` (TF's `group_assignment`) reduces within each group only:
# here the first and the second half of the replicas each average on their own.
# TensorFlow's test oracle: SGD with learning rate 1 from `w = 0`, replica `i`'s
# gradient is `i + 1`; each replica lands on minus its group's mean gradient.
# Every member of a group ends with bit-identical values.

# %%
half = n // 2
groups = [list(range(half)), list(range(half, n))]


def sgd_step(reduce_tx):
  tx = optax.chain(reduce_tx, optax.sgd(1.0))

  def step(w, g):
    updates, _ = tx.update(g, tx.init(w), w)
    return optax.apply_updates(w, updates)

  return np.asarray(
    pmap(step)(np.zeros(n, np.float32), np.arange(1.0, n + 1, dtype=np.float32))
  )


print("groups:", groups)
print("mean, all replicas :", sgd_step(shardopt.cross_shard_mean("batch")))
print(
  "mean, within groups:",
  sgd_step(shardopt.cross_shard_mean("batch", axis_index_groups=groups)),
)
print(
  "sum,  within groups:",
  sgd_step(shardopt.cross_shard_sum("batch", axis_index_groups=groups)),
)
g = np.arange(1.0, n + 1)
np.testing.assert_allclose(
  sgd_step(shardopt.cross_shard_mean("batch", axis_index_groups=groups)),
  np.repeat([-g[:half].mean(), -g[half:].mean()], half),
)

# %% [markdown]
# ## 4. Clip each replica's gradient before combining
#
# TF's `CrossShardOptimizer` defers the sum to `apply_gradients` "so that user
# can modify the gradients like clipping with per replica global norm": one
# replica's huge gradient should not swamp everyone else's. In optax that is
# the order of the chain: clip first (per replica), then combine.
#
# Replica 0 sees an outlier gradient `[100, 0]`; the others see `[0, 1]`.

# %%
grads = np.zeros((n, 2), np.float32)
grads[0] = [100.0, 0.0]
grads[1:] = [0.0, 1.0]

clip_then_mean = optax.chain(
  optax.clip_by_global_norm(1.0), shardopt.cross_shard_mean("batch")
)
mean_then_clip = optax.chain(
  shardopt.cross_shard_mean("batch"), optax.clip_by_global_norm(1.0)
)


def combined(tx):
  return np.asarray(pmap(lambda g: tx.update(g, tx.init(g))[0])(grads)[0])


print("clip per replica, then mean:", combined(clip_then_mean))
print("mean, then clip            :", combined(mean_then_clip))
# Per-replica clipping: the outlier counts as one replica out of n.
np.testing.assert_allclose(
  combined(clip_then_mean), [1 / n, (n - 1) / n], rtol=1e-6
)

# %% [markdown]
# ## 5. The same step under `jax.shard_map`
#
# `pmap` is in maintenance mode; `jax.shard_map` over a mesh is the modern
# path. Params can stay replicated (`P()`): their gradient is then typed
# *invariant* because autodiff has already summed it over the axis, and
# `cross_shard_mean` divides that sum by the number of replicas instead of
# summing again. No change to the optimizer.

# %%
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jax.sharding.Mesh(np.array(DEVICES), ("batch",))
tx = shardopt.cross_shard(optax.adam(0.05), "batch")


@jax.jit
@functools.partial(
  jax.shard_map,
  mesh=mesh,
  in_specs=(P(), P(), P("batch"), P("batch")),
  out_specs=(P(), P(), P()),
)
def sharded_step(w, opt_state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
  updates, opt_state = tx.update(grads, opt_state, w)
  return (
    optax.apply_updates(w, updates),
    opt_state,
    jax.lax.pmean(loss, "batch"),
  )


rows = NamedSharding(mesh, P("batch"))
x_rows = jax.device_put(x.reshape(-1, 8), rows)
y_rows = jax.device_put(y.reshape(-1, 1), rows)
w = jax.device_put(jnp.zeros((8, 1)), NamedSharding(mesh, P()))
opt_state = jax.device_put(tx.init(w), NamedSharding(mesh, P()))
for step in range(150):
  w, opt_state, loss = sharded_step(w, opt_state, x_rows, y_rows)
  loss = float(loss)
print(
  f"loss {loss:.5f}   max |w - true_w| = {np.abs(np.asarray(w) - true_w).max():.4f}"
)
assert loss < 1e-3

# %% [markdown]
# Next: `02_agn_local_steps.ipynb` (communicate every T steps: AGN, local SGD,
# DiLoCo) and `03_tower_sharded_state.ipynb` (TowerOptimizer with the optimizer
# state split across replicas). Porting TF1 code? See `docs/migration.md`.
