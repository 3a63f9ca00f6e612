"""``python -m shardopt.demo``: train a small MLP three ways over 8 devices.

The demo trains the same multilayer perceptron on scikit-learn's bundled
``digits`` data (1797 8x8 images, no download) with each of shardopt's three
distributed optimizers:

* ``cross_shard`` -- TF's ``CrossShardOptimizer``: average the gradients
  across replicas every step, then apply Adam (one all-reduce per step);
* ``tower`` -- TF's ``TowerOptimizer``: reduce-scatter the gradients, apply
  Adam once per 1/n slice of every parameter, all-gather the update (one
  reduce-scatter + all-gather per step, i.e. the bytes of one all-reduce);
* ``agn`` -- TF's ``AGNOptimizer``: every replica takes local Adam steps on
  its own batches and the replicas only talk every ``communication_period``
  steps (one all-reduce per sync).

Each run shows a progress bar; at the end the demo prints a table (test
accuracy, steps, all-reduces, wall time) and saves the loss curves as a PNG.

Devices: the CPU backend is asked for ``--devices`` (default 8) virtual
devices by adding ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS``
before JAX starts its backends (JAX reads the flag when the first device is
requested, which is why :func:`main` sets it before touching any device, even
though ``import shardopt`` has already imported jax). The flag is only added
when ``XLA_FLAGS`` does not already set a count. It only affects the CPU
backend, so on a machine with several TPU/GPU devices the demo trains on
those instead; with a single accelerator it falls back to the forced CPU
devices. The flag cannot take effect once a JAX computation has run in the
process; the demo then uses the devices that exist.

Usage::

    python -m shardopt.demo [--steps N] [--devices N]
                            [--method cross_shard|tower|agn|all] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

METHODS = ("cross_shard", "tower", "agn")
AXIS = "batch"
_FORCE_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(count: int) -> bool:
  """Asks XLA's CPU backend for ``count`` devices via ``XLA_FLAGS``.

  Must run before JAX initialises its backends (before the first device or
  computation is requested). Leaves an existing count in ``XLA_FLAGS`` alone.

  Returns:
    True when the flag was added, False when ``XLA_FLAGS`` already had one.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if _FORCE_FLAG in flags:
    return False
  os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_FLAG}={count}".strip()
  return True


def select_devices(count: int) -> list:
  """``count`` devices: the accelerators if there are several, else CPUs.

  Raises:
    RuntimeError: when fewer than ``count`` devices exist, with the fix.
  """
  import jax  # pylint: disable=g-import-not-at-top

  accelerators = jax.devices() if jax.default_backend() != "cpu" else []
  if len(accelerators) > 1:
    pool = accelerators
  else:
    pool = jax.devices("cpu")
  if len(pool) < count:
    raise RuntimeError(
      f"shardopt.demo: --devices {count} asked for {count} devices, but only"
      f" {len(pool)} {pool[0].platform} device(s) exist. Run the demo in a"
      f" fresh process (XLA_FLAGS={_FORCE_FLAG}={count} is applied before JAX"
      " starts), or pass a smaller --devices."
    )
  return list(pool[:count])


class RunResult(NamedTuple):
  method: str
  test_accuracy: float
  steps: int
  all_reduces: int
  wall_time_s: float
  losses: Any  # numpy array [steps], mean over replicas
  replica_divergence: float


def load_digits_split(seed: int = 0):
  """Digits as float32 features in [0, 1] and int32 labels, 80/20 split."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top

  digits = load_digits()
  features = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  return train_test_split(
    features, labels, test_size=0.2, random_state=seed, stratify=labels
  )


def init_mlp(key, sizes: Sequence[int]):
  """Glorot-initialised MLP parameters as a list of {"w", "b"} dicts."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    w = jax.nn.initializers.glorot_normal()(sub, (fan_in, fan_out), jnp.float32)
    params.append({"w": w, "b": jnp.zeros((fan_out,), jnp.float32)})
  return params


def mlp_logits(params, features):
  import jax  # pylint: disable=g-import-not-at-top

  h = features
  for layer in params[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  return h @ params[-1]["w"] + params[-1]["b"]


def cross_entropy(params, features, labels):
  import optax  # pylint: disable=g-import-not-at-top

  logits = mlp_logits(params, features)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_optimizer(
  method: str, learning_rate: float, communication_period: int
):
  """The optax transform the demo trains with for ``method``."""
  import optax  # pylint: disable=g-import-not-at-top

  import shardopt  # pylint: disable=g-import-not-at-top

  if method == "cross_shard":
    return shardopt.cross_shard(optax.adam(learning_rate), AXIS)
  if method == "tower":
    return shardopt.tower(optax.adam(learning_rate), AXIS)
  if method == "agn":
    # Local Adam on every replica; every `communication_period` steps the
    # averaged, normalised accumulated gradient moves the shared center.
    # The center takes one step per period, so it gets a learning rate
    # `communication_period` times larger (local SGD's "lr * T" rule).
    return shardopt.agn(
      optax.adam(learning_rate),
      AXIS,
      communication_period=communication_period,
      global_optimizer=optax.adam(learning_rate * communication_period),
    )
  raise ValueError(
    f"shardopt.demo: unknown method {method!r}; use one of {METHODS} or 'all'."
  )


def train(
  method: str,
  devices: list,
  data,
  *,
  steps: int,
  batch_per_replica: int = 32,
  learning_rate: float = 3e-3,
  communication_period: int = 10,
  hidden: int = 64,
  seed: int = 0,
  progress: bool = True,
) -> RunResult:
  """Trains the MLP with ``method`` over ``devices``; returns its result row.

  A plain ``jax.pmap`` loop: every replica holds its own copy of params and
  optimizer state (a leading device axis) and sees its own batch each step.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  import shardopt  # pylint: disable=g-import-not-at-top

  x_train, x_test, y_train, y_test = data
  n = len(devices)
  tx = make_optimizer(method, learning_rate, communication_period)

  def train_step(params, opt_state, features, labels):
    loss, grads = jax.value_and_grad(cross_entropy)(params, features, labels)
    updates, new_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if method == "agn":
      # After a sync, snap params onto the center so every replica holds the
      # same bits (params + (center - params) can be off by an ulp).
      synced = new_state.sync_count > opt_state.sync_count
      params = jax.tree.map(
        lambda p, c: jnp.where(synced, c, p), params, new_state.center
      )
    return params, new_state, loss

  pmap = lambda f: jax.pmap(f, axis_name=AXIS, devices=devices)
  init_state = pmap(tx.init)
  step = pmap(train_step)
  # Diagnostics only, run once at the end (not inside the step, where its
  # collectives would add communication to agn's quiet steps).
  divergence_of = pmap(lambda p: shardopt.replica_divergence(p, AXIS))

  params0 = init_mlp(jax.random.key(seed), (x_train.shape[1], hidden, 10))
  # Same initial params on every replica, placed by pmap itself (host arrays
  # would make the second step recompile: their placement differs from the
  # placement of the step's outputs).
  params = pmap(lambda _: params0)(np.arange(n))
  rng = np.random.default_rng(seed)
  batches = rng.integers(0, len(x_train), size=(steps, n, batch_per_replica))

  losses = []
  start = time.perf_counter()
  opt_state = init_state(params)
  bar = tqdm(
    range(steps),
    desc=f"{method:>11}",
    unit="step",
    leave=True,
    disable=not progress,
    file=sys.stderr,
    dynamic_ncols=True,
  )
  for i in bar:
    idx = batches[i]
    params, opt_state, loss = step(
      params, opt_state, x_train[idx], y_train[idx]
    )
    # Wait for each step: XLA's CPU backend can deadlock its collectives'
    # rendezvous when many multi-device steps are queued on few cores.
    losses.append(np.asarray(loss))
  jax.block_until_ready(params)
  wall = time.perf_counter() - start
  bar.close()

  losses = np.stack(losses).mean(axis=1)
  center = optax.tree_utils.tree_get(opt_state, "center")
  final = center if center is not None else params
  final = jax.tree.map(lambda a: np.asarray(a)[0], final)
  predictions = np.asarray(mlp_logits(final, x_test)).argmax(axis=1)
  accuracy = float((predictions == y_test).mean())
  if method == "agn":
    all_reduces = int(
      np.asarray(optax.tree_utils.tree_get(opt_state, "sync_count"))[0]
    )
  else:
    all_reduces = steps  # one gradient reduction per step
  divergence = float(np.asarray(divergence_of(params))[0])
  return RunResult(
    method, accuracy, steps, all_reduces, wall, losses, divergence
  )


def format_table(results: Sequence[RunResult], devices: list) -> str:
  """The results as a Markdown table (paste-able into notes)."""
  lines = [
    f"shardopt demo: MLP on sklearn digits, {len(devices)} x"
    f" {devices[0].platform} devices",
    "",
    "| method      | test accuracy | steps | all-reduces | wall time |",
    "|-------------|---------------|-------|-------------|-----------|",
  ]
  for r in results:
    lines.append(
      f"| {r.method:<11} | {r.test_accuracy:>13.1%} | {r.steps:>5d}"
      f" | {r.all_reduces:>11d} | {r.wall_time_s:>8.1f}s |"
    )
  lines.append("")
  lines.append(
    "all-reduces: cross_shard and tower reduce the gradients once per"
    " step (tower as reduce-scatter + all-gather); agn all-reduces"
    " only on sync steps (its sync_count). Wall time includes"
    " compilation."
  )
  return "\n".join(lines)


def plot_losses(results: Sequence[RunResult], path: str) -> str:
  """Saves the training-loss curves of every run to ``path`` (PNG)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.2))
  # cross_shard and tower give (nearly) the same curve: draw tower dashed on
  # top of a wide cross_shard line so both stay visible.
  styles = {
    "cross_shard": {"linewidth": 3.0, "alpha": 0.55},
    "tower": {"linestyle": "--", "linewidth": 1.3},
  }
  for r in results:
    ax.plot(
      range(1, len(r.losses) + 1),
      r.losses,
      **styles.get(r.method, {}),
      label=f"{r.method} ({r.all_reduces} all-reduces,"
      f" acc {r.test_accuracy:.1%})",
    )
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (mean over replicas)")
  ax.set_yscale("log")
  ax.set_title("shardopt demo: MLP on sklearn digits")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m shardopt.demo",
    description="Train an MLP on sklearn digits with shardopt's cross_shard,"
    " tower and agn over several devices.",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=200,
    help="training steps per method (default 200)",
  )
  parser.add_argument(
    "--devices",
    type=int,
    default=8,
    help="number of devices / replicas (default 8)",
  )
  parser.add_argument(
    "--method",
    default="all",
    choices=METHODS + ("all",),
    help="which optimizer to run (default all)",
  )
  parser.add_argument(
    "--out",
    default="demo_out",
    help="directory for loss_curves.png and results.md (default ./demo_out)",
  )
  parser.add_argument(
    "--communication-period",
    type=int,
    default=10,
    help="agn: steps between syncs (default 10)",
  )
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f"--steps must be >= 1, got {args.steps}")
  if args.devices < 1:
    parser.error(f"--devices must be >= 1, got {args.devices}")
  if args.communication_period < 1:
    parser.error(
      f"--communication-period must be >= 1, got {args.communication_period}"
    )
  return args


def main(argv: Sequence[str] | None = None) -> list:
  """Runs the demo; returns the list of :class:`RunResult`."""
  args = parse_args(argv)
  force_host_devices(args.devices)  # before JAX asks for its first device
  devices = select_devices(args.devices)
  methods = METHODS if args.method == "all" else (args.method,)
  data = load_digits_split()
  print(
    f"shardopt demo: {len(devices)} x {devices[0].platform} devices,"
    f" {args.steps} steps per method, methods: {', '.join(methods)}",
    flush=True,
  )
  results = []
  for method in methods:
    result = train(
      method,
      devices,
      data,
      steps=args.steps,
      communication_period=args.communication_period,
      progress=True,
    )
    print(
      f"{method}: test accuracy {result.test_accuracy:.1%},"
      f" {result.all_reduces} all-reduces, {result.wall_time_s:.1f}s,"
      f" replica divergence {result.replica_divergence:g}",
      flush=True,
    )
    results.append(result)
  table = format_table(results, devices)
  os.makedirs(args.out, exist_ok=True)
  png = plot_losses(results, os.path.join(args.out, "loss_curves.png"))
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table + "\n")
  print()
  print(table)
  print(f"\nloss curves: {png}")
  return results


if __name__ == "__main__":
  main()
