"""Test setup: 8 forced CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def mesh():
  """A 1-D mesh named "batch" over the 8 CPU devices."""
  assert jax.device_count() == 8, jax.devices()
  return jax.make_mesh((8,), ("batch",))
