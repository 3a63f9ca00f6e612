"""Test setup: 8 forced CPU devices, set before jax is imported anywhere."""

import os

# The collective timeouts are raised from XLA CPU's defaults: on a loaded 2-core
# machine, 8 device threads can take longer than the default to all reach a
# rendezvous, and XLA then aborts the process instead of waiting.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  " --xla_cpu_collective_timeout_seconds=900"
  " --xla_cpu_collective_call_terminate_timeout_seconds=900"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Registers the hypothesis profiles "ci" (default) and "thorough" and loads
# the one named by $HYPOTHESIS_PROFILE.
import _hypothesis_profiles  # noqa: E402,F401
import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_configure(config):
  """With $FUZZ_REPORT=PATH, writes a per-property hypothesis table there."""
  path = os.environ.get("FUZZ_REPORT")
  if path:
    import _fuzz_report

    config.pluginmanager.register(
      _fuzz_report.FuzzReport(path), "shardopt_fuzz_report"
    )


@pytest.fixture(scope="session")
def mesh():
  """A 1-D mesh named "batch" over the 8 CPU devices."""
  assert jax.device_count() == 8, jax.devices()
  return jax.make_mesh((8,), ("batch",))
