"""Hypothesis state machine over the prefix cache (host) + pool / page table / KV cache (device).

Sequences draw tokens from a two-letter alphabet with K = 2, so prefixes repeat often: rules
admit (hit or miss, evicting on demand), grow, and release sequences. The K/V "value" written
at position p is a fingerprint of tokens[:p + 1] (what a real model's K/V depends on), so a
wrong hit, a stale block or an eviction of a block still in use shows up as a wrong value read
back through the block table. After every rule: allocator invariants incl. cached-free blocks,
host LRU queue == device cached-free set, every cache entry names a cached block.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.cache.config import CacheConfig
from paged_jax.cache.invariants import check_invariants
from paged_jax.cache.kv_cache import init_kv_cache
from paged_jax.cache.page_table import (
    add_sequence,
    attach_prefix,
    init_page_table,
    release,
)
from paged_jax.cache.pool import evict, init_pool, mark_cached, num_cached_free
from paged_jax.cache.prefix_cache import PrefixCache
from paged_jax.engine.sequence import Sequence
from tests.allocator_helpers import make_append

CFG = CacheConfig(num_blocks=12, block_size=2, max_seqs=4, max_blocks_per_seq=6)
MAX_NEW = CFG.max_seq_len
K = CFG.block_size


def fingerprint(prefix: list[int]) -> float:
    """Stands in for the K/V of the last token of `prefix` (exact in float32)."""
    return float(hash(tuple(prefix)) % 1_000_003 + 1)


_grow = make_append(CFG, MAX_NEW, v_sign=1.0)


_add, _attach, _release = jax.jit(add_sequence), jax.jit(attach_prefix), jax.jit(release)
_mark, _evict = jax.jit(mark_cached), jax.jit(evict)


def _pad(ids: list[int]) -> jax.Array:
    out = np.zeros(CFG.num_blocks, np.int32)
    out[: len(ids)] = ids
    return jnp.asarray(out)


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool, self.table = init_pool(CFG.num_blocks), init_page_table(CFG)
        self.kv = init_kv_cache(1, 1, CFG.num_blocks, K, 1)
        self.prefix = PrefixCache(K)
        self.seqs: dict[int, Sequence] = {}  # slot -> sequence (num_computed = tokens held)

    # ---- helpers -------------------------------------------------------------------------
    def _make_room(self, need: int) -> bool:
        """Evicts LRU cached-free blocks until `need` fit on the free stack, if they can."""
        free = int(self.pool.num_free)
        if need > free + len(self.prefix.evictable):
            return False
        ids = self.prefix.evict(max(0, need - free))
        if ids:
            event("eviction")
            self.pool = _evict(self.pool, _pad(ids))
        return True

    def _write(self, seq: Sequence, n: int) -> None:
        """Computes n more tokens of seq on the device and registers its new full blocks."""
        a = seq.num_computed
        num_new = np.zeros(CFG.max_seqs, np.int32)
        num_new[seq.slot] = n
        vals = np.zeros((CFG.max_seqs, MAX_NEW), np.float32)
        vals[seq.slot, :n] = [fingerprint(seq.tokens[: p + 1]) for p in range(a, a + n)]
        self.pool, self.table, self.kv, ok, _ = _grow(
            self.pool, self.table, self.kv, jnp.asarray(num_new), jnp.asarray(vals.reshape(-1)))
        assert bool(ok), "the free-block accounting promised room"
        seq.num_computed = a + n
        row = np.asarray(self.table.block_tables[0, seq.slot])
        new = self.prefix.register(seq, a // K, row[a // K:seq.num_computed // K])
        if new:
            self.pool = _mark(self.pool, _pad(new))

    def _need(self, seq: Sequence, n: int, copy: bool) -> int:
        have = -(-seq.num_computed // K)
        return -(-(seq.num_computed + n) // K) - have + int(copy)

    # ---- rules ---------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < CFG.max_seqs)
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def admit(self, tokens):
        slot = min(set(range(CFG.max_seqs)) - set(self.seqs))
        seq = Sequence(0, list(tokens), len(tokens), slot=slot)
        hit = self.prefix.lookup(seq)
        copy = hit.num_tokens % K != 0
        n = len(tokens) - hit.num_tokens
        new = self._need_after(hit, n, copy)
        held = sum(b in self.prefix.evictable for b in hit.blocks)  # hit blocks leave the LRU
        if new + held > int(self.pool.num_free) + len(self.prefix.evictable):
            event("no room")
            return
        self.prefix.acquire(hit)
        assert self._make_room(new)
        self.table = _add(self.table, slot)
        if hit.blocks:
            event("full-prompt hit (copy)" if copy else "hit")
            self.pool, self.table = _attach(
                self.pool, self.table, jnp.asarray(slot),
                _pad(list(hit.blocks))[None, : CFG.max_blocks_per_seq], jnp.asarray(hit.num_tokens))
        else:
            event("miss")
        seq.num_computed = hit.num_tokens
        self.seqs[slot] = seq
        self._write(seq, n)
        if copy:  # the write copied the cached last block, which may now be cached-free
            self.prefix.on_release(np.asarray(self.pool.refcount), [])

    def _need_after(self, hit, n: int, copy: bool) -> int:
        """New blocks an admission needs beyond its hit (the copy included)."""
        return -(-(hit.num_tokens + n) // K) - len(hit.blocks) + int(copy)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def grow(self, data):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        room = CFG.max_seq_len - len(seq.tokens)
        if room == 0:
            return
        extra = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=min(room, 5)))
        if not self._make_room(self._need(seq, len(extra), False)):
            event("no room")
            return
        seq.tokens += extra
        self._write(seq, len(extra))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        slot = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(slot)
        order = [self.prefix.entries[h, 0].block for h in reversed(seq.block_hashes[
            : seq.num_computed // K]) if (h, 0) in self.prefix.entries]
        mask = jnp.arange(CFG.max_seqs) == slot
        self.pool, self.table = _release(self.pool, self.table, mask)
        self.prefix.on_release(np.asarray(self.pool.refcount), order)

    # ---- checks --------------------------------------------------------------------------
    @invariant()
    def allocator_invariants_hold(self):
        check_invariants(self.pool, self.table)

    @invariant()
    def host_and_device_agree(self):
        cached = np.asarray(self.pool.cached)
        assert sorted(self.prefix.hash_of) == np.nonzero(cached)[0].tolist()
        assert len(self.prefix.evictable) == int(num_cached_free(self.pool))
        ref = np.asarray(self.pool.refcount)
        assert all(ref[b] == 0 for b in self.prefix.evictable)
        assert all(self.prefix.hash_of[e.block] == key for key, e in self.prefix.entries.items())

    @invariant()
    def contents_read_back(self):
        """Every live sequence reads its own prefix fingerprints through its block table."""
        k = np.asarray(self.kv.k[0][0, :, :, 0])
        tables = np.asarray(self.table.block_tables[0])
        for s, seq in self.seqs.items():
            got = k[tables[s]].reshape(-1)[: seq.num_computed]
            want = [fingerprint(seq.tokens[: p + 1]) for p in range(seq.num_computed)]
            np.testing.assert_array_equal(got, want)

    @invariant()
    def cached_blocks_hold_their_prefix(self):
        """A cached-free block still holds the K/V its entry promises to the next hit."""
        k, entries = np.asarray(self.kv.k[0][0, :, :, 0]), self.prefix.entries
        for e in entries.values():
            toks, parent = list(e.tokens), e.parent
            while parent in entries:  # rebuild the prefix while its blocks are still cached
                toks, parent = list(entries[parent].tokens) + toks, entries[parent].parent
            if parent is None:
                assert k[e.block, -1] == fingerprint(toks)


PrefixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixMachine = PrefixMachine.TestCase


def test_sequence_is_a_plain_dataclass():
    """The machine builds bare Sequences; the prefix fields default empty."""
    s = Sequence(0, [1], 1)
    assert s.block_hashes == [] and s.prefix_hit is None and dataclasses.is_dataclass(s)
