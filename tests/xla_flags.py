"""XLA:CPU flags for the test suite, which compiles far more than it computes: LLVM at -O0 and
XLA's older elemental emitters compile an engine step about a third faster than the defaults
(experiments/test_times.py measures it). Programs run slower; benchmarks and users keep the
defaults. No imports here: tests/conftest.py sets these before JAX starts."""

FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                      "--xla_llvm_disable_expensive_passes=true")
