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
