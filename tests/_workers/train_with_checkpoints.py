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

  import numpy as np

  from _workers import checkpointed
  from _workers import tiny_training

  mesh = tiny_training.make_mesh()
  runs = {
    name: tiny_training.Run(name, mesh) for name in tiny_training.TRANSFORMS
  }

  manager, tree, _ = checkpointed.open_or_restore(args.ckpt_dir, runs)

  step = int(tree["step"])
  position = np.asarray(tree["data_position"])
  models = tree["models"]
  while step < args.steps:
    batch, position = tiny_training.next_batch(position)
    checkpointed.advance_all(runs, models, batch)
    step += 1
    if step % args.every == 0:
      checkpointed.save(manager, step, position, models)
    print(f"step {step}", flush=True)
    if args.step_delay:
      time.sleep(args.step_delay)
  manager.wait_until_finished()
  manager.close()
  final = checkpointed.final_params(models)
  np.savez(args.out, **final)
  print("done", flush=True)


if __name__ == "__main__":
  main()
