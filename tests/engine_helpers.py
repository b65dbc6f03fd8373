"""Shared tiny-model engine setup for engine tests (one config => compiled shapes reused)."""

from __future__ import annotations

import functools
import os

from paged_jax.cache.invariants import check_invariants
from paged_jax.engine import Engine, EngineConfig
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from paged_jax.sampling_params import SamplingParams
from paged_jax.study.reservation import policy_for

CHECK = os.environ.get("PAGED_JAX_CHECK", "1") == "1"  # KVManager.check after every step

# static_shapes: one program per kind of call (engine/batch.py), so the many tests whose
# subject is not the shape buckets compile a few programs, not one per bucket. The engine's
# own tests (test_engine.py, test_engine_random.py, test_batch.py) run the buckets users get.
BASE = dict(block_size=8, num_kv_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
            max_model_len=256, decode_window=8, max_logprobs=4, static_shapes=True)
BUCKETS = dict(static_shapes=False)  # what a user's engine does


@functools.cache
def model():
    c = tiny_config()
    return c, random_params(c), byte_tokenizer()


def engine(parts=None, policy=None, check: bool = CHECK, draft=None, **overrides) -> Engine:
    """An engine with BASE's config (and `overrides`) on `parts` (default: the tiny Llama).

    It checks its KV manager's host mirror against the device after every step (Engine's
    `check`), and runs under `policy` (default: on-demand paging; a name from
    study/reservation.py's POLICIES picks a baseline), with speculative decoding's `draft`
    model (config, params) if given."""
    ec = EngineConfig(**{**BASE, **overrides})
    if isinstance(policy, str):
        policy = policy_for(policy, ec)
    return Engine(*(parts or model()), ec, policy=policy, check=check, draft=draft)


def prompts(n: int) -> list[str]:
    return [f"request {i}: " + "lorem ipsum " * (i % 7) for i in range(n)]


def run(eng: Engine, reqs, check=False) -> dict:
    """Adds (id, prompt, params) requests and steps until done; returns id -> RequestOutput."""
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            check_invariants(eng.state.pool, eng.state.table)
    return done


def tokens(outs: dict, rid: str) -> list[list[int]]:
    return [c.token_ids for c in outs[rid].outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def all_free(eng: Engine) -> bool:
    """Nothing is held: every block is free or cached-free (prefix caching keeps those)."""
    pool = eng.state.pool
    cached_free = int((pool.cached & (pool.refcount == 0)).sum())
    return (not bool(pool.refcount.any())
            and int(pool.num_free) + cached_free == eng.config.num_kv_blocks - 1)


def check_prefix_hits(parts) -> None:
    """Requests sharing a system prompt give the same greedy tokens with prefix caching (hits
    asserted) as without."""
    shared = "a shared system prompt of some length, " * 3
    reqs = [(str(i), shared + p, GREEDY) for i, p in enumerate(prompts(6))]
    cold = run(engine(parts, enable_prefix_caching=False), reqs)
    eng = engine(parts, enable_prefix_caching=True)
    run(eng, reqs[:1])
    warm = run(eng, [(f"w{rid}", p, sp) for rid, p, sp in reqs])
    assert sum(o.num_cached_tokens or 0 for o in warm.values()) > 0
    for rid, _, _ in reqs:
        assert tokens(warm, f"w{rid}") == tokens(cold, rid), rid


def check_beam_search(parts) -> None:
    """beam_search's two beams of 4 tokens equal a brute-force search over the model's
    log-probabilities (one PagedLoop forward per candidate), and every block comes back."""
    import numpy as np

    from paged_jax.cache.config import CacheConfig
    from paged_jax.engine.beam_search import beam_search
    from paged_jax.models.reference_loop import PagedLoop
    from paged_jax.sampling_params import BeamSearchParams

    config, params, tok = parts
    ids = tok.encode("beam me up")

    def logprobs(seq):
        logits = PagedLoop(config, params, CacheConfig(64, 8, 1, 32)).step([seq])[0]
        return logits - np.logaddexp.reduce(logits)

    beams = [([], 0.0)]
    for _ in range(4):
        cands = [(t + [int(x)], c + float(lp[x])) for t, c in beams
                 for lp in [logprobs(ids + t)] for x in np.argsort(-lp)[:4]]
        beams = sorted(cands, key=lambda b: -b[1])[:2]
    eng = engine(parts)
    out, _ = beam_search(eng, "beam me up", BeamSearchParams(beam_width=2, max_tokens=4,
                                                             ignore_eos=True))
    got = sorted((s.tokens[len(ids):], s.cum_logprob) for s in out.sequences)
    for (g, gl), (w, wl) in zip(got, sorted(beams), strict=True):
        assert g == w and abs(gl - wl) < 1e-3
    assert all_free(eng)
