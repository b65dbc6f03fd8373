"""The engine's paths on a tiny model shaped like Qwen2.5 (q/k/v biases, tied embeddings, 3:1
heads, RoPE base 1e6): batched equals one at a time, preemption (recompute and swap), prefix
hits and beam search give the tokens the plain engine gives."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from paged_jax.cache.config import CacheConfig
from paged_jax.engine.beam_search import beam_search
from paged_jax.models.reference_loop import PagedLoop
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_qwen2_config
from paged_jax.sampling_params import BeamSearchParams
from tests.engine_helpers import GREEDY, all_free, engine, prompts, run, tokens

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
    shared = "a shared system prompt of some length, " * 3
    reqs = [(str(i), shared + p, GREEDY) for i, p in enumerate(prompts(6))]
    cold = run(engine(qwen_parts(), enable_prefix_caching=False), reqs)
    eng = engine(qwen_parts(), enable_prefix_caching=True)
    run(eng, reqs[:1])
    warm = run(eng, [(f"w{rid}", p, sp) for rid, p, sp in reqs])
    assert sum(o.num_cached_tokens or 0 for o in warm.values()) > 0
    for rid, _, _ in reqs:
        assert tokens(warm, f"w{rid}") == tokens(cold, rid), rid


def test_beam_search_matches_a_brute_force_reference():
    config, params, tok = qwen_parts()
    ids = tok.encode("beam me up")

    def logprobs(seq):
        logits = PagedLoop(config, params, CacheConfig(64, 8, 1, 32)).step([seq])[0]
        return logits - np.logaddexp.reduce(logits)

    beams = [([], 0.0)]
    for _ in range(4):
        cands = [(t + [int(x)], c + float(lp[x])) for t, c in beams
                 for lp in [logprobs(ids + t)] for x in np.argsort(-lp)[:4]]
        beams = sorted(cands, key=lambda b: -b[1])[:2]
    eng = engine(qwen_parts())
    out, _ = beam_search(eng, "beam me up", BeamSearchParams(beam_width=2, max_tokens=4,
                                                             ignore_eos=True))
    got = sorted((s.tokens[len(ids):], s.cum_logprob) for s in out.sequences)
    for (g, gl), (w, wl) in zip(got, sorted(beams), strict=True):
        assert g == w and abs(gl - wl) < 1e-3
    assert all_free(eng)
