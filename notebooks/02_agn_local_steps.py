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
# # shardopt 02 — communicate every T steps: AGN, local SGD, DiLoCo
#
# TensorFlow's `tf.contrib.opt.AGNOptimizer` (Accumulated Gradient
# Normalization, Hermans et al. 2017) lets every worker take `T` local steps,
# then commits the *normalized* accumulated gradient (sum of the `T` gradients
# divided by `T`) to shared center variables. shardopt runs it synchronously
# across replicas, with two relatives that share its engine:
#
# | transform | what is combined every T steps | center update |
# |---|---|---|
# | `shardopt.agn(opt, "batch", sync_period=T)` | accumulated gradients / T | `global_optimizer` (default: a second `opt`) |
# | `shardopt.local_sgd(opt, "batch", sync_period=T)` | params | their mean |
# | `shardopt.diloco(opt, "batch", sync_period=T)` | `center - params` | Nesterov SGD (lr 0.8, momentum 0.2; the paper: 0.7, 0.9) |
#
# Between syncs the replicas do not communicate at all. This notebook trains a
# small MLP on scikit-learn's digits with each method and plots test accuracy
# against the number of all-reduces.

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
import matplotlib.pyplot as plt
import numpy as np
import optax
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
pmap = functools.partial(jax.pmap, axis_name="batch", devices=DEVICES)
x_train, x_test, y_train, y_test = load_digits_split()
print(f"{len(x_train)} training and {len(x_test)} test images, {n} replicas")

# %% [markdown]
# ## The training loop
#
# A plain `pmap` loop; every replica gets its own batch. For the periodic
# methods the model we evaluate is the shared `center` (the state's
# `center` field, equal to every replica's params right after a sync), and
# the number of all-reduces is the state's `sync_count`.

# %%
STEPS, BATCH, LR = 120, 32, 3e-3
batches = np.random.default_rng(0).integers(
  0, len(x_train), size=(STEPS, n, BATCH)
)
params0 = init_mlp(jax.random.key(0), (64, 64, 10))


def train(tx):
  def step(params, state, x, y):
    grads = jax.grad(cross_entropy)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = pmap(step)
  params = pmap(lambda _: params0)(np.arange(n))
  state = pmap(tx.init)(params)
  for i in range(STEPS):
    params, state = step(
      params, state, x_train[batches[i]], y_train[batches[i]]
    )
    jax.block_until_ready(params)
  center = optax.tree_utils.tree_get(state, "center")
  model = jax.tree.map(lambda a: a[0], center if center is not None else params)
  accuracy = float((mlp_logits(model, x_test).argmax(-1) == y_test).mean())
  sync_count = optax.tree_utils.tree_get(state, "sync_count")
  all_reduces = STEPS if sync_count is None else int(sync_count[0])
  return accuracy, all_reduces


# %%
runs = {
  "every step (cross_shard)": shardopt.cross_shard(optax.adam(LR), "batch"),
}
for period in (5, 20):
  # The center takes one step per period: give it a T-times larger step.
  runs[f"agn T={period}"] = shardopt.agn(
    optax.adam(LR),
    "batch",
    sync_period=period,
    global_optimizer=optax.adam(LR * period),
  )
  runs[f"local_sgd T={period}"] = shardopt.local_sgd(
    optax.adam(LR), "batch", sync_period=period
  )
runs["diloco T=20"] = shardopt.diloco(optax.adam(LR), "batch", sync_period=20)

results = {}
for name, tx in runs.items():
  results[name] = train(tx)
  print(
    f"{name:<26} test accuracy {results[name][0]:.1%}"
    f"   all-reduces {results[name][1]:>4}"
  )

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for name, (accuracy, all_reduces) in results.items():
  ax.scatter(all_reduces, accuracy, s=40)
  ax.annotate(
    name,
    (all_reduces, accuracy),
    textcoords="offset points",
    xytext=(5, 4),
    fontsize=8,
  )
ax.set_xscale("log")
ax.set_xlabel(f"all-reduces in {STEPS} steps (communication)")
ax.set_ylabel("test accuracy")
ax.set_title("Communication vs accuracy, MLP on sklearn digits")
ax.grid(alpha=0.3)
plt.show()

assert (
  results["agn T=5"][1] == STEPS // 5
  and results["diloco T=20"][1] == STEPS // 20
)
assert all(accuracy > 0.5 for accuracy, _ in results.values())

# %% [markdown]
# ## Communication happens only on sync steps
#
# The all-reduce sits inside the sync branch of a `jax.lax.cond` whose
# predicate is the step counter, so the other `T - 1` steps run no collective
# at all. We can see it in the traced program of one AGN step:

# %%
COLLECTIVES = {
  "psum",
  "pmax",
  "pmin",
  "all_gather",
  "psum_scatter",
  "reduce_scatter",
  "all_to_all",
  "ppermute",
}


def collectives_in(jaxpr):
  """Names of the collectives in a jaxpr and in every sub-jaxpr it holds."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in COLLECTIVES:
      found.append(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "jaxpr") or hasattr(sub, "eqns"):
          found += collectives_in(getattr(sub, "jaxpr", sub))
  return found


tx = shardopt.agn(optax.adam(LR), "batch", sync_period=10)


def agn_step(params, state, x, y):
  grads = jax.grad(cross_entropy)(params, x, y)
  return tx.update(grads, state, params)


closed = jax.make_jaxpr(agn_step, axis_env=[("batch", n)])(
  params0, tx.init(params0), x_train[:BATCH], y_train[:BATCH]
)
outside = [
  e.primitive.name for e in closed.jaxpr.eqns if e.primitive.name in COLLECTIVES
]
cond = next(e for e in closed.jaxpr.eqns if e.primitive.name == "cond")
quiet, sync = (collectives_in(b.jaxpr) for b in cond.params["branches"])
print("collectives outside the cond:", outside)
print("quiet branch (T - 1 of every T steps):", quiet)
print("sync branch:", sync)
assert not outside and not quiet and sync

# %% [markdown]
# Notes
#
# * TensorFlow's AGNOptimizer is asynchronous (each worker commits to a
#   parameter server on its own); shardopt is synchronous SPMD.
#   `reduction="mean"` (default) averages the replicas' normalized
#   accumulators; `"sum"` is what a parameter server does when it applies every
#   worker's commit in one round.
# * All counters live in the optimizer state as arrays, so a checkpoint taken
#   mid-period restores and continues bit-identically (see
#   `tests/test_integration_flax.py`, which does it with orbax).
