"""Prefix caching: exact pool ids, the host table/LRU, and engine outputs with vs without it."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.cache.invariants import InvariantError, check_invariants
from paged_jax.cache.page_table import add_sequence, init_page_table, release, reserve_tokens
from paged_jax.cache.pool import (
    decref,
    evict,
    incref,
    init_pool,
    mark_cached,
    num_cached_free,
    num_used,
)
from paged_jax.cache.prefix_cache import PrefixCache
from paged_jax.engine import EngineConfig
from paged_jax.engine.admission import cache_aware_order, count_skips
from paged_jax.engine.sequence import Request, Sequence
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import GREEDY, all_free, engine, run, tokens


# ---- device: cached-free blocks --------------------------------------------------------------
def test_cached_block_is_kept_off_the_free_stack_until_evicted():
    pool = init_pool(6)
    pool = incref(pool, jnp.array([3]))  # pretend 3 was allocated (refcount 1)
    pool = pool.__class__(pool.refcount, jnp.array([5, 4, 2, 1, 0, 0]), jnp.asarray(4),
                          pool.cached)
    pool = mark_cached(pool, jnp.array([3, 0]))
    pool = decref(pool, jnp.array([3]))
    assert int(pool.num_free) == 4 and int(num_cached_free(pool)) == 1
    assert int(num_used(pool)) == 0
    pool = incref(pool, jnp.array([3]))  # a hit revives it
    assert int(num_cached_free(pool)) == 0 and int(num_used(pool)) == 1
    pool = evict(pool, jnp.array([3, 0]))  # in use: only unmarked, never pushed
    assert int(pool.num_free) == 4 and not bool(pool.cached[3])
    pool = mark_cached(pool, jnp.array([3]))
    pool = evict(decref(pool, jnp.array([3])), jnp.array([3]))
    assert int(pool.num_free) == 5 and int(pool.free_stack[4]) == 3  # top of the stack


def test_invariants_cover_cached_free_blocks():
    cfg_table = init_page_table(_cfg())
    pool, table = init_pool(6), add_sequence(cfg_table, 0)
    pool, table, _, ok = reserve_tokens(pool, table, jnp.array([4, 0]))  # blocks 1, 2
    pool = mark_cached(pool, jnp.array([1, 2]))
    pool, table = release(pool, table, jnp.array([True, False]))
    check_invariants(pool, table)
    assert int(pool.num_free) == 3 and int(num_cached_free(pool)) == 2
    bad = pool.__class__(pool.refcount, pool.free_stack.at[3].set(1), pool.num_free + 1,
                         pool.cached)
    with pytest.raises(InvariantError, match="cached blocks on the free list|free"):
        check_invariants(bad, table)


def _cfg():
    from paged_jax.cache.config import CacheConfig
    return CacheConfig(num_blocks=6, block_size=2, max_seqs=2, max_blocks_per_seq=3)


# ---- host: hash table and LRU ----------------------------------------------------------------
def _seq(toks):
    return Sequence(0, list(toks), len(toks))


def test_lookup_register_and_lru_leaf_first():
    pc = PrefixCache(2)
    a = _seq([1, 2, 3, 4, 5])
    assert pc.lookup(a).blocks == ()
    assert pc.register(a, 0, np.array([7, 9])) == [7, 9]
    hit = pc.lookup(_seq([1, 2, 3, 4, 6, 6]))
    assert hit.blocks == (7, 9) and hit.num_tokens == 4
    assert pc.lookup(_seq([1, 2, 4, 4])).blocks == (7,)  # second block differs
    full = pc.lookup(_seq([1, 2, 3, 4]))  # whole prompt cached: recompute the last token
    assert full.blocks == (7, 9) and full.num_tokens == 3
    assert pc.lookup(_seq([1, 2])).blocks == (7,) and pc.lookup(_seq([1, 2])).num_tokens == 1
    ref = np.zeros(10, np.int32)
    pc.on_release(ref, [9, 7])  # leaf first
    assert list(pc.evictable) == [9, 7] and pc.lookup(_seq([1, 2, 3, 4, 5])).num_evictable == 2
    assert pc.evict(1) == [9]
    assert pc.lookup(_seq([1, 2, 3, 4, 5])).blocks == (7,)


def test_duplicate_prefix_is_not_registered_twice():
    pc = PrefixCache(2)
    assert pc.register(_seq([1, 2, 3]), 0, np.array([4])) == [4]
    assert pc.register(_seq([1, 2, 5]), 0, np.array([6])) == []  # same content elsewhere


def _req(rid, order=-1):
    return Request(rid, None, [1], SamplingParams(), 0.0, order)


def test_cache_aware_order_is_bounded():
    w = [_req("a"), _req("b"), _req("c"), _req("p", order=3)]
    cached = {"a": 0, "b": 8, "c": 16, "p": 0}
    skips = {}
    order = cache_aware_order(w, lambda r: cached[r.request_id], skips, max_skips=2)
    assert [r.request_id for r in order] == ["p", "c", "b", "a"]  # preempted keep the front
    for _ in range(2):
        count_skips(w[:3], [w[2]], skips)
    assert skips == {"a": 2, "b": 2}
    order = cache_aware_order(w, lambda r: cached[r.request_id], skips, max_skips=2)
    assert [r.request_id for r in order] == ["p", "a", "b", "c"]  # starved ones first, FCFS


def _grouped_cache():
    """K = 2, group 0 sliding (window 4), group 1 full; one sequence of 12 tokens registered
    in both (group 1 in blocks 1-6, group 0 in 11-16), its window already slid past 11-14."""
    pc, seq = PrefixCache(2, (4, None)), _seq(range(12))
    pc.register(seq, 0, [11, 12, 13, 14, 15, 16], 0)
    pc.register(seq, 0, [1, 2, 3, 4, 5, 6], 1)
    ref = np.zeros(17, np.int32)
    ref[[1, 2, 3, 4, 5, 6, 15, 16]] = 1
    pc.on_release(ref, [])  # the slide: 11-14 cached-free
    pc.on_release(np.zeros(17, np.int32), pc.chain_blocks(seq, 6))  # the sequence is released
    return pc


def test_hit_in_groups_attaches_only_the_window():
    """A sliding group's hit holds the columns its window reads at the hit point (3 and 4 at
    10 tokens: positions 7 .. 9), zero before; the full group every column."""
    pc = _grouped_cache()
    hit = pc.lookup(_seq(list(range(11)) + [99]))  # 12 tokens, 5 blocks shared
    assert hit.num_tokens == 10
    assert hit.columns == ((0, 0, 0, 14, 15), (1, 2, 3, 4, 5))
    assert hit.num_evictable == 7
    pc.evict(2)  # the tail column: block 6 of the full group, then 16 of the sliding one
    whole = pc.lookup(_seq(range(13)))
    assert whole.num_tokens == 10 and whole.columns[0] == (0, 0, 0, 14, 15)


def test_eviction_shrinks_a_grouped_hit_block_by_block():
    """Released tail first in every group, the window's slid-past blocks included, so
    evicting half the cache leaves a 6-token hit. Queued as they slid (11-14 first), the
    same evictions would take the window's blocks everywhere: no hit at all (vLLM #48435)."""
    pc = _grouped_cache()
    assert list(pc.evictable)[:6] == [6, 16, 5, 15, 4, 14]  # a column's full block first
    pc.evict(6)
    hit = pc.lookup(_seq(range(13)))
    assert hit.num_tokens == 6 and hit.columns == ((0, 12, 13), (1, 2, 3))


# ---- engine: outputs with and without caching --------------------------------------------------
SYSTEM = "You are a terse assistant. Answer in one line. "  # 47 bytes: not block aligned (K=8)


def _chat(n):
    return [(str(i), SYSTEM + f"q{i}: what is {i} + {i}?", GREEDY) for i in range(n)]


@pytest.fixture(scope="module")
def reference():
    eng = engine(enable_prefix_caching=False)
    outs = run(eng, _chat(8) + [("full", "z" * 64, GREEDY)], check=True)
    return outs


def test_shared_prefix_same_outputs_and_cached_tokens(reference):
    eng = engine()
    first = run(eng, _chat(8), check=True)  # concurrent: later requests hit earlier ones
    again = run(eng, [("b" + r, p, sp) for r, p, sp in _chat(8)], check=True)
    for r, _, _ in _chat(8):
        assert tokens(first, r) == tokens(reference, r) == tokens(again, "b" + r), r
    n_prompt = len(eng.tokenizer.encode(_chat(8)[0][1]))
    assert all(again["b" + r].num_cached_tokens == n_prompt // 8 * 8 for r, _, _ in _chat(8))
    assert eng.prefix.hit_rate > 0.5
    assert all_free(eng)


def test_prefix_shared_by_running_requests(reference):
    """A request joins while another holding the same prefix is still decoding."""
    eng = engine()
    eng.add_request("0", _chat(1)[0][1], GREEDY)
    for _ in range(3):
        eng.step()
    done = run(eng, [("1", _chat(2)[1][1], GREEDY)], check=True)
    common = len(os.path.commonprefix([_chat(2)[0][1], _chat(2)[1][1]]))
    assert done["1"].num_cached_tokens == common // 8 * 8 > 0
    assert tokens(done, "1") == tokens(reference, "1")


def test_whole_prompt_hit_recomputes_last_token(reference):
    eng = engine()
    a = run(eng, [("a", "z" * 64, GREEDY)], check=True)
    b = run(eng, [("b", "z" * 64, GREEDY)], check=True)
    assert b["b"].num_cached_tokens == 63
    assert tokens(a, "a") == tokens(b, "b") == tokens(reference, "full")
    assert all_free(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_cache_evicts_and_outputs_match(reference, mode):
    eng = engine(num_kv_blocks=24, preemption_mode=mode)
    outs = run(eng, _chat(8), check=True)
    outs2 = run(eng, [("b" + r, p, sp) for r, p, sp in _chat(8)], check=True)
    assert eng.prefix.evicted > 0, "the tiny cache should evict"
    for r, _, _ in _chat(8):
        assert tokens(outs, r) == tokens(reference, r) == tokens(outs2, "b" + r), r
    assert all_free(eng)


def test_cache_aware_admission_same_outputs(reference):
    eng = engine(admission="cache-aware", max_skips=2)
    outs = run(eng, _chat(8), check=True)
    for r, _, _ in _chat(8):
        assert tokens(outs, r) == tokens(reference, r)


def test_caching_is_on_by_default_and_can_be_turned_off():
    assert EngineConfig().enable_prefix_caching
    eng = engine(enable_prefix_caching=False)
    outs = run(eng, _chat(2) + [("c", _chat(1)[0][1], GREEDY)])
    assert eng.prefix is None and outs["c"].num_cached_tokens == 0


def test_llm_flag_reaches_the_engine():
    from paged_jax.llm import LLM
    from tests.engine_helpers import model
    on = LLM(model_parts=model(), num_kv_blocks=16, block_size=8, max_model_len=64,
             static_shapes=True)
    off = LLM(model_parts=model(), num_kv_blocks=16, block_size=8, max_model_len=64,
              enable_prefix_caching=False)
    assert on.llm_engine.prefix is not None and off.llm_engine.prefix is None
