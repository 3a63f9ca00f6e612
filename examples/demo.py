"""``python -m examples.demo``: what shardopt is for, in two minutes.

The demo trains the same multilayer perceptron on scikit-learn's bundled
``digits`` data (1797 8x8 images, no download) over 8 devices, four ways:

* ``sync`` -- ``cross_shard(adam)``: average the gradients every step (one
  all-reduce of the whole gradient per step: PyTorch DDP);
* ``powersgd`` -- ``chain(powersgd(rank=2), adam)``: all-reduce rank-2
  factors of each gradient matrix instead, with error feedback;
* ``diloco`` -- ``diloco(adam, sync_period=H)``: local Adam steps on every
  replica; every ``H`` steps the outer Nesterov step on the averaged outer
  gradient;
* ``streaming`` -- ``diloco(..., num_fragments=2, comm_dtype=jnp.int4)``:
  one fragment of the params per sync, staggered over the period, its outer
  gradient on a 4-bit wire (``--outer-dtype``; per-block float32 scales).

For each it prints the test accuracy and the bytes each replica sends over
the run, read from the compiled step by :func:`shardopt.measure.traffic`
(collectives at the top level run every step; those inside a ``lax.cond``
branch on the steps the transform's schedule runs it: once per sync
period), and the ratio to ``sync``. It saves the frontier (accuracy against
bytes, log scale) and the loss curves as a PNG, and the table as Markdown.

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

    python -m examples.demo [--steps N] [--devices N] [--sync-period H]
                            [--method sync|powersgd|diloco|streaming|all]
                            [--outer-dtype int4|int8|float8_e4m3fn|bfloat16|float32]
                            [--out DIR] [--json PATH]

It runs from a clone of the repository, at its root (``make demo``
installs what it needs and runs it); it is no part of the ``shardopt``
package, whose import graph never reaches it (docs/layers.md). It needs
scikit-learn, matplotlib and tqdm, which shardopt itself does not install:
``pip install -e ".[demo]"`` (the ``demo`` extra). Without them it says so
and exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from benchmarks._report import git_commit

METHODS = ("sync", "powersgd", "diloco", "streaming")
AXIS = "batch"
DEFAULT_OUTER_DTYPE = "int4"
_FORCE_FLAG = "--xla_force_host_platform_device_count"
# What the demo imports beyond shardopt's own dependencies, module ->
# distribution: the ``demo`` extra in pyproject.toml.
DEMO_EXTRA = {
  "sklearn": "scikit-learn",
  "matplotlib": "matplotlib",
  "tqdm": "tqdm",
}


def require_demo_extra() -> None:
  """Exits (status 1, no traceback) naming ``pip install -e ".[demo]"``
  when a module the demo imports is not installed."""
  missing = []
  for module, distribution in DEMO_EXTRA.items():
    try:
      importlib.import_module(module)
    except ImportError:
      missing.append(distribution)
  if missing:
    raise SystemExit(
      f"python -m examples.demo needs {', '.join(missing)}, which"
      " shardopt does not install. Install the demo extra:\n"
      '    pip install -e ".[demo]"\n'
      "(or run make demo, which does)."
    )


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
      f"examples.demo: --devices {count} asked for {count} devices, but only"
      f" {len(pool)} {pool[0].platform} device(s) exist. Run the demo in a"
      f" fresh process (XLA_FLAGS={_FORCE_FLAG}={count} is applied before JAX"
      " starts), or pass a smaller --devices."
    )
  return list(pool[:count])


class RunResult(NamedTuple):
  method: str
  test_accuracy: float
  steps: int
  bytes_per_replica: float  # sent over the whole run, from the HLO
  wall_time_s: float
  losses: Any  # numpy array [steps], mean over replicas
  replica_divergence: float  # of the model evaluated (the center, if any)
  wire: str  # what travels, e.g. "float32 gradients"


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
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
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
  method: str,
  learning_rate: float,
  sync_period: int,
  outer_dtype: Any = None,
):
  """The optax transform the demo trains with for ``method``."""
  import optax  # pylint: disable=g-import-not-at-top

  import shardopt  # pylint: disable=g-import-not-at-top

  if method == "sync":
    return shardopt.cross_shard(optax.adam(learning_rate), AXIS)
  if method == "powersgd":
    return optax.chain(
      shardopt.powersgd(AXIS, rank=2), optax.adam(learning_rate)
    )
  if method in ("diloco", "streaming"):
    # DiLoCo's published recipe: outer Nesterov SGD, lr 0.7, momentum 0.9.
    return shardopt.diloco(
      optax.adam(learning_rate),
      AXIS,
      sync_period=sync_period,
      outer_learning_rate=0.7,
      outer_momentum=0.9,
      num_fragments=2 if method == "streaming" else 1,
      comm_dtype=outer_dtype if method == "streaming" else None,
    )
  raise ValueError(
    f"examples.demo: unknown method {method!r}; use one of {METHODS} or 'all'."
  )


def train(
  method: str,
  devices: list,
  data,
  *,
  steps: int,
  batch_per_replica: int = 32,
  learning_rate: float = 3e-3,
  sync_period: int = 16,
  outer_dtype: Any = None,
  hidden: int = 64,
  seed: int = 0,
  progress: bool = True,
) -> RunResult:
  """Trains the MLP with ``method`` over ``devices``; returns its result row.

  A plain ``jax.pmap`` loop: every replica holds its own copy of params and
  optimizer state (a leading device axis) and sees its own batch each step.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  import shardopt  # pylint: disable=g-import-not-at-top
  from shardopt.measure import traffic  # pylint: disable=g-import-not-at-top

  x_train, x_test, y_train, y_test = data
  n = len(devices)
  tx = make_optimizer(method, learning_rate, sync_period, outer_dtype)

  def train_step(params, opt_state, features, labels):
    loss, grads = jax.value_and_grad(cross_entropy)(params, features, labels)
    updates, new_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, loss

  pmap = lambda f: jax.pmap(f, axis_name=AXIS, devices=devices)
  init_state = pmap(tx.init)
  step = pmap(train_step)
  # Diagnostics only, run once at the end (not inside the step, where its
  # collectives would add communication to diloco's quiet steps).
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
  idx = batches[0]
  # What one replica sends over the run, read from the compiled step: the
  # sync branches of diloco and streaming count on the steps tx's schedule
  # runs them (shardopt.measure.traffic; nothing runs here).
  sent = traffic(
    step, params, opt_state, x_train[idx], y_train[idx], tx=tx
  ).run(steps)
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
  divergence = float(np.asarray(divergence_of(final))[0])
  final = jax.tree.map(lambda a: np.asarray(a)[0], final)
  predictions = np.asarray(mlp_logits(final, x_test)).argmax(axis=1)
  accuracy = float((predictions == y_test).mean())
  wire = {
    "sync": "float32 gradients, every step",
    "powersgd": "rank-2 float32 factors, every step",
    "diloco": f"float32 outer gradient, every {sync_period} steps",
    "streaming": f"{np.dtype(outer_dtype).name if outer_dtype else 'float32'}"
    f" outer gradient, one of 2 fragments per sync, each every"
    f" {sync_period} steps",
  }[method]
  return RunResult(
    method, accuracy, steps, sent, wall, losses, divergence, wire
  )


def format_table(results: Sequence[RunResult], devices: list) -> str:
  """The results as a Markdown table (paste-able into notes)."""
  sync = next((r for r in results if r.method == "sync"), None)
  lines = [
    f"shardopt demo: MLP on sklearn digits, {len(devices)} x"
    f" {devices[0].platform} devices, {results[0].steps} steps",
    "",
    "| method    | test accuracy | bytes sent per replica | vs sync | on the wire |",
    "|-----------|---------------|------------------------|---------|-------------|",
  ]
  for r in results:
    ratio = (
      f"1/{sync.bytes_per_replica / r.bytes_per_replica:,.0f}"
      if sync is not None and r.bytes_per_replica and r is not sync
      else ("1" if r is sync else "-")
    )
    lines.append(
      f"| {r.method:<9} | {r.test_accuracy:>13.1%} |"
      f" {r.bytes_per_replica / 1e6:>19,.2f} MB | {ratio:>7} | {r.wire} |"
    )
  lines.append("")
  lines.append(
    "Bytes: what one replica sends over the run (ring all-reduce: 2 (n-1)/n"
    " of the buffer), read from the compiled step's collectives; those in a"
    " sync branch count once per sync period. Accuracy of the params every"
    " replica shares (DiLoCo's center)."
  )
  return "\n".join(lines)


# How each method is drawn: diloco's and streaming's loss curves lie close
# together, so line style, width and markers tell them apart (diloco's wide
# and pale under streaming's narrow dotted line).
_STYLES = {
  "sync": dict(linestyle="-", marker="o", linewidth=1.5, alpha=1.0),
  "powersgd": dict(linestyle="-.", marker="s", linewidth=1.5, alpha=1.0),
  "diloco": dict(linestyle="--", marker="^", linewidth=3.5, alpha=0.55),
  "streaming": dict(linestyle=":", marker="D", linewidth=1.8, alpha=1.0),
}
_DEFAULT_STYLE = dict(linestyle="-", marker="o", linewidth=1.5, alpha=1.0)
# The loss panel's running mean: one of the demo's default sync periods.
_SMOOTH = 16


def _running_mean(losses, window: int):
  """The mean of the last ``window`` losses at every step (fewer at first)."""
  cumulative = np.cumsum(np.concatenate([[0.0], np.asarray(losses, float)]))
  steps = np.arange(1, len(losses) + 1)
  start = np.maximum(steps - window, 0)
  return (cumulative[steps] - cumulative[start]) / (steps - start)


def plot_results(results: Sequence[RunResult], path: str) -> str:
  """Saves the frontier (accuracy vs bytes) and the loss curves (PNG)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import NullFormatter  # pylint: disable=g-import-not-at-top

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  placed = []
  for k, r in enumerate(results):
    color = f"C{k}"
    style = _STYLES.get(r.method, _DEFAULT_STYLE)
    point = (r.bytes_per_replica / 1e6, r.test_accuracy * 100)
    left.scatter(*point, s=60, color=color, marker=style["marker"])
    # Labels of points that (nearly) coincide are stacked, not overprinted.
    near = sum(
      abs(np.log(point[0] / x)) < 0.1 and abs(point[1] - y) < 0.1
      for x, y in placed
    )
    placed.append(point)
    left.annotate(
      r.method, point, textcoords="offset points", xytext=(6, 4 + 12 * near)
    )
    steps = np.arange(1, len(r.losses) + 1)
    right.plot(steps, r.losses, color=color, linewidth=0.6, alpha=0.25)
    right.plot(
      steps,
      _running_mean(r.losses, _SMOOTH),
      color=color,
      markersize=5,
      **style,
      # Each curve's markers at other steps, so that close curves show both.
      markevery=(2 * k + 4, 2 * len(_STYLES) + 8),
      label=r.method,
    )
  left.set_xscale("log")
  left.xaxis.set_minor_formatter(NullFormatter())
  # Room for the labels inside the frame: a point at an edge keeps its
  # label (placed up and to the right of it) within the axes.
  left.margins(x=0.25, y=0.18)
  left.set_xlabel("MB sent per replica over the run (log)")
  left.set_ylabel("test accuracy (%)")
  left.set_title("quality per byte")
  left.grid(alpha=0.3)
  right.set_xlabel("step")
  right.set_ylabel("training loss (mean over replicas)")
  right.set_yscale("log")
  right.set_title(f"training loss: each step (faint), mean of {_SMOOTH}")
  right.grid(alpha=0.3)
  right.legend()
  fig.suptitle("shardopt demo: MLP on sklearn digits")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write_json(
  path: str,
  results: Sequence[RunResult],
  devices: list,
  args: argparse.Namespace,
  argv: Sequence[str] | None,
) -> None:
  """The results as JSON, with the command, the date (UTC) and the commit:
  what ``python -m benchmarks.blocks`` renders the README's table from
  (``examples/demo_blocks.py``)."""
  import datetime  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  argv = sys.argv[1:] if argv is None else list(argv)
  data = {
    "command": " ".join(["python -m examples.demo", *argv]),
    "measured_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "commit": git_commit(),
    "devices": len(devices),
    "platform": devices[0].platform,
    "steps": args.steps,
    "sync_period": args.sync_period,
    "outer_dtype": args.outer_dtype,
    "methods": [
      {
        "method": r.method,
        "test_accuracy": r.test_accuracy,
        "bytes_per_replica": r.bytes_per_replica,
        "steps": r.steps,
        "wire": r.wire,
        "wall_time_s": r.wall_time_s,
        "replica_divergence": r.replica_divergence,
        "final_loss": float(np.asarray(r.losses)[-1]),
      }
      for r in results
    ],
  }
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m examples.demo",
    description="Train an MLP on sklearn digits over several devices with"
    " synchronous data parallelism, PowerSGD, DiLoCo and streaming DiLoCo,"
    " and compare accuracy with the bytes each sends.",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=256,
    help="training steps per method (default 256)",
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
    help="directory for frontier.png and results.md (default ./demo_out)",
  )
  parser.add_argument(
    "--json",
    default=None,
    metavar="PATH",
    help="also write the results, the command, the date and the commit as"
    " JSON to PATH (the README's table: benchmarks/results/demo.json)",
  )
  parser.add_argument(
    "--sync-period",
    type=int,
    default=16,
    help="diloco and streaming: steps between syncs (default 16)",
  )
  parser.add_argument(
    "--outer-dtype",
    default=DEFAULT_OUTER_DTYPE,
    help="streaming: the wire dtype of the outer gradient (default"
    f" {DEFAULT_OUTER_DTYPE})",
  )
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f"--steps must be >= 1, got {args.steps}")
  if args.devices < 1:
    parser.error(f"--devices must be >= 1, got {args.devices}")
  if args.sync_period < 1:
    parser.error(f"--sync-period must be >= 1, got {args.sync_period}")
  return args


def _dtype(name: str):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return None if name == "float32" else jnp.dtype(name)


def main(argv: Sequence[str] | None = None) -> list:
  """Runs the demo; returns the list of :class:`RunResult`."""
  args = parse_args(argv)
  require_demo_extra()
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
      sync_period=args.sync_period,
      outer_dtype=_dtype(args.outer_dtype),
      progress=True,
    )
    print(
      f"{method}: test accuracy {result.test_accuracy:.1%},"
      f" {result.bytes_per_replica / 1e6:,.2f} MB sent per replica,"
      f" {result.wall_time_s:.1f}s, replica divergence"
      f" {result.replica_divergence:g}",
      flush=True,
    )
    results.append(result)
  table = format_table(results, devices)
  os.makedirs(args.out, exist_ok=True)
  png = plot_results(results, os.path.join(args.out, "frontier.png"))
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table + "\n")
  if args.json:
    write_json(args.json, results, devices, args, argv)
  print()
  print(table)
  print(f"\nfrontier and loss curves: {png}")
  return results


if __name__ == "__main__":
  main()
