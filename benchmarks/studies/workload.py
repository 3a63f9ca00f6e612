"""The studies' two workloads: the digits MLP and a byte-level transformer.

**Digits** (sections 5, 5b, 7's accuracy column, ``outer_defaults``):
scikit-learn's bundled digits data set (1,797 8x8 images, no download), split
80/20 with a fixed seed; the training part is dealt out to the replicas, each
of which draws its own minibatches of its own share. A 64-64-10 MLP
(:data:`SIZES`) trained by ``tx`` under ``jax.pmap`` (:func:`train_digits`),
test accuracy every :data:`EVAL_EVERY` steps. The MLP (:func:`mlp_init`,
:func:`mlp_apply`, :func:`mlp_loss`) is also the model of every performance
benchmark (:mod:`benchmarks.perf.workload` builds its steps on it); the
repository's demo (:mod:`examples.demo`) keeps its own copy.

**Language model** (sections 8 and 8b): a byte-level transformer on the
Python stdlib's sources.

Nothing is downloaded: the text is the running interpreter's own standard
library (``Lib/*.py`` of ``sysconfig.get_paths()["stdlib"]``, top level only,
read as bytes). Files are split deterministically into train and validation
FILES by a CRC-32 of their name (one in ten to validation), so validation text
is code the model never saw, from the same distribution.

Model: a decoder-only transformer in Flax (linen), byte-level (vocabulary
256), learned positions, pre-LayerNorm blocks of causal multi-head attention
and a GELU MLP, the output layer tied to the byte embedding. Attention
projections are plain 2-D ``Dense`` kernels, so every weight matrix is a
matrix (``powersgd`` views a leaf as ``shape[0] x rest``).

Training: 8 replicas under ``jax.pmap`` (axis ``"batch"``), or stacked on
one device under ``jax.vmap`` (``mapping="vmap"``, the state's axes from
``shardopt.vmap_axes``: the route of drjax and MaxText, the same numbers);
the training bytes are cut into 8 contiguous shards, one per replica, and
every step each replica draws its own ``batch_per_replica`` random windows
of ``context + 1`` bytes from its shard (keys folded from seed, step and
replica index). Steps run in ``lax.scan`` chunks of ``eval_every`` steps.

Validation: every ``eval_every`` steps, the mean next-byte cross-entropy
over fixed windows spread evenly over the validation text, in bits per byte
(nats / ln 2), of the replica-averaged params (the average is taken on the
host for evaluation only; it is not part of training and not counted as
communication). At multiples of every method's period, except streaming
DiLoCo's fragments, all replicas already hold the same params.

``python -m benchmarks.studies.quality_per_byte --calibrate [--steps N]
[--set FIELD=VALUE ...]`` trains the LM's synchronous baseline alone and
prints its curve and how much its last 20% of steps improved it (a
calibration aid).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
import sysconfig
import time
import zlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardopt

AXIS = "batch"


# ----------------------------------------------------------------- the MLP


def mlp_init(key: jax.Array, sizes: Sequence[int]) -> dict:
  """Params of an MLP with layer ``sizes`` (input, hidden..., output)."""
  params = {}
  keys = jax.random.split(key, len(sizes) - 1)
  for i, (fan_in, fan_out) in enumerate(
    zip(sizes[:-1], sizes[1:], strict=True)
  ):
    params[f"layer{i}"] = {
      "w": jax.random.normal(keys[i], (fan_in, fan_out), jnp.float32)
      / math.sqrt(fan_in),
      "b": jnp.zeros((fan_out,), jnp.float32),
    }
  return params


def mlp_apply(params: dict, x: jax.Array) -> jax.Array:
  """Logits of the MLP (ReLU between layers)."""
  layers = [params[f"layer{i}"] for i in range(len(params))]
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ layers[-1]["w"] + layers[-1]["b"]


def mlp_loss(params: dict, x: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of this replica's batch."""
  logits = mlp_apply(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def count_params(tree: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def tree_bytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def replicate(tree: Any, n: int) -> Any:
  """A leading axis of ``n`` copies (the pmap layout)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


# ----------------------------------------------------------------- replicas

MAPPINGS = ("pmap", "vmap")
REPLICAS = 8  # replicas under vmap unless a caller says otherwise


def replica_count(mapping: str, replicas: int | None = None) -> int:
  """The replicas a study runs: every device under ``pmap``, :data:`REPLICAS`
  on one device under ``vmap`` (unless ``replicas`` says otherwise)."""
  if mapping not in MAPPINGS:
    raise ValueError(f"mapping={mapping!r}: use one of {MAPPINGS}")
  if replicas is not None:
    return replicas
  return jax.device_count() if mapping == "pmap" else REPLICAS


def state_axes(tx, params: Any, mapping: str, replicas: int) -> Any:
  """The state's replica axes: ``0`` (a copy per device) under ``pmap``,
  ``shardopt.vmap_axes`` under ``vmap`` (per-replica leaves stacked,
  counters and centers once)."""
  if mapping == "pmap":
    return 0
  return shardopt.vmap_axes(tx, params, AXIS, axis_size=replicas)


def replica_map(
  fn,
  mapping: str,
  in_axes: tuple,
  out_axes: Any,
  replicas: int,
  donate_argnums: tuple = (),
):
  """``fn`` run once per replica with axis name :data:`AXIS`: ``jax.pmap``
  over ``replicas`` devices, or ``jax.jit(jax.vmap(...))`` on one device
  (the route of drjax and MaxText). Under ``pmap`` every axis is 0 or None
  (the state is a copy per device)."""
  if mapping == "pmap":
    return jax.pmap(
      fn, axis_name=AXIS, in_axes=in_axes, donate_argnums=donate_argnums
    )
  mapped = jax.vmap(
    fn,
    in_axes=in_axes,
    out_axes=out_axes,
    axis_name=AXIS,
    axis_size=replicas,
  )
  return jax.jit(mapped, donate_argnums=donate_argnums)


def place(tree: Any, mapping: str) -> Any:
  """Stacked arrays where the replicas run: one row per device under
  ``pmap``, on the default device under ``vmap``."""
  if mapping == "pmap":
    return jax.pmap(lambda t: t)(tree)
  return jax.device_put(tree)


def init_replicas(tx, params: Any, mapping: str, replicas: int):
  """``(stacked params, state, state axes)``: every replica starts from
  ``params``, and ``tx.init`` runs per replica."""
  stacked = place(replicate(params, replicas), mapping)
  axes = state_axes(tx, params, mapping, replicas)
  if mapping == "pmap":
    return stacked, jax.pmap(tx.init, axis_name=AXIS)(stacked), axes
  init = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name=AXIS, axis_size=replicas
  )
  return stacked, jax.jit(init)(params), axes


def update_bytes(tx, params: Any, schedule, steps: int, devices=None) -> dict:
  """What one replica sends for ``tx`` in a run of ``steps`` steps, read
  from the compiled HLO of ``tx``'s update under ``jax.pmap`` over
  ``devices`` (default: the CPU devices), compiled and not run.

  For the ``vmap`` route, which has no collectives to read: the model's
  forward and backward pass communicates nothing, so ``tx.update``'s
  collectives are the step's (``tests/test_study_replicas.py`` checks it
  against the training chunk's HLO). ``schedule`` is the method's
  :class:`shardopt.measure.hlo.Schedule`. Returns ``{"total_bytes",
  "mean_bytes_per_step", "peak_bytes_per_step", "warmup_bytes_per_step",
  "collectives", "bytes_warning", "bytes_from"}``.
  """
  from shardopt.measure import hlo

  devices = jax.devices("cpu") if devices is None else devices
  n = len(devices)
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((n,) + tuple(x.shape), x.dtype), params
  )

  # The state as pmap's init lays it out: every leaf a copy per device. An
  # argument, not built inside the step: a constant step counter would let
  # XLA fold the conditional syncs away.
  state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS, axis_size=n), shapes)

  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  text = (
    jax.pmap(step, axis_name=AXIS, devices=devices)
    .lower(shapes, state, shapes)
    .compile()
    .as_text()
  )
  ops = hlo.compiled_collectives(text, num_devices=n)
  sent = functools.partial(hlo.sent_bytes, num_devices=n)
  per_step = hlo.per_step(ops, schedule, measure=sent)
  return {
    "total_bytes": hlo.run_bytes(per_step, schedule, steps),
    "mean_bytes_per_step": per_step["mean_bytes"],
    "peak_bytes_per_step": per_step["peak_bytes"],
    "warmup_bytes_per_step": per_step["warmup_bytes"],
    "collectives": hlo.summarize(ops)["count"],
    "bytes_warning": per_step["warning"],
    "bytes_from": f"tx.update under pmap over {n} {devices[0].platform}"
    " devices, compiled, not run",
  }


# ----------------------------------------------------------------- digits

SIZES = (64, 64, 10)
LEARNING_RATE = 1e-3
EVAL_EVERY = 16


def digits(replicas: int):
  """``(train_x, train_y, test_x, test_y)``: the training part dealt out to
  ``replicas`` (a leading replica axis), the held-out 20% whole."""
  from sklearn.datasets import load_digits  # bundled with scikit-learn

  data = load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  test_count = len(x) // 5
  test, train = order[:test_count], order[test_count:]
  per_replica = len(train) // replicas
  train = train[: per_replica * replicas]
  return (
    x[train].reshape(replicas, per_replica, -1),
    y[train].reshape(replicas, per_replica),
    x[test],
    y[test],
  )


def digits_chunk(
  tx,
  steps: int,
  batch_size: int,
  mapping: str = "pmap",
  axes: Any = 0,
  replicas: int | None = None,
):
  """Per replica (:func:`replica_map`; ``axes``: the state's, from
  :func:`state_axes`): ``steps`` local steps from ``first_step``; returns
  params, state and the params' ``replica_divergence``."""

  def chunk(params, state, x, y, key, first_step):
    replica = jax.lax.axis_index(AXIS)

    def one(carry, step):
      params, state = carry
      k = jax.random.fold_in(jax.random.fold_in(key, step), replica)
      idx = jax.random.randint(k, (batch_size,), 0, x.shape[0])
      grads = jax.grad(mlp_loss)(params, x[idx], y[idx])
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(
      one, (params, state), first_step + jnp.arange(steps)
    )
    divergence = shardopt.replica_divergence(params, AXIS)
    return params, state, divergence

  return replica_map(
    chunk,
    mapping,
    (0, axes, 0, 0, None, None),
    (0, axes, 0),
    replica_count(mapping, replicas),
  )


def train_digits(
  tx,
  seeds,
  total_steps: int,
  batch_size: int = 16,
  *,
  mapping: str = "pmap",
  replicas: int | None = None,
  keep_params: bool = False,
):
  """Trains the digits MLP with ``tx``, once per seed (params init ``100 +
  seed``, data order ``seed``), its replicas on every device (``mapping=
  "pmap"``) or stacked on one (``"vmap"``, :data:`REPLICAS` of them unless
  ``replicas`` says otherwise): the same numbers either way.

  Returns:
    ``(per_seed, divergence)``: test accuracy every ``EVAL_EVERY`` steps
    (step 0 first) for each seed, and the largest final
    ``replica_divergence`` of the params over the seeds; with
    ``keep_params``, also each seed's final stacked params (numpy).
  """
  n = replica_count(mapping, replicas)
  train_x, train_y, test_x, test_y = digits(n)
  train_x, train_y = place((train_x, train_y), mapping)
  accuracy = jax.jit(
    lambda p: jnp.mean(jnp.argmax(mlp_apply(p, test_x), -1) == test_y)
  )
  first_params = mlp_init(jax.random.key(100), SIZES)
  axes = state_axes(tx, first_params, mapping, n)
  chunk = digits_chunk(tx, EVAL_EVERY, batch_size, mapping, axes, n)
  per_seed, final_divergence, finals = [], 0.0, []
  for seed in seeds:
    params = mlp_init(jax.random.key(100 + seed), SIZES)
    p_params, state, _ = init_replicas(tx, params, mapping, n)
    key = jax.random.key(seed)
    acc = [float(accuracy(params))]
    for first in range(0, total_steps, EVAL_EVERY):
      p_params, state, divergence = chunk(  # first as an array: no retrace
        p_params, state, train_x, train_y, key, jnp.int32(first)
      )
      acc.append(float(accuracy(jax.tree.map(lambda a: a[0], p_params))))
    final_divergence = max(final_divergence, float(divergence[0]))
    per_seed.append(acc)
    finals.append(jax.tree.map(np.asarray, p_params))
  if keep_params:
    return per_seed, final_divergence, finals
  return per_seed, final_divergence


# ----------------------------------------------------------------- the LM

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of the model, the run and the evaluation."""

  context: int = 64
  width: int = 64
  depth: int = 2
  heads: int = 4
  batch_per_replica: int = 8
  steps: int = 768
  eval_every: int = 64
  learning_rate: float = 2e-3  # the peak of the schedule
  warmup_fraction: float = 0.05  # linear warm-up, a fraction of the updates
  end_fraction: float = 0.1  # the cosine decays to this fraction of the peak
  weight_decay: float = 1e-4
  val_windows: int = 128
  validation_every: int = 10  # one file in N goes to validation


# Section 8's run (issue 24): the 120k-param model of the first version (768
# steps of 8 windows at a constant 2e-3) on a warm-up + cosine schedule that
# decays to zero, 1536 steps of 4 windows: sync's last 20% of steps then
# improve it by under 2% (1.40% in calibration), and 22 methods x 2 seeds fit
# in about an hour on the shared 2-core machine (~45 ms a step when quiet).
FULL = Config(
  batch_per_replica=4,
  steps=1536,
  eval_every=64,
  learning_rate=5e-3,
  end_fraction=0.0,
  val_windows=256,
)
QUICK = Config(
  context=16,
  width=16,
  depth=1,
  heads=2,
  batch_per_replica=2,
  steps=64,
  eval_every=32,
  val_windows=16,
)
# quality_per_byte --tiny and the accelerator command's --tiny frontier: the
# QUICK model, evaluated every 16 steps (a multiple of every period of
# benchmarks.methods.frontier).
TINY = dataclasses.replace(QUICK, eval_every=16)


# ----------------------------------------------------------------- data


def stdlib_files() -> list[str]:
  """The interpreter's top-level stdlib ``*.py`` files, sorted by name."""
  return sorted(
    glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))
  )


def is_validation(path: str, every: int) -> bool:
  """Deterministic file-level split: CRC-32 of the file name, one in ``every``."""
  return zlib.crc32(os.path.basename(path).encode()) % every == 0


def corpus(config: Config = FULL) -> dict:
  """Train and validation bytes as ``uint8`` arrays, and the file lists."""
  train, val, train_files, val_files = [], [], [], []
  for path in stdlib_files():
    with open(path, "rb") as f:
      data = f.read()
    if is_validation(path, config.validation_every):
      val.append(data)
      val_files.append(os.path.basename(path))
    else:
      train.append(data)
      train_files.append(os.path.basename(path))
  return {
    "train": np.frombuffer(b"".join(train), np.uint8),
    "validation": np.frombuffer(b"".join(val), np.uint8),
    "train_files": train_files,
    "validation_files": val_files,
    "stdlib": sysconfig.get_paths()["stdlib"],
  }


def shards(train: np.ndarray, replicas: int) -> np.ndarray:
  """``(replicas, shard_len)``: contiguous equal shards of the training bytes."""
  length = len(train) // replicas
  return train[: length * replicas].reshape(replicas, length)


def validation_windows(validation: np.ndarray, config: Config) -> np.ndarray:
  """``(val_windows, context + 1)`` windows evenly spread over the text."""
  starts = np.linspace(
    0, len(validation) - config.context - 1, config.val_windows
  ).astype(np.int64)
  return np.stack([validation[s : s + config.context + 1] for s in starts])


# ----------------------------------------------------------------- model


class Block(nn.Module):
  """Pre-LayerNorm block: causal self-attention, then a GELU MLP."""

  width: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head = width // self.heads
    qkv = nn.Dense(3 * width, use_bias=False, name="qkv")(
      nn.LayerNorm(name="ln_attention")(x)
    )
    q, k, v = (
      a.reshape(batch, length, self.heads, head)
      for a in jnp.split(qkv, 3, axis=-1)
    )
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
    x = x + nn.Dense(width, use_bias=False, name="out")(
      attended.reshape(batch, length, width)
    )
    hidden = nn.gelu(
      nn.Dense(4 * width, name="up")(nn.LayerNorm(name="ln_mlp")(x))
    )
    return x + nn.Dense(width, name="down")(hidden)


class ByteTransformer(nn.Module):
  """Decoder-only byte-level transformer; logits over the next byte."""

  config: Config

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embed = nn.Embed(
      VOCAB, c.width, name="embed", embedding_init=nn.initializers.normal(0.02)
    )
    position = self.param(
      "position", nn.initializers.normal(0.02), (c.context, c.width)
    )
    x = embed(tokens) + position[: tokens.shape[1]]
    for i in range(c.depth):
      x = Block(c.width, c.heads, name=f"block{i}")(x)
    return embed.attend(nn.LayerNorm(name="ln_final")(x))


def init_params(config: Config, seed: int) -> Any:
  """Float32 params of :class:`ByteTransformer` from ``seed``."""
  tokens = jnp.zeros((1, config.context), jnp.int32)
  return ByteTransformer(config).init(jax.random.key(seed), tokens)["params"]


def loss_fn(params: Any, windows: jax.Array, config: Config) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of ``(batch, context + 1)`` windows."""
  tokens = windows.astype(jnp.int32)
  logits = ByteTransformer(config).apply({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def bits_per_byte(nats: float) -> float:
  return nats / math.log(2)


def learning_rate(config: Config, updates: int | None = None):
  """Linear warm-up from 0 to the peak, then cosine decay to ``end_fraction``
  of it (``optax.warmup_cosine_decay_schedule``) over ``updates`` optimizer
  updates (default: ``config.steps``)."""
  updates = config.steps if updates is None else updates
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.learning_rate,
    warmup_steps=max(1, round(config.warmup_fraction * updates)),
    decay_steps=updates,
    end_value=config.learning_rate * config.end_fraction,
  )


def adamw(config: Config, updates: int | None = None):
  """The optimizer factory every method wraps: AdamW on
  :func:`learning_rate`'s schedule over ``updates`` updates (default
  ``config.steps``; ``accumulate(..., k)`` makes ``steps / k``)."""
  return lambda: optax.adamw(
    learning_rate(config, updates), weight_decay=config.weight_decay
  )


def muon(config: Config, updates: int | None = None):
  """Muon (``optax.contrib.muon``) on the same schedule as :func:`adamw`,
  for the MuLoCo rows: the 2-D ``kernel`` matrices orthogonalized, with
  Moonlight's consistent RMS (0.2, arXiv 2502.16982) so that AdamW's
  learning rate carries over; the embeddings, norms and biases by Adam."""
  from optax.contrib import MuonDimensionNumbers

  def dimensions(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, x: (
        MuonDimensionNumbers()
        if x.ndim == 2 and getattr(path[-1], "key", None) == "kernel"
        else None
      ),
      params,
    )

  return lambda: optax.contrib.muon(
    learning_rate(config, updates),
    weight_decay=config.weight_decay,
    adam_weight_decay=config.weight_decay,
    consistent_rms=0.2,
    muon_weight_dimension_numbers=dimensions,
  )


def sign_step(config: Config, updates: int | None = None):
  """The step after ``shardopt.decoupled_momentum`` (DeMo, which returns the
  sign of its synchronized update): the learning rate on
  :func:`learning_rate`'s schedule, without weight decay, as the paper's
  DeMo runs took AdamW's learning rate and schedule with weight decay 0."""
  return lambda: optax.scale_by_learning_rate(learning_rate(config, updates))


def decayed_step(config: Config, updates: int | None = None):
  """AdamW without its ``scale_by_adam``: the weight decay, then the
  learning rate on :func:`learning_rate`'s schedule, for a method that
  brings its own direction (``scale_by_mt_dao`` in the MT-DAO rows)."""
  return lambda: optax.chain(
    optax.add_decayed_weights(config.weight_decay),
    optax.scale_by_learning_rate(learning_rate(config, updates)),
  )


OPTIMIZERS = {
  "adamw": adamw,
  "muon": muon,
  "sign": sign_step,
  "decayed step": decayed_step,
}


# ----------------------------------------------------------------- training


def sample(shard: jax.Array, key: jax.Array, config: Config) -> jax.Array:
  """``batch_per_replica`` random windows of ``context + 1`` bytes."""
  starts = jax.random.randint(
    key, (config.batch_per_replica,), 0, shard.shape[0] - config.context - 1
  )
  return jax.vmap(
    lambda s: jax.lax.dynamic_slice(shard, (s,), (config.context + 1,))
  )(starts)


def train_step(tx: optax.GradientTransformation, config: Config):
  """One step ``(params, state, windows) -> (params, state, loss)`` (per replica)."""

  def step(params, state, windows):
    loss, grads = jax.value_and_grad(loss_fn)(params, windows, config)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def pmapped_step(tx: optax.GradientTransformation, config: Config):
  """``jax.pmap`` of :func:`train_step`, for reading the compiled HLO."""
  return jax.pmap(train_step(tx, config), axis_name=AXIS)


def train_chunk(
  tx: optax.GradientTransformation,
  config: Config,
  mapping: str = "pmap",
  axes: Any = 0,
  replicas: int | None = None,
):
  """Per replica (:func:`replica_map`; ``axes``: the state's, from
  :func:`state_axes`): ``eval_every`` steps from ``first_step``; per-step
  local losses."""
  step = train_step(tx, config)

  def chunk(params, state, shard, key, first_step):
    replica = jax.lax.axis_index(AXIS)

    def one(carry, t):
      params, state = carry
      k = jax.random.fold_in(jax.random.fold_in(key, t), replica)
      params, state, loss = step(params, state, sample(shard, k, config))
      return (params, state), loss

    (params, state), losses = jax.lax.scan(
      one, (params, state), first_step + jnp.arange(config.eval_every)
    )
    return params, state, losses

  return replica_map(
    chunk,
    mapping,
    (0, axes, 0, None, None),
    (0, axes, 0),
    replica_count(mapping, replicas),
    donate_argnums=(0, 1),
  )


class Workload:
  """Data on the devices and the evaluation, built once for every method.

  ``mapping``: the replicas on every device (``"pmap"``: as many as there
  are devices) or stacked on the default device (``"vmap"``: ``replicas``,
  default :data:`REPLICAS`); the same numbers either way.
  """

  def __init__(
    self,
    config: Config = FULL,
    mapping: str = "pmap",
    replicas: int | None = None,
  ):
    self.config = config
    self.mapping = mapping
    self.replicas = replica_count(mapping, replicas)
    data = corpus(config)
    self.info = {
      "stdlib": data["stdlib"],
      "train_files": len(data["train_files"]),
      "validation_files": len(data["validation_files"]),
      "train_bytes": int(len(data["train"])),
      "validation_bytes": int(len(data["validation"])),
    }
    self.shards = place(shards(data["train"], self.replicas), mapping)
    self.validation = jnp.asarray(
      validation_windows(data["validation"], config)
    )
    self.info["validation_windows"] = list(self.validation.shape)
    self._val_loss = jax.jit(lambda p: loss_fn(p, self.validation, config))
    self._inits: dict = {}  # id(tx) -> (tx, its mapped init): one compile

  def axes(self, tx: optax.GradientTransformation) -> Any:
    """``tx``'s state axes (:func:`state_axes`) on this workload."""
    params = jax.eval_shape(lambda: init_params(self.config, 0))
    return state_axes(tx, params, self.mapping, self.replicas)

  def chunk(self, tx: optax.GradientTransformation):
    """``tx``'s :func:`train_chunk` on this workload's replicas."""
    return train_chunk(
      tx, self.config, self.mapping, self.axes(tx), self.replicas
    )

  def initial(self, tx: optax.GradientTransformation, seed: int):
    """Replicated params (``init_params(1000 + seed)``) and ``tx``'s state."""
    params = init_params(self.config, 1000 + seed)
    p_params = place(replicate(params, self.replicas), self.mapping)
    if id(tx) not in self._inits:
      if self.mapping == "pmap":  # from each device's copy of the params
        init = jax.pmap(tx.init, axis_name=AXIS)
      else:  # from the params, once: counters and centers unbatched
        init = jax.jit(
          jax.vmap(
            tx.init,
            in_axes=None,
            out_axes=self.axes(tx),
            axis_name=AXIS,
            axis_size=self.replicas,
          )
        )
      self._inits = {id(tx): (tx, init)}
    init = self._inits[id(tx)][1]
    return p_params, init(p_params if self.mapping == "pmap" else params)

  def compile(self, tx: optax.GradientTransformation):
    """Compiles ``tx``'s :func:`train_chunk` once: ``(callable, HLO text)``.

    The HLO is the chunk's: one step is the body of its ``while`` loop, so
    every collective runs once per step, or once per step that takes its
    conditional branch. Under ``vmap`` it has no collectives (the replicas
    share one device): read the bytes with :func:`update_bytes`.
    """
    p_params, state = self.initial(tx, 0)
    compiled = (
      self.chunk(tx)
      .lower(p_params, state, self.shards, jax.random.key(0), jnp.int32(0))
      .compile()
    )
    return compiled, compiled.as_text()

  def validation_bits_per_byte(self, replicated_params: Any) -> float:
    """Validation bits per byte of the replica-averaged params."""
    mean = jax.tree.map(lambda a: jnp.mean(a, 0), replicated_params)
    return bits_per_byte(float(self._val_loss(mean)))

  def train(
    self, tx: optax.GradientTransformation, seed: int, *, chunk=None
  ) -> dict:
    """Trains from ``seed`` and returns the validation and training curves.

    Args:
      tx: the method's transform (its collectives use axis ``"batch"``).
      seed: params init and data order.
      chunk: a :func:`train_chunk` of ``tx`` to reuse, or the callable of
        :meth:`compile` (compiled once per method, not per seed).

    Returns:
      ``{"steps": [0, eval_every, ...], "val_bpb": [...], "train_bpb":
      [mean over replicas of every step's local loss], "divergence": max
      |param difference| across replicas at the end, "seconds"}``.
    """
    c = self.config
    chunk = chunk or self.chunk(tx)
    p_params, state = self.initial(tx, seed)
    key = jax.random.key(seed)
    start = time.perf_counter()
    steps, val, train = [0], [self.validation_bits_per_byte(p_params)], []
    for first in range(0, c.steps, c.eval_every):
      p_params, state, losses = chunk(
        p_params, state, self.shards, key, jnp.int32(first)
      )
      losses = np.asarray(losses)  # (replicas, eval_every): blocks
      train.extend(bits_per_byte(x) for x in losses.mean(0))
      steps.append(first + c.eval_every)
      val.append(self.validation_bits_per_byte(p_params))
    divergence = max(
      float(jnp.max(jnp.abs(a - a[0:1]))) for a in jax.tree.leaves(p_params)
    )
    return {
      "steps": steps,
      "val_bpb": val,
      "train_bpb": train,
      "divergence": divergence,
      "seconds": time.perf_counter() - start,
    }
