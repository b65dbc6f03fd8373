"""XLA:CPU flags for the test suite, which compiles far more than it computes: LLVM at -O0 and
XLA's older elemental emitters compile an engine step about a third faster than the defaults
(experiments/test_times.py measures it). Programs run slower; benchmarks and users keep the
defaults. No JAX import here: tests/conftest.py sets these before JAX starts."""

from importlib.metadata import PackageNotFoundError, version


def _jaxlib_minor() -> tuple[int, int]:
    try:
        return tuple(int(x) for x in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0, 0)


# XLA aborts the process on a flag it does not know: the elemental-emitter switch is gone
# from jaxlib 0.11's XLA:CPU (the GPU machine's JAX), so it is passed to 0.10 only.
FAST_COMPILE_FLAGS = " ".join(
    ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    + (["--xla_cpu_use_fusion_emitters=false"] if _jaxlib_minor() < (0, 11) else []))
