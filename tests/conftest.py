"""Test-wide setup: jaxtyping shape annotations are checked at run time (beartype) for the
device-side modules imported during the tests, so a wrong shape fails loudly here."""

import ctypes
import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Compiled programs persist between test runs in the library's own cache folder
# (paged_jax/compile_cache.py); a cold cache only costs compile time.
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tests check behaviour, and most of their time is XLA compiling the many step shapes they
# meet: tests/xla_flags.py's flags compile them about a third faster. Set XLA_FLAGS to
# override.
from tests.xla_flags import FAST_COMPILE_FLAGS  # noqa: E402

os.environ.setdefault("XLA_FLAGS", FAST_COMPILE_FLAGS)
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
    "paged_jax.engine.settle", "paged_jax.engine.state", "paged_jax.engine.step_types",
    "paged_jax.engine.draft", "paged_jax.nn",
    "kernels",
]
install_import_hook(CHECKED, "beartype.beartype")


import pytest  # noqa: E402

from paged_jax.compile_cache import relieve_jit_mappings  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _bounded_jit_mappings():
    """Each xdist worker runs many modules in one process; compiled programs pile up until
    LLVM runs out of memory mappings (see compile_cache.relieve_jit_mappings), and memory
    freed by a module stays with the process (`_return_freed_memory`)."""
    yield
    relieve_jit_mappings(fraction=0.3)
    _return_freed_memory()


def _return_freed_memory() -> None:
    """glibc keeps what Python, numpy and XLA free in its arenas: a slow-tier worker that had
    run the real models held 8-10 GB it no longer used, and beside a notebook's kernel the
    machine reached 21.8 of 24 GB (a CI run here). malloc_trim hands that memory back (a
    0.5B model's 2.7 GB after `del` fell to 0.5 GB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


# Two tiers. `make test` (what a newcomer runs: `-m "not slow"`) checks every layer on tiny
# models; `make test-slow` (`-m slow`) runs what costs minutes: the real models against
# transformers, the engine on the Pallas kernels in the interpreter, the notebooks, the
# experiment scripts, several devices or processes, and the routed server. CI runs both
# (.ci/run). A feature keeps one check in the fast tier (TP at 2 devices, the CUDA lowering of
# the engine's programs, notebooks committed clean). Modules may also mark tests themselves.
SLOW_MODULES = {
    "test_models_gemma3.py", "test_models_smollm2.py", "test_engine_gemma3.py",
    "test_experiments.py", "test_shared_prefix_experiment.py", "test_bench_serving.py",
    "test_serve_routed.py", "test_nn_smollm2.py",
}
SLOW_TESTS = {
    "test_hybrid_state_machine.py": {"test_ten_thousand_operations"},
    "test_engine_hybrid_kv.py": {"test_forced_preemption_loses_nothing",
                                 "test_parallel_sampling_beams_and_speculation_match_one_group"},
    "test_engine_pallas.py": {"test_windows_mixed_steps_chunked_prefill_and_forks",
                              "test_prefix_cache_hits", "test_preemption",
                              "test_quantized_caches", "test_beam_search"},
    "test_notebooks.py": {"test_notebook_runs"},
    "test_tensor_parallel.py": {"test_preemption_under_tensor_parallelism",
                                "test_data_parallel_replicas_share_the_work",
                                "test_tokens_match_one_device[4]"},
    "test_routing.py": {"test_build_labels_features_and_saves"},
    "test_routing_balance.py": {"test_replicas_serve_every_request"},
    "test_allocator_state_machine.py": {"TestDeepAllocatorMachine",
                                        "TestDeepAllocatorMachineBfloat16",
                                        "TestDeepAllocatorMachineInt8",
                                        "TestDeepAllocatorMachineFp8"},
    "test_kernel_properties.py": {"test_ragged_kernel_matches_reference_deep",
                                  "test_decode_kernel_matches_reference_deep"},
    "test_cpu_attention.py": {"test_quantized_pages_match_the_reference_deep"},
    "test_async_scheduling.py": {"test_preemption_gives_the_same_tokens[swap]"},
    "test_kv_quant_engine.py": {"test_int8_reference_backend_gives_the_same_tokens"},
    "test_speculative.py": {"test_sampled_distribution_matches_plain_decoding_chi_square",
                            "test_seeded_sampling_stop_strings_and_max_tokens_are_identical",
                            "test_preemption_in_the_middle_of_speculation"},
    "test_engine_moe.py": {"test_expert_parallel_gives_one_devices_tokens[0-4]",
                           "test_expert_parallel_gives_one_devices_tokens[64-4]",
                           "test_speculation_and_pallas_attention_give_the_same_tokens"},
    "test_lora_engine.py": {
        "test_no_program_is_built_after_warm_up_as_the_adapter_mix_changes"},
    "test_gpu_bench.py": {"test_engine_section_and_outputs",
                          "test_runs_with_only_jax_numpy_and_jaxtyping"},
}


# Tests that hold a real model twice (ours and transformers', 3-8 GB each for the 0.5B and
# 1.5B in fp32) run on one xdist worker, one at a time: two at once on the two workers took a
# 24 GB machine out of memory, a worker was killed and xdist's scheduler then hung until CI's
# time ran out. (Their modules' own groups are replaced by this one.)
ONE_BIG_MODEL_AT_A_TIME = {
    "test_models_qwen.py", "test_models_gemma3.py", "test_models_smollm2.py",
    "test_nn_smollm2.py",
    "test_experiments.py::test_bench_puts_every_side_on_the_same_rows",
    # its pool child held 7.5 GB; beside a big model's test a worker was OOM-killed in CI
    "test_experiments.py::test_weight_quantization_reports_every_side_and_target",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        names = {item.name, item.originalname, item.parent.name}  # parent: a test class
        if module in SLOW_MODULES or names & SLOW_TESTS.get(module, set()):
            item.add_marker(pytest.mark.slow)
        if {module, f"{module}::{item.name}"} & ONE_BIG_MODEL_AT_A_TIME:
            item.add_marker(pytest.mark.xdist_group("big_models"))
