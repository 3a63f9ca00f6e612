"""Quality of the quantized wire: digits, 8 replicas, every wire side by side.

``python -m benchmarks.studies.quantized_quality [--quick] [--seeds S] [--steps N]``
trains :mod:`examples.demo`'s workload (scikit-learn's digits, a 64-64-10
MLP, Adam lr 3e-3, 32 examples per replica per step, 8 replicas under
``pmap``; its data, model and HLO byte reader are imported from the demo)
with

* ``diloco(optax.adam(3e-3), "batch", sync_period=16)`` and its outer
  gradient on a float32 / int8 / float8_e4m3fn / int4 wire, each quantized
  wire with and without ``error_feedback`` (float32 has none);
* ``cross_shard(optax.adam(3e-3), "batch")`` with a float32 wire, int8 with
  and without error feedback, int4 with and without it, and a top-k wire
  (``shardopt.topk(64)``: 64 of every 4096 entries, 2-bit values) with error
  feedback;
* DeMo (issue 43 item 3): ``chain(decoupled_momentum("batch", k=32,
  chunk_size=64, decay=0.999), optax.scale_by_learning_rate(lr))``, the
  paper's defaults and its sign step, at lr 3e-3 (the paper's DeMo runs took
  AdamW's learning rate, here Adam's 3e-3, without weight decay) and at x3,
  x0.3 and x0.1 of it, compared with ``cross_shard``'s float32 wire;

all on the same seeds (seed ``s``: params ``init_mlp(key(s))``, batches drawn
by ``default_rng(s)``, the demo's fixed 80/20 split), so the wires are
compared on identical data. The model evaluated is the one every replica
shares (DiLoCo's center; ``cross_shard``'s params): test accuracy, test loss
and the loss on the whole training split after the last step, mean ± std
over the seeds. Bytes per replica over the run come from each compiled step's
HLO (:func:`shardopt.measure.traffic`: a ring all-reduce sends
``2 (n - 1) / n`` of its buffer, an all-to-all or all-gather ``(n - 1) / n``;
collectives in a sync branch count once per ``sync_period``); a quantized
wire's bytes include its float32 block scales and the zero padding of each
leaf's ``n`` chunks.

"Within noise" is section 5b's rule: ``|Δ mean| <= 2 sqrt(s_a² + s_b²) /
sqrt(n)`` (two standard errors of the difference of the means over ``n``
seeds), applied to the final test accuracy and to the final train loss, each
quantized row against the float32 row of the same method.

Prints the table and writes ``benchmarks/results/quantized_quality.json``
and ``quantized_quality.png`` (under ``results/quick/`` with ``--quick``,
git-ignored). Run on its own, like section 10 (``benchmarks/perf/quantized.py``):
the module has ``benchmarks.run``'s section interface (``run(quick)``,
``plot(section, directory)``), but its ``--quick`` pass (6 compiles) takes
about a minute on a shared 2-core machine, too long to add to the smoke run.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick="--quick" in sys.argv[1:])

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import RESULTS  # noqa: E402
from benchmarks import _report  # noqa: E402
from examples import demo  # noqa: E402
from shardopt.measure.traffic import traffic  # noqa: E402
from shardopt.periodic.checks import DEFAULT_OUTER as OUTER  # noqa: E402

NAME = "quantized_quality"
TITLE = (
  "10b. Quantized wire quality: digits, 8 replicas, diloco, cross_shard, DeMo"
)
REPLICAS = 8
HIDDEN = 64
BATCH = 32
LEARNING_RATE = 3e-3
SYNC_PERIOD = 16
STEPS = 384
SEEDS = 3
QUICK_STEPS = 32
NOISE_RULE = (
  "|Δ mean| <= 2 sqrt(s_a² + s_b²) / sqrt(n): two standard errors of the"
  " difference of the means, s = sample std (ddof 1) over the n seeds;"
  " applied to the final test accuracy and to the final train loss"
  " separately, each against the float32 wire of the same method, and"
  " 'within noise' needs both"
)


class Config(NamedTuple):
  method: str  # "diloco", "cross_shard" or "demo"
  wire: str  # "float32", "int8", "float8_e4m3fn", "int4", TOPK, DEMO_WIRE
  error_feedback: bool
  lr_scale: float = 1.0  # DeMo's sign step: lr = lr_scale * LEARNING_RATE

  @property
  def label(self) -> str:
    if self.method == "demo":
      return f"demo {self.wire}, sign lr {self.lr_scale * LEARNING_RATE:g}"
    return f"{self.method} {self.wire}" + (
      " + EF" if self.error_feedback else ""
    )


TOPK = "topk 64/4096 2-bit"
# DeMo's defaults: the top 32 DCT coefficients of every 64 x 64 tile of the
# momentum (float32 values), decay 0.999.
DEMO_K, DEMO_CHUNK, DEMO_DECAY = 32, 64, 0.999
DEMO_WIRE = f"DCT top {DEMO_K}/{DEMO_CHUNK}² decay {DEMO_DECAY:g}"
DEMO_LR_SCALES = (1.0, 3.0, 0.3, 0.1)
# The float32 row each method is compared with (DeMo: cross_shard's).
_BASE = {
  "diloco": "diloco",
  "cross_shard": "cross_shard",
  "demo": "cross_shard",
}
_DTYPES = {
  "float32": None,
  "int8": jnp.int8,
  "float8_e4m3fn": jnp.float8_e4m3fn,
  "int4": jnp.int4,
  TOPK: shardopt.topk(64),
}
# Fewer bytes than float32 the issue asks of each narrow wire.
_GOAL_FEWER = {"int8": 4, "float8_e4m3fn": 4, "int4": 8}


def configs(quick: bool) -> list[Config]:
  """The runs, the float32 wire of each method first."""
  if quick:  # the smoke run: one of each kind
    return [
      Config("diloco", "float32", False),
      Config("diloco", "int4", False),
      Config("diloco", "int4", True),
      Config("cross_shard", "float32", False),
      Config("cross_shard", "int8", True),
      Config("demo", DEMO_WIRE, False),
    ]
  out = [Config("diloco", "float32", False)]
  for wire in ("int8", "float8_e4m3fn", "int4"):
    out += [Config("diloco", wire, False), Config("diloco", wire, True)]
  out += [
    Config("cross_shard", "float32", False),
    Config("cross_shard", "int8", False),
    Config("cross_shard", "int8", True),
    Config("cross_shard", "int4", False),
    Config("cross_shard", "int4", True),
    Config("cross_shard", TOPK, True),
  ]
  out += [Config("demo", DEMO_WIRE, False, s) for s in DEMO_LR_SCALES]
  return out


def optimizer(config: Config) -> optax.GradientTransformation:
  if config.method == "demo":  # the paper's sign step, no weight decay
    return optax.chain(
      shardopt.decoupled_momentum(
        demo.AXIS, k=DEMO_K, chunk_size=DEMO_CHUNK, decay=DEMO_DECAY
      ),
      optax.scale_by_learning_rate(config.lr_scale * LEARNING_RATE),
    )
  adam = optax.adam(LEARNING_RATE)
  dtype = _DTYPES[config.wire]
  if config.method == "diloco":
    return shardopt.diloco(
      adam,
      demo.AXIS,
      sync_period=SYNC_PERIOD,
      comm_dtype=dtype,
      error_feedback=config.error_feedback,
    )
  return shardopt.cross_shard(
    adam, demo.AXIS, comm_dtype=dtype, error_feedback=config.error_feedback
  )


def _evaluated(opt_state, params):
  """The model every replica shares: DiLoCo's center, else the params."""
  center = optax.tree_utils.tree_get(opt_state, "center")
  return center if center is not None else params


def train(config: Config, devices: list, data, seeds, steps: int) -> dict:
  """One config over the seeds: final metrics per seed and bytes from HLO."""
  x_train, x_test, y_train, y_test = data
  n = len(devices)
  tx = optimizer(config)

  def train_step(params, opt_state, features, labels):
    loss, grads = jax.value_and_grad(demo.cross_entropy)(
      params, features, labels
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  pmap = lambda f: jax.pmap(f, axis_name=demo.AXIS, devices=devices)
  identity = pmap(lambda t: t)
  init = pmap(tx.init)

  @jax.jit
  def metrics(params):
    logits = demo.mlp_logits(params, x_test)
    return {
      "test_acc": jnp.mean(jnp.argmax(logits, -1) == y_test),
      "test_loss": demo.cross_entropy(params, x_test, y_test),
      "train_loss": demo.cross_entropy(params, x_train, y_train),
    }

  def start(seed):
    params0 = demo.init_mlp(
      jax.random.key(seed), (x_train.shape[1], HIDDEN, 10)
    )
    params = identity(
      jax.tree.map(lambda a: np.broadcast_to(a, (n,) + a.shape), params0)
    )
    return params, init(params)

  params, opt_state = start(seeds[0])
  t0 = time.perf_counter()
  idx = np.zeros((n, BATCH), np.int64)
  step = (
    pmap(train_step)
    .lower(params, opt_state, x_train[idx], y_train[idx])
    .compile()
  )
  compile_s = time.perf_counter() - t0
  per_step = traffic(step, tx=tx).per_step

  rows: dict[str, list] = {
    "test_acc": [],
    "test_loss": [],
    "train_loss": [],
    "divergence": [],
  }
  curves = []
  t0 = time.perf_counter()
  for seed in seeds:
    params, opt_state = start(seed)
    batches = np.random.default_rng(seed).integers(
      0, len(x_train), size=(steps, n, BATCH)
    )
    losses = []
    for i in range(steps):
      idx = batches[i]
      params, opt_state, loss = step(
        params, opt_state, x_train[idx], y_train[idx]
      )
      # Wait for each step: XLA's CPU collectives can hang when many
      # multi-device steps are queued on few cores.
      losses.append(float(np.asarray(loss).mean()))
    model = jax.tree.map(np.asarray, _evaluated(opt_state, params))
    rows["divergence"].append(
      max(float(np.abs(a - a[:1]).max()) for a in jax.tree.leaves(model))
    )
    for name, value in metrics(jax.tree.map(lambda a: a[0], model)).items():
      rows[name].append(float(value))
    curves.append(losses)
    print(
      f"[{NAME}] {config.label} seed {seed}: test acc"
      f" {rows['test_acc'][-1]:.4f}, train loss {rows['train_loss'][-1]:.4f},"
      f" test loss {rows['test_loss'][-1]:.4f}",
      flush=True,
    )
  ddof = 1 if len(seeds) > 1 else 0
  out: dict[str, Any] = {
    "method": config.method,
    "wire": config.wire,
    "error_feedback": config.error_feedback,
    "label": config.label,
    "lr_scale": config.lr_scale,
    "bytes_per_step": per_step,
    "bytes_per_replica": per_step * steps,
    "compile_s": compile_s,
    "train_s": time.perf_counter() - t0,
    "max_replica_divergence": max(rows.pop("divergence")),
  }
  for name, values in rows.items():
    out[name] = values
    out[f"{name}_mean"] = float(np.mean(values))
    out[f"{name}_std"] = float(np.std(values, ddof=ddof))
  curve = np.asarray(curves).mean(0)
  every = max(1, steps // 64)
  out["minibatch_loss_curve"] = {
    "every": every,
    "mean_over_seeds": curve[every - 1 :: every].tolist(),
  }
  return out


def within_noise(row: dict, base: dict, n: int) -> tuple[str, bool | None]:
  """``row`` vs ``base`` on final test accuracy and train loss (NOISE_RULE).

  Returns the sentence and whether both are within noise (None: 1 seed).
  """
  parts, within_all = [], True
  for name, what in (("test_acc", "accuracy"), ("train_loss", "train loss")):
    a, b = row[f"{name}_mean"], base[f"{name}_mean"]
    bound = (
      2 * math.hypot(row[f"{name}_std"], base[f"{name}_std"]) / math.sqrt(n)
    )
    delta = a - b
    within = abs(delta) <= bound
    within_all = within_all and within
    better = delta > 0 if name == "test_acc" else delta < 0
    verdict = (
      "no verdict with 1 seed"
      if n < 2
      else "within noise"
      if within
      else ("BETTER" if better else "WORSE") + " beyond noise"
    )
    parts.append(
      f"{what} {a:.4f} vs {b:.4f} (Δ {delta:+.4f}, bound {bound:.4f}: {verdict})"
    )
  return "; ".join(parts), (within_all if n > 1 else None)


COLUMNS = [
  "method",
  "wire",
  "EF",
  "test accuracy",
  "train loss",
  "test loss",
  "bytes sent per replica",
  "fewer bytes than float32",
  "vs float32 (2 SE rule)",
  "paired Δ train loss [min, max]",
]


def run(quick: bool, seeds: int | None = None, steps: int | None = None):
  """Trains every config; returns the section (table, notes, data)."""
  seeds = list(range(1 if quick else (seeds or SEEDS)))
  steps = steps or (QUICK_STEPS if quick else STEPS)
  devices = demo.select_devices(REPLICAS)
  data = demo.load_digits_split()
  start = time.perf_counter()
  results = []
  for config in configs(quick):
    results.append(train(config, devices, data, seeds, steps))
  base = {r["method"]: r for r in results if r["wire"] == "float32"}
  n = len(seeds)
  rows, verdicts = [], {}
  for r in results:
    b = base[_BASE[r["method"]]]
    r["fewer_bytes"] = b["bytes_per_replica"] / r["bytes_per_replica"]
    paired = np.asarray(r["train_loss"]) - np.asarray(b["train_loss"])
    r["paired_train_loss_delta"] = paired.tolist()
    if r is b:
      verdict, r["within_noise"] = "-", None
    else:
      sentence, r["within_noise"] = within_noise(r, b, n)
      r["comparison"] = sentence
      verdict = {None: "n/a (1 seed)", True: "within noise"}.get(
        r["within_noise"], "OUTSIDE noise"
      )
      verdicts[r["label"]] = sentence
    demo_row = r["method"] == "demo"
    rows.append(
      [
        f"demo, sign lr {r['lr_scale'] * LEARNING_RATE:g}"
        + (f" (x{r['lr_scale']:g})" if r["lr_scale"] != 1 else "")
        if demo_row
        else r["method"],
        r["wire"],
        "in momentum" if demo_row else "yes" if r["error_feedback"] else "no",
        f"{r['test_acc_mean']:.4f} ± {r['test_acc_std']:.4f}",
        f"{r['train_loss_mean']:.4f} ± {r['train_loss_std']:.4f}",
        f"{r['test_loss_mean']:.4f} ± {r['test_loss_std']:.4f}",
        f"{r['bytes_per_replica'] / 1e6:,.3f} MB",
        f"{r['fewer_bytes']:.2f}x",
        verdict,
        "-"
        if r is b
        else f"{paired.mean():+.4f} [{paired.min():+.4f}, {paired.max():+.4f}]",
      ]
    )
  notes = [
    f"Workload: examples.demo's digits MLP (64-{HIDDEN}-10), {REPLICAS}"
    f" replicas under pmap, {BATCH} examples per replica per step, Adam lr"
    f" {LEARNING_RATE:g} inside diloco and cross_shard, {steps} steps"
    f" ({steps // SYNC_PERIOD} DiLoCo syncs at sync_period={SYNC_PERIOD},"
    " diloco's default outer step: Nesterov SGD lr"
    f" {OUTER['outer_learning_rate']:g} momentum {OUTER['outer_momentum']:g}),"
    " mean ± std over"
    f" {n} seed(s) ({', '.join(map(str, seeds))}); the same params and"
    " batches for every wire of a seed.",
    "Metrics of the model every replica shares after the last step"
    " (DiLoCo's center, which the last sync set): test accuracy and loss on"
    f" the demo's 20% test split ({len(data[1])} digits), train loss on the"
    f" whole 80% training split. Largest difference between replicas of"
    " that model over every run: "
    f"{max(r['max_replica_divergence'] for r in results):g}"
    " (0 = bit-identical).",
    "Bytes: what one replica sends over the run, from each compiled step's"
    " HLO (shardopt.measure.traffic; a sync branch's collectives"
    " once per sync_period). A quantized wire is one all-to-all and one"
    " all-gather of uint8 rows (values, then float32 block scales, each leaf"
    " cut into n = 8 zero-padded chunks of 256-element blocks) plus a 4-byte"
    " float32 flag; the scales and padding of the small leaves (the 64 and"
    " 10 biases cost one block per chunk) are why int8 gives 3.9x, not 4x.",
    f"Top-k and DeMo rows (issue 43 item 3): cross_shard's {TOPK} wire is"
    " shardopt.topk(64) (64 of every 4096 entries, a leaf shorter than that"
    " keeps ceil(64 size / 4096), 2-bit values, error decay 0.95) with error"
    " feedback, into Adam. DeMo is chain(decoupled_momentum(k="
    f"{DEMO_K}, chunk_size={DEMO_CHUNK}, decay={DEMO_DECAY:g}),"
    " scale_by_learning_rate(lr)): the paper's defaults and sign step, lr"
    f" {LEARNING_RATE:g} (the paper's DeMo runs took AdamW's learning rate,"
    " here Adam's, without weight decay) and x3, x0.3, x0.1 of it; what a"
    " replica does not send stays in its momentum ('EF: in momentum'); it"
    " is compared with cross_shard's float32 wire (both exchange every"
    " step).",
    f"Within noise: {NOISE_RULE}.",
    "Paired Δ train loss: this wire's final train loss minus the float32"
    " wire's on the same seed (same init and batches), mean over the seeds"
    " and [min, max]: a shift of the same sign on every seed is a"
    " systematic effect of the wire even when it is within the seed noise.",
  ]
  for label, sentence in verdicts.items():
    notes.append(f"{label}: {sentence}.")
  goal = []
  for r in results:
    if r["method"] != "diloco" or r["wire"] == "float32":
      continue
    goal.append(
      f"{r['label']}: {r['fewer_bytes']:.2f}x fewer bytes (issue: "
      f"{_GOAL_FEWER[r['wire']]}x), "
      + {None: "no verdict", True: "within noise"}.get(
        r["within_noise"], "NOT within noise"
      )
    )
  notes.append("Goal (diloco within seed noise of float32): " + "; ".join(goal))
  return {
    "name": NAME,
    "title": TITLE,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "command": "python -m benchmarks.studies.quantized_quality"
    + (" --quick" if quick else "")
    + ("" if quick or n == SEEDS else f" --seeds {n}")
    + ("" if steps in (STEPS, QUICK_STEPS) else f" --steps {steps}"),
    "steps": steps,
    "seeds": seeds,
    "replicas": len(devices),
    "noise_rule": NOISE_RULE,
    "table": {"columns": COLUMNS, "rows": rows},
    "notes": notes,
    "data": results,
    "wall_s": time.perf_counter() - start,
  }


def table(section: dict) -> str:
  """The section's table as Markdown, with its notes."""
  columns = section["table"]["columns"]
  lines = [
    f"{section['title']} ({section['steps']} steps, {len(section['seeds'])}"
    f" seed(s), wall {section['wall_s']:.0f} s)",
    "",
    "| " + " | ".join(columns) + " |",
    "|" + "---|" * len(columns),
  ]
  lines += ["| " + " | ".join(row) + " |" for row in section["table"]["rows"]]
  lines.append("")
  lines += [f"- {note}" for note in section["notes"]]
  return "\n".join(lines)


def plot(section: dict, directory: str) -> list[str]:
  """Test accuracy and train loss against bytes per replica (log x)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(15, 4.6))
  markers = {
    "float32": "o",
    "int8": "s",
    "float8_e4m3fn": "D",
    "int4": "^",
    TOPK: "v",
    DEMO_WIRE: "*",
  }
  colors = {"diloco": "#4c72b0", "cross_shard": "#c44e52", "demo": "#55a868"}
  for ax, metric, what in (
    (axes[0], "test_acc", "test accuracy"),
    (axes[1], "train_loss", "train loss (whole training split)"),
  ):
    for r in section["data"]:
      ax.errorbar(  # error feedback nudged right, DeMo's lrs apart: same bytes
        r["bytes_per_replica"]
        / 1e6
        * (1.08 if r["error_feedback"] else 1)
        * r.get("lr_scale", 1.0) ** 0.08,
        r[f"{metric}_mean"],
        yerr=r[f"{metric}_std"],
        marker=markers[r["wire"]],
        mfc="white" if r["error_feedback"] else colors[r["method"]],
        color=colors[r["method"]],
        capsize=3,
        linestyle="none",
        label=r["label"],
      )
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per replica over the run (log)")
    ax.set_ylabel(what)
    ax.grid(alpha=0.3)
  axes[1].set_yscale("log")
  axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
  fig.suptitle(
    f"Quantized wire on digits: {section['steps']} steps, mean ± std over"
    f" {len(section['seeds'])} seed(s) (hollow = error feedback, drawn 8%"
    " to the right; DeMo's learning rates spread by lr^0.08)",
    fontsize=10,
  )
  fig.tight_layout()
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{NAME}.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return [path]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--seeds", type=int, default=SEEDS)
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  section = run(args.quick, args.seeds, args.steps)
  print(table(section))
  directory = os.path.join(RESULTS, "quick" if args.quick else "")
  section["plots"] = [os.path.basename(p) for p in plot(section, directory)]
  path = _report.write_json(f"{NAME}.json", section, quick=args.quick)
  print(f"wrote {path} and {os.path.join(directory, section['plots'][0])}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
