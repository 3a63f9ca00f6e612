"""XLA flags every benchmark script sets before JAX starts (no jax import here).

:func:`force_cpu_devices` must run before the first ``import jax`` of the
process: JAX reads ``XLA_FLAGS`` when its backends start.
"""

from __future__ import annotations

import os


def force_cpu_devices(quick: bool, count: int = 8) -> None:
  """Asks the CPU backend for ``count`` devices, long collective timeouts,
  and (``quick``) fast compiles; each flag only where ``XLA_FLAGS`` does not
  set it already. Also pins ``JAX_PLATFORMS=cpu`` unless set."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flags += f" --xla_force_host_platform_device_count={count}"
  if "xla_cpu_collective_timeout_seconds" not in flags:
    # As in tests/conftest.py: on a loaded 2-core machine 8 device threads
    # can take longer than XLA CPU's default to all reach a rendezvous, and
    # XLA then aborts the process instead of waiting.
    flags += (
      " --xla_cpu_collective_timeout_seconds=900"
      " --xla_cpu_collective_call_terminate_timeout_seconds=900"
    )
  if quick and "xla_backend_optimization_level" not in flags:
    # A smoke run checks that a script runs, not how fast: compile faster.
    flags += " --xla_backend_optimization_level=0"
  os.environ["XLA_FLAGS"] = flags.strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
