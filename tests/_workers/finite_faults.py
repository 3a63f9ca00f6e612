"""Fault runs for tests/test_finite.py, in a child process the test can time out.

A deadlock (replicas disagreeing on whether to enter a collective) hangs the
process inside XLA, where no Python timeout can reach it; the test runs this
script with ``subprocess.run(..., timeout=...)`` and fails when it expires.

Usage: ``python finite_faults.py SCENARIO MAPPING OUT.npz``. Trains a small
least-squares model on 8 replicas with ``shardopt.apply_if_finite`` around
SCENARIO's transform, a NaN/inf written into one replica's gradient at the
steps of ``faults()``; saves the params after every step, the per-step
``replica_divergence`` of the params and the final state's counters.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before jax is imported; the tests import this
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardopt  # noqa: E402

AXIS = "batch"
R, D, B = 8, 6, 4
STEPS = 40
NUM_FAULTS = 6
MAX_CONSECUTIVE = 3
K = 2  # accumulate's every_k_steps
LOSS_SCALE_PERIOD = 4  # jmp: double the loss scale after 4 finite steps
LR, B1, B2, EPS = 0.02, 0.9, 0.999, 1e-8


def data():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(STEPS, R, B, D)).astype(np.float32)
  y = (x @ rng.normal(size=D) + 0.1 * rng.normal(size=(STEPS, R, B))).astype(
    np.float32
  )
  w0 = rng.normal(size=D).astype(np.float32)
  return x, y, w0


def faults():
  """(STEPS, R) bool mask and (STEPS,) values: one replica, random steps,
  at least 2 apart (so max_consecutive_errors is never reached)."""
  rng = np.random.default_rng(13)
  steps = []
  while len(steps) < NUM_FAULTS:
    s = int(rng.integers(0, STEPS))
    if all(abs(s - t) > 1 for t in steps):
      steps.append(s)
  mask = np.zeros((STEPS, R), bool)
  values = np.zeros([STEPS], np.float32)
  for i, s in enumerate(sorted(steps)):
    mask[s, rng.integers(R)] = True
    values[s] = (np.nan, np.inf, -np.inf)[i % 3]
  return mask, values


def transform(scenario: str):
  adam = optax.adam(LR, b1=B1, b2=B2, eps=EPS)
  inner = {
    "cross_shard": lambda: shardopt.cross_shard(adam, AXIS),
    "tower": lambda: shardopt.tower(adam, AXIS),
    "accumulate": lambda: shardopt.accumulate(
      shardopt.cross_shard(adam, AXIS), K
    ),
  }[scenario]()
  return shardopt.apply_if_finite(inner, MAX_CONSECUTIVE, axis_name=AXIS)


def _loss(w, x, y):
  """Least squares; under shard_map w, x, y carry a leading 1 (one replica)."""
  return 0.5 * jnp.mean((jnp.einsum("...bd,...d->...b", x, w) - y) ** 2)


def _step(tx, w, state, x, y, fault, value):
  grads = jax.grad(_loss)(w, x, y)
  grads = jnp.where(fault, value, grads)
  updates, state = tx.update(grads, state, w)
  w = optax.apply_updates(w, updates)
  return w, state, shardopt.replica_divergence(w, AXIS)


def run(scenario: str, mapping: str):
  tx = transform(scenario)
  x, y, w0 = data()
  mask, values = faults()
  history, divergence = [], []
  if mapping == "pmap":
    w = jnp.tile(w0, (R, 1))
    state = jax.pmap(tx.init, axis_name=AXIS)(w)
    step = jax.pmap(
      lambda *a: _step(tx, *a), axis_name=AXIS, in_axes=(0, 0, 0, 0, 0, None)
    )
    for t in range(STEPS):
      w, state, div = step(w, state, x[t], y[t], mask[t], values[t])
      jax.block_until_ready(w)
      history.append(np.asarray(w))
      divergence.append(float(div[0]))
    counters = state
  else:  # checking shard_map, the whole state stacked under P(AXIS)
    mesh = jax.make_mesh((R,), (AXIS,))
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P(AXIS)))
    w = jnp.tile(w0, (R, 1))
    state = jax.pmap(tx.init, axis_name=AXIS)(w)

    def body(w, state, x, y, fault, value):  # leading 1 on every input
      w, state, div = _step(tx, w, state, x, y, fault[:, None], value)
      return w, state, div[None]

    step = jax.jit(
      jax.shard_map(
        body, mesh=mesh, in_specs=(P(AXIS),) * 5 + (P(),), out_specs=P(AXIS)
      )
    )
    w, state = put(w), put(state)
    for t in range(STEPS):
      w, state, div = step(
        w, state, put(x[t]), put(y[t]), put(mask[t]), values[t]
      )
      jax.block_until_ready(w)
      history.append(np.asarray(w))
      divergence.append(float(np.asarray(div).max()))
    counters = state
  return dict(
    params=np.stack(history),
    divergence=np.asarray(divergence),
    total_notfinite=np.asarray(counters.total_notfinite),
    notfinite_count=np.asarray(counters.notfinite_count),
    last_finite=np.asarray(counters.last_finite),
  )


def run_loss_scale():
  """fp16-style dynamic loss scaling with jmp, adjusted by the replicated flag.

  The loss is scaled, the gradients unscaled; an overflow (an inf written into
  one replica's gradient) makes apply_if_finite skip the step on every
  replica, and ``state.last_finite``, the same on every replica, drives
  ``jmp.DynamicLossScale.adjust``: every replica keeps the same loss scale.
  """
  import jmp

  tx = shardopt.apply_if_finite(
    shardopt.cross_shard(optax.sgd(LR), AXIS), MAX_CONSECUTIVE, axis_name=AXIS
  )
  x, y, w0 = data()
  mask, values = faults()

  def step(w, state, scale, x, y, fault, value):
    grads = jax.grad(lambda w: scale.scale(_loss(w, x, y)))(w)
    grads = scale.unscale(jnp.where(fault, value, grads))
    updates, state = tx.update(grads, state, w)
    scale = scale.adjust(state.last_finite)
    return optax.apply_updates(w, updates), state, scale

  w = jnp.tile(w0, (R, 1))
  state = jax.pmap(tx.init, axis_name=AXIS)(w)
  scale = jax.tree.map(
    lambda v: jnp.tile(v, (R,)),
    jmp.DynamicLossScale(jnp.float32(2.0**10), period=LOSS_SCALE_PERIOD),
  )
  step = jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, 0, 0, 0, 0, None))
  history, scales = [], []
  for t in range(STEPS):
    w, state, scale = step(w, state, scale, x[t], y[t], mask[t], values[t])
    jax.block_until_ready(w)
    history.append(np.asarray(w))
    scales.append(np.asarray(scale.loss_scale))
  return dict(
    params=np.stack(history),
    loss_scale=np.stack(scales),
    total_notfinite=np.asarray(state.total_notfinite),
  )


def main():
  scenario, mapping, out = sys.argv[1:4]
  result = (
    run_loss_scale() if scenario == "loss_scale" else run(scenario, mapping)
  )
  np.savez(out, **result)
  print(f"finite_faults {scenario} {mapping}: done")


if __name__ == "__main__":
  main()
