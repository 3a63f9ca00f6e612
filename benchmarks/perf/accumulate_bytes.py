"""Bytes per mini-step: ``accumulate(cross_shard(adam), k)`` vs ``cross_shard``.

Both steps are compiled under ``pmap`` (8 replicas, every replica its own
gradient) and their HLO read by :mod:`shardopt.measure.hlo`. ``cross_shard``
all-reduces the gradient on every step (``top``); ``accumulate`` only inside
the emit branch of its ``lax.cond`` (``conditional``), which runs once every
``k`` mini-steps. Bytes per mini-step = ``top + conditional / k``, in
all-reduce-equivalent bytes.

Run: ``python -m benchmarks.perf.accumulate_bytes`` (prints one row per size/k).
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported
  from benchmarks._xla_flags import force_cpu_devices

  force_cpu_devices(quick=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import shardopt  # noqa: E402
from shardopt.measure import hlo  # noqa: E402

AXIS = "batch"


def _step_bytes(tx, size: int, n: int) -> dict:
  """All-reduce-equivalent bytes of one compiled step, by context."""

  def step(w, state, g):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  w = jnp.zeros([n, size], jnp.float32)
  state = jax.pmap(tx.init, axis_name=AXIS)(w)
  text = jax.pmap(step, axis_name=AXIS).lower(w, state, w).compile().as_text()
  return hlo.summarize(hlo.compiled_collectives(text, num_devices=n))[
    "allreduce_equivalent_bytes"
  ]


def bytes_per_mini_step(sizes=(1 << 20,), ks=(1, 4, 16)) -> list[dict]:
  """One row per (params size, k): bytes per step of both transforms."""
  n = jax.device_count()
  rows = []
  for size in sizes:
    plain = _step_bytes(shardopt.cross_shard(optax.adam(1e-3), AXIS), size, n)
    per_step = plain.get("top", 0) + plain.get("conditional", 0)
    for k in ks:
      acc = _step_bytes(
        shardopt.accumulate(shardopt.cross_shard(optax.adam(1e-3), AXIS), k),
        size,
        n,
      )
      rows.append(
        dict(
          param_bytes=4 * size,
          k=k,
          cross_shard_bytes_per_step=per_step,
          accumulate_top_bytes=acc.get("top", 0),
          accumulate_emit_bytes=acc.get("conditional", 0),
          accumulate_bytes_per_mini_step=(
            acc.get("top", 0) + acc.get("conditional", 0) / k
          ),
        )
      )
  return rows


def main(argv=None) -> int:
  import argparse  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.perf.accumulate_bytes",
    description=__doc__.split("\n\n")[0],
  )
  parser.parse_args(argv)
  for row in bytes_per_mini_step():
    print(row)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
