"""Test set-up: float64, full-precision matmuls, hypothesis profiles, one run per platform."""

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)
# GPUs with TF32 would otherwise round float32 matmuls (the operator's and
# the oracle's) to about 3 decimal digits; the tests check full precision.
jax.config.update("jax_default_matmul_precision", "highest")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _platform_device(platform):
    try:
        return jax.devices(platform)[0]
    except RuntimeError:
        return None


@pytest.fixture(params=["cpu", "gpu"], autouse=True)
def device(request):
    """Run every test once per platform JAX sees, with that platform's first device as default."""
    dev = _platform_device(request.param)
    if dev is None:
        pytest.skip(f"no {request.param} device visible to JAX")
    with jax.default_device(dev):
        yield dev
