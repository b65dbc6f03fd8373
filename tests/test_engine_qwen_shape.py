"""The engine's paths on a tiny model shaped like Qwen2.5 (q/k/v biases, tied embeddings, 3:1
heads, RoPE base 1e6): batched equals one at a time, preemption (recompute and swap), prefix
hits and beam search give the tokens the plain engine gives."""

from __future__ import annotations

import functools

import pytest

from paged_jax.models.testing import byte_tokenizer, random_params, tiny_qwen2_config
from tests.engine_helpers import (
    GREEDY,
    all_free,
    check_beam_search,
    check_prefix_hits,
    engine,
    prompts,
    run,
    tokens,
)

pytestmark = pytest.mark.slow
N = 12


@functools.cache
def qwen_parts():
    cfg = tiny_qwen2_config()
    params = random_params(cfg, seed=3)
    params["layers"].pop("bo", None)  # Qwen2 biases q, k and v only
    return cfg, params, byte_tokenizer()


@pytest.fixture(scope="module")
def batched():
    return run(engine(qwen_parts()), [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))])


def test_batched_equals_one_at_a_time(batched):
    eng = engine(qwen_parts())
    for i, p in enumerate(prompts(N)):
        assert tokens(run(eng, [("x", p, GREEDY)]), "x") == tokens(batched, str(i)), i
    assert all_free(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_loses_nothing(batched, mode):
    eng = engine(qwen_parts(), num_kv_blocks=20, preemption_mode=mode)
    outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))])
    assert eng.scheduler.num_preempted > 0 and eng.refused_steps == 0
    for i in range(N):
        assert tokens(outs, str(i)) == tokens(batched, str(i)), i
    assert all_free(eng)


def test_prefix_hits_give_the_same_tokens():
    check_prefix_hits(qwen_parts())


def test_beam_search_matches_a_brute_force_reference():
    check_beam_search(qwen_parts())
