"""The engine on an int8 / fp8 KV cache: scales travel with their values through writes,
copy-on-write copies, swap out / in and prefix-cache hits, so every engine invariant holds,
and greedy tokens stay close to the float32 cache's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.cache.kv_cache import (
    copy_blocks,
    init_kv_cache,
    kv_cache_bytes,
    read_blocks,
    write,
    write_blocks,
)
from paged_jax.engine.config import EngineConfig
from paged_jax.llm import LLM
from tests.engine_helpers import GREEDY, all_free, engine, model, prompts, run, tokens


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_cache_ops_move_scales_with_values(dtype):
    cache = init_kv_cache(2, 2, 5, 4, 8, jnp.dtype(dtype))
    assert cache.quantized and cache.k_scale[0].shape == (2, 5, 4, 1)
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 8)) * 3, jnp.float32) for _ in range(2))
    pos = jnp.array([4, 5, 6, 7, 8, -1])  # blocks 1 and 2; the last token is padding
    cache = write(cache, 1, pos, k, v)
    got_k, _ = cache.stacked()
    flat = got_k[1].reshape(2, -1, 8)[:, 4:9]  # [H, 5 tokens, D]
    np.testing.assert_allclose(flat, jnp.swapaxes(k[:5], 0, 1), rtol=0.08, atol=0.08)
    assert not np.asarray(got_k[0]).any() and not np.asarray(got_k[1][:, 0]).any()
    copied = copy_blocks(cache, jnp.array([1]), jnp.array([3]))
    np.testing.assert_array_equal(np.asarray(copied.stacked()[0][:, :, 3]),
                                  np.asarray(copied.stacked()[0][:, :, 1]))
    parts = read_blocks(cache, jnp.array([1, 2]))
    assert len(parts) == 4
    back = write_blocks(init_kv_cache(2, 2, 5, 4, 8, jnp.dtype(dtype)), jnp.array([1, 2]), *parts)
    for a, b in zip(back.stacked(), cache.stacked(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# One small pool for every int8 engine here (one set of compiled shapes): 12 requests at once
# preempt, and their shared prompt openings hit the prefix cache.
INT8 = dict(kv_cache_dtype="int8", num_kv_blocks=20, enable_prefix_caching=True)
N = 12


@pytest.fixture(scope="module")
def int8_greedy():
    eng = engine(**INT8)
    outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))], check=True)
    assert eng.scheduler.num_preempted > 0, "the small pool should preempt"
    assert all_free(eng)
    return outs


def test_int8_batched_equals_one_at_a_time_and_tracks_fp32(int8_greedy):
    eng = engine(**INT8)
    fp32 = run(engine(), [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))])
    same = 0
    for i, p in enumerate(prompts(N)):
        single = run(eng, [(f"s{i}", p, GREEDY)])
        assert tokens(single, f"s{i}") == tokens(int8_greedy, str(i)), f"prompt {i}"
        same += tokens(fp32, str(i)) == tokens(int8_greedy, str(i))
    assert same >= 9, f"only {same} of {N} prompts give the fp32 cache's greedy tokens"


def test_int8_reference_backend_gives_the_same_tokens(int8_greedy):
    """The default backend here reads the int8 pages in C++ (when it builds); the jnp
    reference reads the same pages."""
    eng = engine(**INT8, backend="reference")
    outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))])
    for i in range(N):
        assert tokens(outs, str(i)) == tokens(int8_greedy, str(i)), f"prompt {i}"


def test_int8_swap_preemption_loses_nothing(int8_greedy):
    eng = engine(**INT8, preemption_mode="swap")
    outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))], check=True)
    assert eng.scheduler.num_preempted > 0
    for i in range(N):
        assert tokens(outs, str(i)) == tokens(int8_greedy, str(i)), f"prompt {i}"
    assert all_free(eng) and eng.kv.swapped_bytes == 0


def test_fp8_cache_serves_and_forks():
    from paged_jax.sampling_params import SamplingParams

    sp = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    eng = engine(kv_cache_dtype="fp8")
    outs = run(eng, [("a", prompts(3)[2], sp), ("b", prompts(3)[1], GREEDY)], check=True)
    assert len(outs["a"].outputs) == 3 and all_free(eng)


def test_quantized_pool_holds_more_blocks_and_bad_names_are_refused():
    blocks = {d: LLM(model_parts=model(), kv_cache_memory=1 << 20, kv_cache_dtype=d)
              .engine_config.num_kv_blocks for d in ("auto", "bfloat16", "int8", "fp8")}
    assert blocks["bfloat16"] >= 2 * blocks["auto"] - 1
    # The tiny model's head_dim is 16: a float32 scale per 16 values caps int8 at 3.2x;
    # at SmolLM2's head_dim 64 (a scale per 32 values) it is 3.56x.
    assert blocks["int8"] >= 3.1 * blocks["auto"] and blocks["fp8"] == blocks["int8"]
    smol = [kv_cache_bytes(30, 3, 16, 64, jnp.dtype(d)) for d in (jnp.float32, jnp.int8)]
    assert smol[0] / smol[1] >= 3.5
    with pytest.raises(ValueError, match="kv_cache_dtype='int3' is not supported"):
        LLM(model_parts=model(), kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype='int3'"):
        EngineConfig(kv_cache_dtype="int3")
