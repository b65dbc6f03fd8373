"""Test-wide setup: jaxtyping shape annotations are checked at run time (beartype) for the
device-side modules imported during the tests, so a wrong shape fails loudly here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Compiled programs persist between test runs in the library's own cache folder
# (paged_jax/compile_cache.py); a cold cache only costs compile time.
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tests check behaviour, and most of their time is XLA compiling the many step shapes they
# meet (the decoder is unrolled): LLVM's -O0 compiles them about 40% faster. Benchmarks and
# users keep the default; set XLA_FLAGS to override.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# Four fake CPU devices for the tensor-parallel tests (test_tensor_parallel.py); programs
# that use no mesh still run on device 0 alone.
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

from jaxtyping import install_import_hook  # noqa: E402

# Device-side modules only: the user-facing API (SamplingParams, LLM) raises its own ValueErrors
# naming the bad field, which a type checker in front of it would pre-empt.
CHECKED = [
    "paged_jax.cache.pool", "paged_jax.cache.page_table", "paged_jax.cache.kv_cache",
    "paged_jax.models", "paged_jax.sample", "paged_jax.engine.step", "paged_jax.engine.window",
    "paged_jax.engine.settle", "paged_jax.engine.state",
    "kernels",
]
install_import_hook(CHECKED, "beartype.beartype")


import pytest  # noqa: E402

from paged_jax.compile_cache import relieve_jit_mappings  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _bounded_jit_mappings():
    """Each xdist worker runs many modules in one process; compiled programs pile up until
    LLVM runs out of memory mappings (see compile_cache.relieve_jit_mappings)."""
    yield
    relieve_jit_mappings(fraction=0.3)
