"""A training run that checkpoints with orbax and resumes where it stopped.

Started (and SIGKILLed, and started again) by ``tests/test_restart.py``:

  python train_with_checkpoints.py --ckpt-dir DIR --steps N --every K \
      --out FILE.npz [--step-delay SECONDS]

It trains every transform of ``tiny_training.TRANSFORMS`` side by side, one
step each per global step, on 8 CPU devices. Every K steps it saves, with an
orbax ``CheckpointManager``, everything a resumed run needs: each transform's
params and optimizer state, the step and the data position. On start it
restores the latest complete checkpoint, if any. After each step it prints
``step S`` (the test kills it on one of these lines); at the end it writes the
final params of every transform to FILE.npz and prints ``done``.
"""

import argparse
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--ckpt-dir", required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--every", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument(
    "--step-delay",
    type=float,
    default=0.0,
    help="seconds to sleep after each step (a slower model)",
  )
  args = parser.parse_args()

  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from _workers import tiny_training

  mesh = tiny_training.make_mesh()
  runs = {
    name: tiny_training.Run(name, mesh) for name in tiny_training.TRANSFORMS
  }

  def fresh():
    models = {}
    for name, run in runs.items():
      params, state = run.start()
      models[name] = {"params": params, "state": state}
    return {
      "step": np.zeros([], np.int32),
      "data_position": tiny_training.initial_data_position(),
      "models": models,
    }

  manager = ocp.CheckpointManager(
    os.path.abspath(args.ckpt_dir),
    options=ocp.CheckpointManagerOptions(max_to_keep=2),
  )
  tree = fresh()
  latest = manager.latest_step()
  if latest is None:
    print("fresh start", flush=True)
  else:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    tree = manager.restore(latest, args=ocp.args.StandardRestore(target))
    assert int(tree["step"]) == latest, (int(tree["step"]), latest)
    print(
      f"restored step {latest} data position"
      f" {np.asarray(tree['data_position']).tolist()}",
      flush=True,
    )

  step = int(tree["step"])
  position = np.asarray(tree["data_position"])
  models = tree["models"]
  while step < args.steps:
    batch, position = tiny_training.next_batch(position)
    for name, run in runs.items():
      params, state = run.advance(
        models[name]["params"], models[name]["state"], batch
      )
      models[name] = {"params": params, "state": state}
    step += 1
    if step % args.every == 0:
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
    print(f"step {step}", flush=True)
    if args.step_delay:
      time.sleep(args.step_delay)
  manager.wait_until_finished()
  manager.close()
  final = {
    f"{name}/{key}": value
    for name, model in models.items()
    for key, value in tiny_training.fetch(model["params"]).items()
  }
  np.savez(args.out, **final)
  print("done", flush=True)


if __name__ == "__main__":
  main()
