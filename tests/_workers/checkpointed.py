"""The checkpointed training loop both restart workers run (orbax).

``train_with_checkpoints.py`` (one process) and ``train_across_processes.py``
(two) train every :class:`tiny_training.Run` side by side on the same batches
and save ``{"step", "data_position", "models"}`` every few steps; a restart
restores the latest complete checkpoint and continues.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from _workers import tiny_training


def fresh_tree(runs: dict) -> dict:
  """Step 0: every run's initial params and state, the first data position."""
  models = {}
  for name, run in runs.items():
    params, state = run.start()
    models[name] = {"params": params, "state": state}
  return {
    "step": np.zeros([], np.int32),
    "data_position": tiny_training.initial_data_position(),
    "models": models,
  }


def open_or_restore(ckpt_dir: str, runs: dict, prefix: str = ""):
  """``(manager, tree, latest step or None)``: restored, or fresh."""
  manager = ocp.CheckpointManager(
    os.path.abspath(ckpt_dir),
    options=ocp.CheckpointManagerOptions(max_to_keep=2),
  )
  tree = fresh_tree(runs)
  latest = manager.latest_step()
  if latest is None:
    print(f"{prefix}fresh start", flush=True)
  else:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    tree = manager.restore(latest, args=ocp.args.StandardRestore(target))
    assert int(tree["step"]) == latest, (int(tree["step"]), latest)
    print(
      f"{prefix}restored step {latest} data position"
      f" {np.asarray(tree['data_position']).tolist()}",
      flush=True,
    )
  return manager, tree, latest


def advance_all(runs: dict, models: dict, batch, block: bool = False) -> None:
  """One step of every run on ``batch``, in place in ``models``."""
  for name, run in runs.items():
    params, state = run.advance(
      models[name]["params"], models[name]["state"], batch
    )
    model = {"params": params, "state": state}
    models[name] = jax.block_until_ready(model) if block else model


def save(manager, step: int, position, models: dict) -> None:
  manager.save(
    step,
    args=ocp.args.StandardSave(
      {
        "step": np.asarray(step, np.int32),
        "data_position": position,
        "models": models,
      }
    ),
  )


def final_params(models: dict) -> dict:
  """``{"<run>/<leaf>": host array}`` of every run's params, for ``np.savez``."""
  return {
    f"{name}/{key}": value
    for name, model in models.items()
    for key, value in tiny_training.fetch(model["params"]).items()
  }
