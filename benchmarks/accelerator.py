"""First numbers on an accelerator, in one prepared command (issue 43).

``PYTHONPATH=src python -m benchmarks.accelerator [--tiny] --out DIR``
writes ``DIR/accelerator.json`` and prints a table per section. It needs only
JAX, optax, flax and chex (what the GPU machine has; scikit-learn and
matplotlib are neither imported nor needed). Every section runs the 8
replicas under ``jax.vmap(axis_name="batch")`` on the default device (the
route of drjax and MaxText, ``shardopt.vmap_axes`` for the state):

- ``backend``: platform, device kind, JAX's version, what is missing;
- ``transforms``: every public transform for a few steps on fixed
  per-replica gradients, with ``max_abs_diff`` of the final params against
  the same run on the CPU backend of the same machine (float32 matmuls at
  ``"highest"`` precision both ways);
- ``wires``: encode + exchange + decode (``shardopt.cross_shard_mean``'s
  update over the vmapped axis of 8) for float32, bfloat16, int8, float8,
  int4 and top-k, with and without error feedback: ``gbps`` of float32
  input, its ratio to the device's copy bandwidth (``x + 1`` on the same
  input, the same unit), and the wire's share of a step of the study's LM at
  about 100M parameters (one replica's encode and decode, 1/8 of the vmapped
  time, against that model's forward and backward pass);
- ``overhead``: the step that syncs nothing of ``local_sgd``, ``diloco``,
  ``agn`` and ``apply_if_finite(local_sgd)``, each both ways: host-scheduled
  (``tx.update(..., sync=0)``, goal <= 1.02x) and in-graph (the schedule's
  ``lax.cond`` in the step), with the finite guard alone and ``agn``'s floor
  (adam + an accumulator add), against the plain optax step (Adam),
  interleaved, medians, donated buffers; beside each time the compiled
  step's XLA ``bytes accessed`` and copied bytes;
- ``frontier``: the study's byte-level LM (:mod:`benchmarks.studies.workload`)
  at about 20M parameters with 8 vmap replicas, :func:`benchmarks.methods.
  frontier`'s methods, each with ``val_bits_per_byte`` and
  ``bytes_per_replica`` (its per-replica update compiled, not run, under
  ``pmap`` on 8 CPU devices: :func:`benchmarks.studies.workload.update_bytes`).
  The number of steps is what fits the section's time (one timed chunk of
  sync first); ``--tiny``: the TINY config, 64 steps. Every method runs one
  untimed chunk of its compiled steps (and a validation) before its timed
  run, so no method pays what a first call pays once.

The JSON's provenance is the run's own (:func:`benchmarks._report.provenance`):
the command as the process got it and ``argv``, the ISO date in UTC, the
commit from git (else from ``$SHARDOPT_COMMIT``, else ``"unknown"``;
``commit_from`` says which), the device kind, platform and driver from the
runtime. Nothing edits the file after the run.

Each section survives the others' failures (its error text goes into the
JSON) and has a time budget (what does not fit is skipped and said so);
the JSON is rewritten after every section. ``--tiny`` runs every section at
toy sizes, on a CPU in a few minutes (``tests/test_accelerator_command.py``).
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # 8 host devices, for the bytes of the frontier
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
  os.environ["XLA_FLAGS"] = _flags.strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardopt  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks import methods  # noqa: E402
from benchmarks.perf import workload as perf_workload  # noqa: E402
from benchmarks.perf.harness import compare  # noqa: E402
from benchmarks.studies import workload  # noqa: E402
from shardopt.measure import hlo  # noqa: E402

AXIS = workload.AXIS
R = 8  # replicas
SECTIONS = ("backend", "transforms", "wires", "overhead", "frontier")
# Seconds per section: the full run fits 8 minutes on one H100 with room
# for start-up; --tiny, every section on the shared 2-core CPU in under 4.
# On the H100 of 2026-11-27 (benchmarks/results/accelerator_h100.json) the
# transforms took 37 s, the wires 41 s and the overhead 7 s for 5 steps (it
# has 11 since issue 54: each compiled, read and timed); the frontier is
# mostly compiles (12-70 s per method, against 7-23 s of training for 704
# steps), so it gets what is left.
BUDGETS = {
  False: {
    "backend": 10,
    "transforms": 50,
    "wires": 50,
    "overhead": 60,
    "frontier": 300,
  },
  True: {
    "backend": 10,
    "transforms": 60,
    "wires": 30,
    "overhead": 40,
    "frontier": 100,
  },
}


class Clock:
  """A section's deadline: ``left()`` seconds remain, ``fits(s)`` whether
  ``s`` more seconds do."""

  def __init__(self, seconds: float):
    self.end = time.perf_counter() + seconds

  def left(self) -> float:
    return self.end - time.perf_counter()

  def fits(self, seconds: float) -> bool:
    return self.left() >= seconds


def _error(exc: BaseException) -> str:
  return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _short(text: str, width: int = 100) -> str:
  """The first line of an error, cut to ``width``."""
  line = str(text).strip().splitlines()[0] if str(text).strip() else ""
  return line if len(line) <= width else line[: width - 3] + "..."


def _stacked(tree: Any, device) -> Any:
  return jax.device_put(workload.replicate(tree, R), device)


def _vmapped(tx, params: Any, sync: int | None = None):
  """``(init, step)`` of ``tx`` for ``R`` replicas under ``jax.vmap``:
  ``init(params)`` the state (its axes from ``shardopt.vmap_axes``: counters
  and centers unbatched), ``step(stacked params, state, stacked grads)`` the
  new params and state. ``sync`` (a static int, ``shardopt.due(tx, t)``):
  the host-scheduled program of that value, closed over; None, the in-graph
  schedule."""
  axes = shardopt.vmap_axes(tx, params, AXIS, axis_size=R)
  init = jax.vmap(
    tx.init, in_axes=None, out_axes=axes, axis_name=AXIS, axis_size=R
  )
  extra = {} if sync is None else {"sync": sync}

  def step(p, s, g):
    updates, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, updates), s

  step = jax.vmap(
    step, in_axes=(0, axes, 0), out_axes=(0, axes), axis_name=AXIS
  )
  return jax.jit(init), step


# ------------------------------------------------------------------ backend


def backend(tiny: bool, clock: Clock) -> dict:
  device = jax.devices()[0]
  return {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "jax": jax.__version__,
    "jaxlib": importlib.metadata.version("jaxlib"),
    "devices": len(jax.devices()),
    "cpu_devices": len(jax.devices("cpu")),
    "python": platform.python_version(),
    "optax": optax.__version__,
    "missing": [
      name
      for name in ("sklearn", "matplotlib", "flax", "chex")
      if importlib.util.find_spec(name) is None
    ],
    "tiny": tiny,
  }


# ------------------------------------------------------------------ transforms

TRANSFORM_STEPS = 6


def _adam():
  return optax.adam(1e-2)


TRANSFORMS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "cross_shard(adam)": lambda: shardopt.cross_shard(_adam(), AXIS),
  "tower(adam)": lambda: shardopt.tower(_adam(), AXIS),
  "accumulate(cross_shard(adam), 2)": lambda: shardopt.accumulate(
    shardopt.cross_shard(_adam(), AXIS), 2
  ),
  "apply_if_finite(cross_shard(adam)) [a NaN at step 2]": lambda: (
    shardopt.apply_if_finite(
      shardopt.cross_shard(_adam(), AXIS), 3, axis_name=AXIS
    )
  ),
  "chain(clip_by_global_norm, cross_shard_mean, adam)": lambda: optax.chain(
    shardopt.clip_by_global_norm(1.0),
    shardopt.cross_shard_mean(AXIS),
    _adam(),
  ),
  "chain(powersgd(rank=2), adam)": lambda: optax.chain(
    shardopt.powersgd(AXIS, rank=2), _adam()
  ),
  "local_sgd(sgd, H=2)": lambda: shardopt.local_sgd(
    optax.sgd(0.1, momentum=0.9), AXIS, sync_period=2
  ),
  "agn(adam, T=2)": lambda: shardopt.agn(_adam(), AXIS, sync_period=2),
  "hierarchical_local_sgd(adam, {2: 2, 4: 8})": lambda: (
    shardopt.hierarchical_local_sgd(
      _adam(), AXIS, period_group_sizes={2: 2, 4: 8}
    )
  ),
  "diloco(adam, H=3)": lambda: shardopt.diloco(_adam(), AXIS, sync_period=3),
  "streaming diloco(adam, H=4, F=2)": lambda: shardopt.diloco(
    _adam(), AXIS, sync_period=4, num_fragments=2
  ),
  **{
    f"chain(cross_shard_mean({name}+EF), adam)": (
      lambda dtype=dtype: optax.chain(
        shardopt.cross_shard_mean(AXIS, comm_dtype=dtype, error_feedback=True),
        _adam(),
      )
    )
    for name, dtype in (
      ("int8", jnp.int8),
      ("float8_e4m3fn", jnp.float8_e4m3fn),
      ("int4", jnp.int4),
    )
  },
  "chain(cross_shard_mean(topk 16/1024+EF), adam)": lambda: optax.chain(
    shardopt.cross_shard_mean(
      AXIS, comm_dtype=shardopt.topk(16, chunk_size=1024), error_feedback=True
    ),
    _adam(),
  ),
  "diloco(adam, H=2, int4+EF outer)": lambda: shardopt.diloco(
    _adam(), AXIS, sync_period=2, comm_dtype=jnp.int4, error_feedback=True
  ),
  "chain(decoupled_momentum, sign step)": lambda: optax.chain(
    shardopt.decoupled_momentum(AXIS), optax.scale_by_learning_rate(1e-2)
  ),
}


def _transform_run(tx, params, grads, device) -> np.ndarray:
  init, step = _vmapped(tx, params)
  step = jax.jit(step)
  p = _stacked(params, device)
  state = init(jax.device_put(params, device))
  for g in grads:
    p, state = step(p, state, jax.device_put(g, device))
  return jax.tree.map(np.asarray, p)


def transforms(tiny: bool, clock: Clock) -> dict:
  """Every public transform, ``TRANSFORM_STEPS`` steps of 8 vmapped
  replicas on the default device and on the CPU, the final params
  compared."""
  rng = np.random.default_rng(0)
  params = {
    "w": rng.normal(size=(128, 128)).astype(np.float32),
    "b": rng.normal(size=(128,)).astype(np.float32),
  }
  grads = [
    jax.tree.map(
      lambda x: rng.normal(size=(R,) + x.shape).astype(np.float32), params
    )
    for _ in range(TRANSFORM_STEPS)
  ]
  with_nan = [jax.tree.map(np.copy, g) for g in grads]
  with_nan[1]["w"][3, 0, 0] = np.nan  # step 2, replica 3
  default, cpu = jax.devices()[0], jax.devices("cpu")[0]
  rows, skipped = {}, []
  for name, make in TRANSFORMS.items():
    if not clock.fits(3):
      skipped.append(name)
      continue
    start = time.perf_counter()
    try:
      g = with_nan if "NaN" in name else grads
      with jax.default_matmul_precision("highest"):
        on_device = _transform_run(make(), params, g, default)
        on_cpu = _transform_run(make(), params, g, cpu)
      leaves_d, leaves_c = jax.tree.leaves(on_device), jax.tree.leaves(on_cpu)
      diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves_d, leaves_c, strict=True)
      )
      moved = max(
        float(np.max(np.abs(a[0] - b)))
        for a, b in zip(leaves_d, jax.tree.leaves(params), strict=True)
      )
      spread = max(float(np.max(np.abs(a - a[:1]))) for a in leaves_d)
      rows[name] = {
        "max_abs_diff": diff,
        "moved": moved,
        "replica_spread": spread,
        "finite": bool(all(np.isfinite(a).all() for a in leaves_d)),
        "seconds": time.perf_counter() - start,
      }
    except NotImplementedError as exc:  # a limit of jax.vmap, not shardopt's
      rows[name] = {"unsupported": _error(exc)}
    except Exception as exc:  # noqa: BLE001 (recorded, the section goes on)
      rows[name] = {"error": _error(exc)}
  return {
    "steps": TRANSFORM_STEPS,
    "replicas": R,
    "params": {k: list(v.shape) for k, v in params.items()},
    "against": str(cpu),
    "matmul_precision": "highest",
    "rows": rows,
    "skipped": skipped,
  }


# ------------------------------------------------------------------ wires

WIRES = (
  ("float32", None),
  ("bfloat16", jnp.bfloat16),
  ("int8", jnp.int8),
  ("float8_e4m3fn", jnp.float8_e4m3fn),
  ("int4", jnp.int4),
  ("topk 64/4096", shardopt.topk(64)),
)


def _lm_config(width: int, depth: int, context: int) -> workload.Config:
  return dataclasses.replace(
    workload.FULL,
    width=width,
    depth=depth,
    heads=max(1, width // 64),
    context=context,
  )


def _model_step_seconds(config: workload.Config, batch: int) -> dict:
  """One replica's forward and backward pass of the study's LM."""
  params = jax.device_put(workload.init_params(config, 0))
  windows = jax.device_put(
    np.random.default_rng(0)
    .integers(0, 256, (batch, config.context + 1))
    .astype(np.uint8)
  )
  grad = jax.jit(jax.grad(lambda p, w: workload.loss_fn(p, w, config)))
  start = time.perf_counter()
  jax.block_until_ready(grad(params, windows))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(grad(params, windows))
    times.append(time.perf_counter() - start)
  return {
    "params": workload.count_params(params),
    "batch": batch,
    "context": config.context,
    "seconds": float(np.median(times)),
    "compile_seconds": compile_s,
  }


def wires(tiny: bool, clock: Clock) -> dict:
  n = 4096 * (16 if tiny else 24576)  # per replica: 65k or 100.7M floats
  x = jax.device_put(
    jax.random.normal(jax.random.key(0), (R, n), jnp.float32) * 1e-3
  )
  input_bytes = x.size * 4
  copy = jax.jit(lambda v: v + 1.0)
  candidates, rows, skipped = {"copy (x + 1)": lambda: copy(x)}, {}, []
  for name, dtype in WIRES:
    for ef in (False, True):
      label = name + ("+EF" if ef else "")
      if ef and dtype in (None, jnp.bfloat16):
        continue  # a dense wire takes no error feedback (shardopt refuses)
      if isinstance(dtype, shardopt.wire.TopKSpec) and not ef:
        rows[label] = {"skipped": "a top-k wire needs error feedback"}
        continue
      if not clock.fits(15):
        skipped.append(label)
        continue
      try:
        tx = shardopt.cross_shard_mean(
          AXIS, comm_dtype=dtype, error_feedback=ef
        )
        one = jax.ShapeDtypeStruct((n,), jnp.float32)
        axes = shardopt.vmap_axes(tx, one, AXIS, axis_size=R)
        state = jax.jit(
          jax.vmap(
            tx.init, in_axes=None, out_axes=axes, axis_name=AXIS, axis_size=R
          )
        )(jnp.zeros((n,), jnp.float32))
        update = jax.jit(
          jax.vmap(
            lambda g, s, tx=tx: tx.update(g, s),
            in_axes=(0, axes),
            out_axes=(0, axes),
            axis_name=AXIS,
          ),
          donate_argnums=(1,),
        )
        holder = {"state": state}

        def call(update=update, holder=holder):
          out, holder["state"] = update(x, holder["state"])
          return out

        start = time.perf_counter()
        jax.block_until_ready(call())
        rows[label] = {"compile_seconds": time.perf_counter() - start}
        candidates[label] = call
      except Exception as exc:  # noqa: BLE001
        rows[label] = {"error": _error(exc)}
  timing = compare(candidates, baseline="copy (x + 1)", repeats=7, warmup=1)
  copy_s = timing["candidates"]["copy (x + 1)"]["median_s"]
  copy_gbps = input_bytes / copy_s / 1e9
  model = None
  if clock.fits(45 if not tiny else 10):
    try:
      config = (
        _lm_config(64, 2, 64) if tiny else _lm_config(768, 14, 256)
      )  # 12 x 768^2 x 14 = 99M params
      model = _model_step_seconds(config, 8)
    except Exception as exc:  # noqa: BLE001
      model = {"error": _error(exc)}
  else:
    model = {"skipped": "no time left for the model's step"}
  for label, t in timing["candidates"].items():
    if label == "copy (x + 1)":
      continue
    gbps = input_bytes / t["median_s"] / 1e9
    row = rows[label]
    row.update(
      gbps=gbps,
      seconds=t["median_s"],
      ratio_to_copy=gbps / copy_gbps,
      paired_ratio_to_copy=1 / t["paired_ratio"],
    )
    if model and "seconds" in model:
      wire_s = model["params"] * 4 / (gbps * 1e9)  # one replica's params
      row["share_of_step"] = wire_s / (wire_s + model["seconds"])
  return {
    "replicas": R,
    "floats_per_replica": n,
    "input_bytes": input_bytes,
    "copy_gbps": copy_gbps,
    "copy_seconds": copy_s,
    "model_step": model,
    "rows": rows,
    "skipped": skipped,
    "notes": "gbps: float32 input bytes of all 8 replicas per second of the"
    " vmapped update (encode, the mean over the axis, decode, the error"
    " buffer read and written); ratio_to_copy: that over the copy's gbps of"
    " the same input (x + 1). share_of_step: one replica's wire time for the"
    " model's params at this throughput (its 1/8 of the vmapped work)"
    " against the model's forward and backward pass on this device.",
  }


# ------------------------------------------------------------------ overhead

# The goal of issue 54: a host-scheduled step that syncs nothing costs at
# most this much of the plain optax step.
OVERHEAD_GOAL = 1.02
ADAM = "optax adam"
NEVER = 10**9  # the sync never comes: every timed step is a local one


# name -> the transform (never syncing), each run both ways
SCHEDULED = {
  "local_sgd": lambda: shardopt.local_sgd(
    optax.adam(1e-3), AXIS, sync_period=NEVER
  ),
  "diloco": lambda: shardopt.diloco(optax.adam(1e-3), AXIS, sync_period=NEVER),
  "agn": lambda: shardopt.agn(optax.adam(1e-3), AXIS, sync_period=NEVER),
  "apply_if_finite(local_sgd)": lambda: shardopt.apply_if_finite(
    shardopt.local_sgd(optax.adam(1e-3), AXIS, sync_period=NEVER),
    3,
    axis_name=AXIS,
  ),
}
HOST, IN_GRAPH = "host sync=0", "in-graph non-sync"
AGN_FLOOR = "adam + accumulator add (agn's floor)"
GUARD = "apply_if_finite(adam)"
# What a scheduled transform's step is held to (the goal's denominator):
# Adam; for agn, Adam plus the accumulator add its step must do; for the
# guarded local_sgd, the guard around Adam (its finite check's cost).
FLOORS = {"agn": AGN_FLOOR, "apply_if_finite(local_sgd)": GUARD}


def _overhead_steps() -> dict:
  """name -> ``(transform, sync, vmapped)``: the plain steps (no vmap
  axes of their own: every leaf per replica), then each scheduled
  transform's host ``sync=0`` and in-graph non-sync step side by side."""
  steps = {
    ADAM: (optax.adam(1e-3), None, False),
    AGN_FLOOR: (
      perf_workload.adam_and_accumulator_add(),
      None,
      False,
    ),
    GUARD: (
      shardopt.apply_if_finite(optax.adam(1e-3), 3, axis_name=AXIS),
      None,
      True,
    ),
  }
  for name, make in SCHEDULED.items():
    steps[f"{name}, {HOST}"] = (make(), 0, True)
    steps[f"{name}, {IN_GRAPH}"] = (make(), None, True)
  return steps


def _read(compiled) -> dict:
  """XLA's bytes accessed and the copies of one compiled step."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  text = compiled.as_text()
  copied = hlo.copied_bytes(text)
  return {
    "bytes_accessed": float(cost["bytes accessed"]),
    "copied_bytes": copied["top"],
    "copied_bytes_in_branches": copied["conditional"],
    "conditionals": sum(
      op == "conditional" for op, _ in hlo.instructions(text)
    ),
  }


def overhead(tiny: bool, clock: Clock) -> dict:
  """A step that syncs nothing, host-scheduled (``sync=0``) and in-graph,
  against the plain optax Adam step: interleaved medians, donated, each
  with its compiled step's bytes accessed and copies."""
  n = 1 << (14 if tiny else 22)  # per replica, per leaf
  params = {
    "a": jnp.zeros((n,), jnp.float32),
    "b": jnp.zeros((n // 4, 4), jnp.float32),
  }
  grads = jax.device_put(
    jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(1), (R,) + p.shape), params
    )
  )
  device = jax.devices()[0]
  candidates, rows = {}, {}
  for name, (tx, sync, vmapped) in _overhead_steps().items():
    if not clock.fits(10):
      rows[name] = {"skipped": "no time left"}
      continue
    try:
      if not vmapped:  # plain optax: every leaf of the state per replica
        state = jax.vmap(tx.init)(_stacked(params, device))

        def plain(p, s, g, tx=tx):
          updates, s = tx.update(g, s, p)
          return optax.apply_updates(p, updates), s

        step = jax.jit(jax.vmap(plain), donate_argnums=(0, 1))
      else:
        init, step = _vmapped(tx, params, sync)
        state = init(params)
        step = jax.jit(step, donate_argnums=(0, 1))
      holder = {"p": _stacked(params, device), "s": state}
      rows[name] = _read(step.lower(holder["p"], holder["s"], grads).compile())
      if sync is not None:
        rows[name]["sync"] = sync

      def call(step=step, holder=holder):
        holder["p"], holder["s"] = step(holder["p"], holder["s"], grads)
        return holder["p"]

      jax.block_until_ready(call())
      candidates[name] = call
    except Exception as exc:  # noqa: BLE001
      rows[name] = {"error": _error(exc)}
  if ADAM in candidates and len(candidates) > 1:
    timing = compare(candidates, baseline=ADAM, repeats=9, warmup=1)
    for name, t in timing["candidates"].items():
      rows[name].update(
        seconds=t["median_s"],
        ratio=t["ratio"],
        paired_ratio=t["paired_ratio"],
        iqr_rel=t["iqr_rel"],
      )
    for name, make in SCHEDULED.items():
      host, floor = f"{name}, {HOST}", FLOORS.get(name, ADAM)
      if host in candidates and floor in candidates:
        over = rows[host]["seconds"] / rows[floor]["seconds"]
        rows[host].update(
          floor=floor, ratio_to_floor=over, goal_met=over <= OVERHEAD_GOAL
        )
  return {
    "replicas": R,
    "params_per_replica": int(sum(p.size for p in params.values())),
    "goal": OVERHEAD_GOAL,
    "rows": rows,
    "notes": "ratio: median over optax adam's median, interleaved rounds,"
    " params and state donated; host sync=0: tx.update(..., sync=0), the"
    " program shardopt.due(tx, t) picks for a step that syncs nothing"
    f" (goal: ratio_to_floor <= {OVERHEAD_GOAL}, over optax adam's median,"
    f" agn's over {AGN_FLOOR}'s, the guarded one's over {GUARD}'s);"
    " in-graph: tx.update(...) without sync=,"
    " the schedule's lax.cond in the step. bytes_accessed: XLA's"
    " cost_analysis() of the compiled step; copied_bytes: its copy"
    " instructions outside any conditional (in branches: per branch).",
  }


# ------------------------------------------------------------------ frontier


def _frontier_config(tiny: bool) -> workload.Config:
  if tiny:
    return workload.TINY
  # 12 x 512^2 x 6 = 18.9M in the blocks, 19.1M in all
  return dataclasses.replace(
    workload.FULL,
    context=128,
    width=512,
    depth=6,
    heads=8,
    batch_per_replica=8,
    steps=512,
    eval_every=64,
    learning_rate=1e-3,
    val_windows=256,
  )


def _calibrate(task: workload.Workload, config) -> dict:
  """Seconds per step and per compile of sync on this device (a constant
  learning rate: the real runs compile again with their schedule)."""
  tx = shardopt.cross_shard(optax.adamw(config.learning_rate), AXIS)
  start = time.perf_counter()
  compiled, _ = task.compile(tx)
  compile_s = time.perf_counter() - start
  p, s = task.initial(tx, 0)
  p, s, losses = compiled(p, s, task.shards, jax.random.key(0), jnp.int32(0))
  jax.block_until_ready(losses)  # the first call may still warm up
  start = time.perf_counter()
  p, s, losses = compiled(p, s, task.shards, jax.random.key(0), jnp.int32(0))
  jax.block_until_ready(losses)
  return {
    "step_seconds": (time.perf_counter() - start) / config.eval_every,
    "compile_seconds": compile_s,
  }


def _warm_up(task: workload.Workload, tx, compiled) -> float:
  """One untimed chunk of ``tx``'s compiled steps and one validation, from
  a fresh state (the chunk donates it), so that what a first call pays
  once (buffers, autotuning, the validation's compile) stays out of the
  timed run; returns its seconds."""
  start = time.perf_counter()
  p, s = task.initial(tx, 0)
  p, s, losses = compiled(p, s, task.shards, jax.random.key(0), jnp.int32(0))
  jax.block_until_ready(losses)
  task.validation_bits_per_byte(p)
  return time.perf_counter() - start


def frontier_methods(labels=None) -> list:
  """:func:`benchmarks.methods.frontier`'s methods, or those of them whose
  labels ``labels`` names (``--method``), in the listed order; an unknown
  label is refused with the labels there are."""
  listed = methods.frontier()
  if not labels:
    return listed
  known = [m.label for m in listed]
  unknown = [label for label in labels if label not in known]
  if unknown:
    raise SystemExit(
      f"benchmarks.accelerator --method: no frontier method {unknown};"
      f" the frontier's methods are {known}"
    )
  return [m for m in listed if m.label in labels]


def frontier(
  tiny: bool, clock: Clock, labels=None, steps: int | None = None
) -> dict:
  config = _frontier_config(tiny)
  task = workload.Workload(config, "vmap", R)
  params = workload.init_params(config, 0)
  listed = frontier_methods(labels)
  out: dict = {"replicas": R, "params": workload.count_params(params)}
  if steps is not None:  # --steps: that many, whatever the clock says
    steps -= steps % config.eval_every
    config = dataclasses.replace(config, steps=max(config.eval_every, steps))
    task.config = config
  elif not tiny:  # as many steps as fit, in chunks of eval_every
    cal = _calibrate(task, config)
    out["calibration"] = cal
    per_method = clock.left() / len(listed)
    # compile, bytes (a CPU compile of the update) and evaluation: about
    # 2 compiles of sync; a step with its share of evaluation and slower
    # optimizers (Muon), about 2.5 of sync's calibrated step (on the H100,
    # 2026-11-27: 1.8-3.5 compiles, 0.8-3.5 steps)
    train_s = per_method - 2.0 * cal["compile_seconds"]
    steps = int(train_s / (2.5 * cal["step_seconds"]))
    steps = max(config.eval_every, min(4096, steps))
    steps -= steps % config.eval_every
    config = dataclasses.replace(config, steps=steps)
    task.config = config
  out["config"] = dataclasses.asdict(config)
  cpu = jax.devices("cpu")
  rows, skipped, spent = {}, [], []
  for method in listed:
    estimate = max(spent) if spent else 0.0
    if not clock.fits(estimate):
      skipped.append(method.label)
      continue
    start = time.perf_counter()
    try:
      updates = round(config.steps * method.updates_per_step)
      optimizer = workload.OPTIMIZERS[method.optimizer](config, updates)
      tx, why = methods.build(method, optimizer)
      if tx is None:
        rows[method.label] = {"error": why}
        continue
      compiled, _ = task.compile(tx)
      compile_s = time.perf_counter() - start
      warm_up_s = _warm_up(task, tx, compiled)
      run = task.train(tx, 0, chunk=compiled)
      row = {
        "val_bits_per_byte": run["val_bpb"][-1],
        "val_curve": run["val_bpb"],
        "divergence": run["divergence"],
        "train_seconds": run["seconds"],
        "step_seconds": run["seconds"] / config.steps,
        "compile_seconds": compile_s,
        "warm_up_seconds": warm_up_s,
      }
      row["bytes_per_replica"] = None
      if len(cpu) >= R:
        try:
          measured = workload.update_bytes(
            tx, params, method.schedule, config.steps, devices=cpu[:R]
          )
          row["bytes_per_replica"] = measured["total_bytes"]
          row["bytes_from"] = measured["bytes_from"]
        except Exception as exc:  # noqa: BLE001 (the loss still counts)
          row["bytes_error"] = _error(exc)
      else:
        row["bytes_error"] = f"needs {R} CPU devices, has {len(cpu)}"
      rows[method.label] = row
    except Exception as exc:  # noqa: BLE001
      rows[method.label] = {"error": _error(exc)}
    spent.append(time.perf_counter() - start)
    rows[method.label]["seconds"] = spent[-1]
  out.update(
    rows=rows,
    skipped=skipped,
    notes="val bits/byte of the replica-averaged params after the run, one"
    " seed; bytes one replica sends over the run (ring all-reduce"
    " 2 (g - 1) / g of the buffer, all-gather and all-to-all (g - 1) / g).",
  )
  return out


# ------------------------------------------------------------------ output


def _fmt(x: Any, spec: str = ".3g") -> str:
  if x is None:
    return "-"
  if isinstance(x, float):
    return format(x, spec)
  return str(x)


def table(name: str, section: dict) -> list[str]:
  """A section's printed lines."""
  lines = [f"== {name} ({section.get('seconds', 0):.0f} s)"]
  if "error" in section:
    return lines + [f"  ERROR: {section['error']}"]
  if name == "backend":
    keys = ("platform", "device_kind", "jax", "jaxlib", "devices", "missing")
    return lines + [f"  {k}: {section.get(k)}" for k in keys]

  def rows(columns, cells):
    widths = [
      max(len(str(c)), *(len(r[i]) for r in cells))
      for i, c in enumerate(columns)
    ]
    out = [
      "  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    ]
    out += [
      "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
      for r in cells
    ]
    return out

  def problem(row):
    text = row.get("error") or row.get("unsupported") or row.get("skipped")
    return _short(text) if text else None

  def measured(
    cells, width: int, ready: str | None = None, fallback: str = ""
  ) -> list:
    """``name, *cells(r)`` (``width`` cells) per row; dashes and what went
    wrong where the row has a problem or lacks ``ready``."""
    rows_in = section["rows"]
    return [
      [k]
      + (
        ["-"] * (width - 1) + [problem(r) or fallback]
        if problem(r) or (ready is not None and ready not in r)
        else cells(r)
      )
      for k, r in rows_in.items()
    ]

  if name == "transforms":
    cells = measured(
      lambda r: [
        f"{r['max_abs_diff']:.2e}",
        f"{r['moved']:.3g}",
        f"{r['replica_spread']:.2e}",
        f"{r['seconds']:.1f}",
        "",
      ],
      5,
    )
    lines += rows(
      ["transform", "max_abs_diff vs cpu", "moved", "replica spread", "s", ""],
      cells,
    )
  elif name == "wires":
    model = section["model_step"] or {}
    lines.append(
      f"  copy (x + 1): {section['copy_gbps']:.1f} GB/s of float32 input,"
      f" {section['floats_per_replica']:,} floats x {R} replicas"
    )
    lines.append(
      f"  model step (share's denominator): {model['params']:,} params,"
      f" {model['batch']} x {model['context']} bytes, forward + backward"
      f" {model['seconds'] * 1e3:.2f} ms"
      if "seconds" in model
      else f"  model step: {_short(model.get('error') or model.get('skipped'))}"
    )
    cells = measured(
      lambda r: [
        f"{r['gbps']:.2f}",
        f"{r['ratio_to_copy']:.3f}",
        _fmt(r.get("share_of_step"), ".2%"),
        "",
      ],
      4,
      "gbps",
      "not timed",
    )
    lines += rows(["wire", "gbps", "vs copy", "share of step", ""], cells)
  elif name == "overhead":
    goal = section.get("goal")

    def verdict(r):
      if "goal_met" not in r:
        return ""
      return f"{r['ratio_to_floor']:.3f} x {r['floor']}, goal <= {goal}: " + (
        "met" if r["goal_met"] else "NOT met"
      )

    cells = measured(
      lambda r: [
        f"{r['seconds'] * 1e3:.3f}",
        f"{r['ratio']:.3f}",
        f"{r['bytes_accessed'] / 1e6:,.1f}",
        f"{r['copied_bytes'] / 1e6:,.1f}"
        + (
          f" + branches {sum(r['copied_bytes_in_branches'].values()) / 1e6:,.1f}"
          if r.get("copied_bytes_in_branches")
          else ""
        ),
        verdict(r),
      ],
      6,
      "ratio",
      "not timed",
    )
    lines += rows(
      ["step", "ms", "vs optax adam", "MB accessed", "MB copied", ""], cells
    )
  elif name == "frontier":
    c = section.get("config", {})
    lines.append(
      f"  {section.get('params', 0):,} params, {c.get('steps')} steps,"
      f" {R} vmap replicas"
    )
    cells = measured(
      lambda r: [
        f"{r['val_bits_per_byte']:.3f}",
        _fmt(
          None
          if r["bytes_per_replica"] is None
          else r["bytes_per_replica"] / 1e6,
          ",.3f",
        ),
        f"{r['seconds']:.0f}",
        _short(r.get("bytes_error", "")),
      ],
      4,
    )
    lines += rows(["method", "val bits/byte", "MB per replica", "s", ""], cells)
  if section.get("skipped"):
    lines.append(f"  skipped (no time left): {section['skipped']}")
  return lines


RUNNERS = {
  "backend": backend,
  "transforms": transforms,
  "wires": wires,
  "overhead": overhead,
  "frontier": frontier,
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--tiny", action="store_true", help="toy sizes: minutes on a CPU"
  )
  parser.add_argument(
    "--out", required=True, help="writes DIR/accelerator.json"
  )
  parser.add_argument(
    "--only", action="append", choices=SECTIONS, help="a section (repeatable)"
  )
  parser.add_argument(
    "--scale",
    type=float,
    default=1.0,
    help="multiply every section's time budget by this",
  )
  parser.add_argument(
    "--method",
    action="append",
    default=None,
    metavar="LABEL",
    help="the frontier trains only these of benchmarks.methods.frontier()"
    " (repeatable): one 10-minute call fits about 6 methods at 2,048 steps"
    " of the 19M-param LM on an H100, so the frontier is split across calls"
    " (benchmarks/README.md, 'The accelerator command')",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="the frontier's steps per method, rounded down to a multiple of"
    " its eval_every (64; --tiny: 32), instead of what fits its budget",
  )
  args = parser.parse_args(argv)
  if args.method:
    frontier_methods(args.method)  # an unknown label fails before any run
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "accelerator.json")
  start = time.perf_counter()
  result = {
    **_report.provenance("benchmarks.accelerator", argv),
    "tiny": args.tiny,
    "budgets_s": {k: v * args.scale for k, v in BUDGETS[args.tiny].items()},
    "sections": {},
  }
  for name in args.only or SECTIONS:
    t0 = time.perf_counter()
    clock = Clock(BUDGETS[args.tiny][name] * args.scale)
    try:
      extra = (
        {"labels": args.method, "steps": args.steps}
        if name == "frontier"
        else {}
      )
      section = RUNNERS[name](args.tiny, clock, **extra)
    except Exception as exc:  # noqa: BLE001 (recorded; the next one runs)
      section = {"error": _error(exc), "traceback": traceback.format_exc()}
    section["seconds"] = time.perf_counter() - t0
    result["sections"][name] = section
    result["seconds"] = time.perf_counter() - start
    with open(path, "w") as f:
      json.dump(result, f, indent=1, default=str)
    print("\n".join(table(name, section)), flush=True)
  print(f"[accelerator] {result['seconds']:.0f} s in all; wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
