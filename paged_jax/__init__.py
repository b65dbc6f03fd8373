"""paged-jax: vLLM's PagedAttention as pure-functional JAX pytrees and Pallas kernels."""

from paged_jax import compile_cache
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.kv_cache import KVCache, copy_blocks, init_kv_cache, write
from paged_jax.cache.page_table import (
    PageTable,
    add_sequence,
    cache_positions,
    fork,
    init_page_table,
    release,
    reserve_tokens,
)
from paged_jax.cache.pool import BlockPool, allocate, decref, incref, init_pool
from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

compile_cache.enable()  # importing compiles nothing; the first step will find the cache


def __getattr__(name: str):
    """`LLM` is imported on first use: it brings the tokenizer and progress-bar libraries,
    which the engine alone (experiments/gpu_bench.py on a bare GPU machine) does without."""
    if name == "LLM":
        from paged_jax.llm import LLM

        return LLM
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")

__all__ = [
    "LLM", "BeamSearchParams", "CompletionOutput", "RequestOutput", "SamplingParams",
    "BlockPool", "CacheConfig", "KVCache", "PageTable", "add_sequence", "allocate",
    "copy_blocks", "decref", "fork", "incref", "init_kv_cache", "init_page_table", "init_pool",
    "release", "reserve_tokens", "cache_positions", "write",
]
