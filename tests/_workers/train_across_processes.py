"""One process of a 2 x 4-device training run that checkpoints and resumes.

Started (SIGKILLed, and started again) by ``tests/test_process_faults.py``:

  python train_across_processes.py --process-id I --num-processes 2 \
      --port PORT --ckpt-dir DIR --steps N --every K --out FILE.npz \
      [--step-delay S] [--heartbeat-timeout S] [--watchdog S] [--hang-at S]

It joins the coordinator on 127.0.0.1:PORT (``jax.distributed``, CPU
collectives through gloo), builds the global 8-device mesh and trains every
transform of ``tiny_training.available_fault_transforms()`` side by side.
Every K steps it saves params, optimizer states, step and data position with
an orbax ``CheckpointManager`` (both processes take part; each writes its own
shards); on start it restores the latest complete checkpoint, if any. After
each step it prints ``step S``; at the end process 0 writes the final params
of all 8 replicas to FILE.npz, and each process prints ``done``.

When the other process dies, this one must not hang. Two mechanisms bound
the time, whichever fires first:

* JAX's coordination service: ``jax.distributed.initialize(...,
  heartbeat_timeout_seconds=H)``. A process that sends no heartbeat for H
  seconds is declared dead, and the service then terminates the survivors;
  a survivor that loses the coordinator (process 0) stops the same way.
  A collective whose peer closed its gloo connection fails at once.
* A watchdog thread: if no step completes for ``--watchdog`` seconds, it
  prints ``WATCHDOG: ...`` and exits the process with code 4. This covers a
  wait no timeout of the runtime reaches: a peer that is alive (its
  heartbeats keep coming) but never enters the next collective, or a
  collective stuck inside XLA. ``--hang-at S`` makes this process such a
  peer after step S (the test of the watchdog uses it).

Exit codes: 0 done; 1 an exception (printed, with ``FAILED:`` first); 3 the
platform cannot run it (``SKIP:``); 4 the watchdog fired; anything else, the
runtime ended the process.
"""

import argparse
import os
import sys
import threading
import time
import traceback

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SKIP = 3
WATCHDOG = 4


class Watchdog:
  """Exits the process if ``progress`` is not called for ``timeout_s``."""

  def __init__(self, timeout_s: float, name: str):
    self.timeout_s = timeout_s
    self.name = name
    self.what = "starting"
    self.last = time.monotonic()
    threading.Thread(target=self._watch, daemon=True).start()

  def progress(self, what: str) -> None:
    self.what = what
    self.last = time.monotonic()

  def _watch(self) -> None:
    while True:
      time.sleep(0.25)
      idle = time.monotonic() - self.last
      if idle > self.timeout_s:
        print(
          f"WATCHDOG: {self.name} made no progress for {idle:.0f}s"
          f" (last: {self.what}); the other process is gone or a"
          f" collective hangs; exiting with code {WATCHDOG}",
          flush=True,
        )
        os._exit(WATCHDOG)


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--ckpt-dir", required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--every", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--step-delay", type=float, default=0.0)
  parser.add_argument("--heartbeat-timeout", type=int, default=10)
  parser.add_argument("--watchdog", type=float, default=60.0)
  parser.add_argument(
    "--hang-at",
    type=int,
    default=0,
    help="fault injection: after step S, stop taking part"
    " (sleep forever) while the process stays alive",
  )
  args = parser.parse_args()
  name = f"process {args.process_id}"
  # Set before the runtime starts: startup (imports, connecting, the first
  # compilations) counts as progress too, so a peer that never arrives is
  # caught as well.
  watchdog = Watchdog(args.watchdog, name)

  import jax  # after XLA_FLAGS

  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except Exception as e:  # an older or newer jax without gloo
    print(
      f"SKIP: CPU collectives through gloo are unavailable: {e!r}", flush=True
    )
    return SKIP
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
    heartbeat_timeout_seconds=args.heartbeat_timeout,
    shutdown_timeout_seconds=args.heartbeat_timeout,
  )
  watchdog.progress("joined")

  import numpy as np

  from _workers import checkpointed
  from _workers import tiny_training

  names, missing = tiny_training.available_fault_transforms()
  print(
    f"{name}/{jax.process_count()}: {jax.local_device_count()} local"
    f" devices of {jax.device_count()}; training {names};"
    f" missing {missing}",
    flush=True,
  )
  mesh = tiny_training.make_mesh()
  local = sorted(
    i
    for i, d in enumerate(mesh.devices.flat)
    if d.process_index == jax.process_index()
  )
  print(f"{name}: mesh positions {local}", flush=True)
  runs = {n: tiny_training.Run(n, mesh) for n in names}

  manager, tree, latest = checkpointed.open_or_restore(
    args.ckpt_dir, runs, prefix=f"{name}: "
  )
  watchdog.progress("restored" if latest else "initialized")

  step = int(tree["step"])
  position = np.asarray(tree["data_position"])
  models = tree["models"]
  while step < args.steps:
    batch, position = tiny_training.next_batch(position)
    checkpointed.advance_all(runs, models, batch, block=True)
    step += 1
    if step % args.every == 0:
      checkpointed.save(manager, step, position, models)
    watchdog.progress(f"step {step}")
    print(f"step {step}", flush=True)
    if step == args.hang_at:
      print(f"{name}: hanging after step {step}", flush=True)
      threading.Event().wait()  # alive, heartbeating, never calls again
    if args.step_delay:
      time.sleep(args.step_delay)
  manager.wait_until_finished()
  manager.close()
  final = checkpointed.final_params(models)
  if jax.process_index() == 0:
    np.savez(args.out, **final)
  watchdog.progress("finished")
  print("done", flush=True)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  try:
    code = main()
  except BaseException as e:  # noqa: BLE001 -- report, then exit without hanging
    print(f"FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # skip atexit hooks: a half-initialized runtime can block them
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
