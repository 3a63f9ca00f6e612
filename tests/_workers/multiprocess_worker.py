"""One process of a 2-process x 4-device run on JAX's distributed runtime.

Started by ``tests/test_multiprocess.py``:

  python multiprocess_worker.py --process-id I --num-processes 2 \
      --port PORT --steps N --out DIR

It joins the coordinator on 127.0.0.1:PORT, builds the global 8-device mesh
(4 devices here, 4 in the other process, CPU collectives through gloo), runs
every transform of ``tiny_training.TRANSFORMS`` for N steps, and writes the
final params of all 8 replicas to DIR/params.npz (process 0 only).

Exit codes: 0 done, 1 failed, 3 the platform cannot run it (the reason is
printed on a line starting with "SKIP:").
"""

import argparse
import os
import sys
import time
import traceback

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SKIP = 3


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  started = time.perf_counter()

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
  )

  import numpy as np

  from _workers import tiny_training

  print(
    f"process {jax.process_index()}/{jax.process_count()}:"
    f" {jax.local_device_count()} local devices of {jax.device_count()}",
    flush=True,
  )
  mesh = tiny_training.make_mesh()
  results = {}
  for name in tiny_training.TRANSFORMS:
    params = tiny_training.train(name, mesh, args.steps)
    for key, value in params.items():
      results[f"{name}/{key}"] = value
  if jax.process_index() == 0:
    np.savez(os.path.join(args.out, "params.npz"), **results)
  print(
    f"process {jax.process_index()} done in"
    f" {time.perf_counter() - started:.1f}s",
    flush=True,
  )
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  try:
    code = main()
  except BaseException:  # noqa: BLE001 -- report, then exit without hanging
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # skip atexit hooks: a half-initialized runtime can block them
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
