"""Test set-up: float64, full-precision matmuls, cheap CPU code generation, hypothesis profiles, one run per
platform JAX sees (CPU, GPU, TPU)."""

import contextlib
import inspect
import os

import jax
import pytest
from hypothesis import HealthCheck, settings

import lazy_kernel

jax.config.update("jax_enable_x64", True)
# Accelerators would otherwise round the oracles' float32 matmuls (TF32 on a GPU, bf16 on a TPU) to about 3
# decimal digits. The operator's own contraction is float32 without it: tests of that unset it.
jax.config.update("jax_default_matmul_precision", "highest")


# Most of the suite's time is XLA compiling for the CPU. At its cheapest code generation (no LLVM optimisation, the
# older fusion emitters, LLVM modules compiled whole) a compile takes about a third of the time. XLA's temporaries
# and rounding can differ there, so a program compiled with options of its own (LazyKernel's measurements) keeps
# them, and the tests whose claims are about the programs users compile (the accuracy contract, XLA's temporaries)
# compile in ``as_users_compile()``.
CHEAPEST_CPU_CODEGEN = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,  # XLA from jaxlib 0.5.3 on; older XLA rejects it
    "xla_cpu_parallel_codegen_split_count": 1,  # where XLA has it; splitting to compile in parallel cost more
}
_cheap_cpu_options = {}  # the options of CHEAPEST_CPU_CODEGEN this XLA takes; none inside as_users_compile()


def _cheap_on_cpu(get_compile_options):
    """JAX's ``get_compile_options``, with the cheap options for CPU programs compiled without options of their own."""

    def cheap(*args, env_options_overrides=None, backend=None, **kwargs):
        if not env_options_overrides and backend is not None and backend.platform == "cpu":
            env_options_overrides = _cheap_cpu_options
        return get_compile_options(*args, env_options_overrides=env_options_overrides, backend=backend, **kwargs)

    return cheap


@contextlib.contextmanager
def as_users_compile():
    """Programs compiled inside compile with JAX's default options, as users' do."""
    cheap = dict(_cheap_cpu_options)
    _cheap_cpu_options.clear()
    try:
        yield
    finally:
        _cheap_cpu_options.update(cheap)


_get_compile_options = getattr(jax._src.compiler, "get_compile_options", None)  # JAX's own: checked before use
_parameters = inspect.signature(_get_compile_options).parameters if _get_compile_options else {}
if {"env_options_overrides", "backend"} <= set(_parameters):
    known = {name: v for name, v in CHEAPEST_CPU_CODEGEN.items() if lazy_kernel._known_to_xla("cpu", name, v)}
    _cheap_cpu_options.update(known)
    jax._src.compiler.get_compile_options = _cheap_on_cpu(_get_compile_options)

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _platform_device(platform):
    try:
        return jax.devices(platform)[0]
    except RuntimeError:
        return None


PLATFORM_DEVICES = {p: d for p in ("cpu", "gpu", "tpu") if (d := _platform_device(p)) is not None}


def clear_caches():
    """Forget every traced program, plan, measured peak and block: what was made before a patch cannot serve after."""
    jax.clear_caches()
    for cache in (lazy_kernel._PLANS, getattr(lazy_kernel, "_PEAKS", {}), getattr(lazy_kernel, "_BLOCKS", {})):
        cache.clear()


class CacheClearingMonkeyPatch(pytest.MonkeyPatch):
    """pytest's monkeypatch, clearing the caches after each patch and after the undo: a patched function or setting
    never meets a program traced without it, nor a later test one traced with it, whatever order tests run in."""

    def setattr(self, *args, **kwargs):
        super().setattr(*args, **kwargs)
        clear_caches()

    def undo(self):
        super().undo()
        clear_caches()


@pytest.fixture
def monkeypatch():
    patch = CacheClearingMonkeyPatch()
    yield patch
    patch.undo()


@pytest.fixture(params=sorted(PLATFORM_DEVICES), autouse=True)
def device(request):
    """Run every test once per platform JAX sees (its id: ``-k tpu`` selects a TPU's runs), with that platform's
    first device as default."""
    with jax.default_device(PLATFORM_DEVICES[request.param]):
        yield PLATFORM_DEVICES[request.param]
