"""A small MLP and its per-replica training step, for the tests that read
what a whole step compiles to (tests/_compiled.py, tests/test_tower.py).

The same model as the benchmarks' (benchmarks/studies/workload.py), kept
here so that the library's tests do not import the benchmarks. Per-replica
layout: pmap's stacked ``(n, ...)`` arrays become ``P(AXIS)`` blocks of one
global array under ``jax.jit`` + ``shard_map(check_vma=False)``, scalars
``P()``, so every replica holds its own params and state, as under ``pmap``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "batch"


def mlp_init(key: jax.Array, sizes: Sequence[int]) -> dict:
  """Params of an MLP with layer ``sizes`` (input, hidden..., output)."""
  params = {}
  keys = jax.random.split(key, len(sizes) - 1)
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"layer{i}"] = {
      "w": jax.random.normal(keys[i], (fan_in, fan_out), jnp.float32)
      / math.sqrt(fan_in),
      "b": jnp.zeros((fan_out,), jnp.float32),
    }
  return params


def mlp_loss(params: dict, x: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of the MLP's logits (ReLU between layers)."""
  layers = [params[f"layer{i}"] for i in range(len(params))]
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ layers[-1]["w"] + layers[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def replicate(tree: Any, n: int) -> Any:
  """A leading axis of ``n`` copies (the pmap layout)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def batch(
  key: jax.Array, n: int, per_replica: int, features: int, classes: int
) -> tuple[jax.Array, jax.Array]:
  """A random batch with a leading replica axis: ``(n, per_replica, ...)``."""
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, per_replica, features), jnp.float32)
  y = jax.random.randint(ky, (n, per_replica), 0, classes)
  return x, y


def concat_specs(tree: Any) -> Any:
  """``P(AXIS)`` for arrays, ``P()`` for scalars."""
  return jax.tree.map(lambda a: P(AXIS) if jnp.ndim(a) else P(), tree)


def on_mesh(tree: Any, mesh) -> Any:
  """pmap's stacked layout ``(n, d0, ...)`` placed as ``(n * d0, ...)``
  ``P(AXIS)`` blocks, reshaped on the host; a leaf of one scalar per replica
  (shape ``(n,)``, the same on every replica) keeps replica 0's, ``P()``."""
  tree = jax.tree.map(
    lambda a: a[0] if a.ndim == 1 else a.reshape((-1,) + a.shape[2:]),
    jax.tree.map(np.asarray, tree),
  )
  return jax.tree.map(
    lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
    tree,
    concat_specs(tree),
  )


def train_step(tx, sync: int | None = None):
  """``step(params, opt_state, x, y)``: this replica's gradient of
  :func:`mlp_loss`, then ``tx`` (with ``sync=`` if given, the program
  ``shardopt.due`` picks), then the params after the updates."""
  kw = {} if sync is None else {"sync": sync}

  def step(params, opt_state, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, **kw)
    return optax.apply_updates(params, updates), opt_state

  return step


def concat_shard_map_step(
  tx, mesh, specs, *, donate: bool = False, sync: int | None = None
):
  """A training step on ``jax.jit`` + ``shard_map(check_vma=False)`` over
  :func:`on_mesh`'s layout: :func:`train_step` on every replica.
  ``specs``: the state's (:func:`concat_specs`); ``donate`` donates params
  and state; ``sync``: see :func:`train_step`."""
  return jax.jit(
    jax.shard_map(
      train_step(tx, sync),
      mesh=mesh,
      in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
      out_specs=(P(AXIS), specs),
      check_vma=False,
    ),
    donate_argnums=(0, 1) if donate else (),
  )
