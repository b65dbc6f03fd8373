"""Hypothesis state machine over a hybrid paged KV cache: sliding-window groups (windows 6
and 9) and a full-attention group sharing one block pool, through engine-like steps.

Why: a sliding group's block leaves a sequence mid-life, goes back to the pool and may go to
another sequence; a stale entry, a missed decref or a wrong-group copy would leak or mix keys.
The plain-Python model keeps per sequence its tokens and, per group, a map page
column -> *abstract* block id (fresh on allocation, shared on fork, replaced on copy-on-write,
dropped when truncated or slid out). It predicts exactly whether each step fits (new columns
+ copies over every group and sequence, before the step's slide frees anything), its copies,
and the blocks in use after every operation. After each one the device must pass
`check_invariants`, map one-to-one onto the model's blocks, point dropped columns at the zero
block, never write the zero block, and read back every live sequence's kept tokens group by
group (each group writes its own values, so a block shared by mistake shows).

Prefix caching runs on the same pool through the host's PrefixCache (cache/prefix_cache.py):
full blocks are registered per group and marked cached on the device, cached blocks a window
slid past or a release dropped wait in the LRU queue, evictions give them back, and a new
sequence with a cached prefix attaches what each group holds at the hit point (a sliding
group only its window's columns). The model tracks which abstract blocks are cached; a cached
block, held or not, must still hold its registered tokens' K/V in its group, the device's
cached and cached-free sets must equal the host's entries and LRU queue, and a hit must read
back its tokens group by group. test_a_planted_eviction_bug_is_caught shows a per-group bug
in the host's eviction is found.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from paged_jax.cache import kv_cache as kvc
from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.groups import first_kept, plan_groups
from paged_jax.cache.invariants import check_invariants
from paged_jax.cache.kv_cache import KVCache
from paged_jax.cache.page_table import PageTable
from paged_jax.cache.pool import BlockPool, init_pool
from paged_jax.cache.prefix_cache import PrefixCache
from paged_jax.sizes import cdiv

CFG = CacheConfig(num_blocks=30, block_size=4, max_seqs=5, max_blocks_per_seq=8,
                  windows=(6, None, 9))
GROUPS = plan_groups(CFG.windows)  # one layer per group, all in buffer 0: ids never overlap
K, S, P, G = CFG.block_size, CFG.max_seqs, CFG.max_blocks_per_seq, CFG.num_groups
MAX_NEW = 2 * K + 1
Plan = dict[tuple[int, int], tuple[int, bool]]  # (group, slot) -> (new columns, copy?)


class Host(NamedTuple):
    """What the checks read of the device state, fetched once per operation."""

    num_free: np.ndarray
    tables: np.ndarray  # [G, S, P]
    lens: np.ndarray
    live: np.ndarray
    k: np.ndarray  # [H, N, K, D] buffer 0: every group's layer
    v: np.ndarray


def value(token: int, group: int) -> float:
    """K stored for `token` (numbered from 1) in `group`'s layer; V is its negative."""
    return float(token * G + group)


def _grow(pool: BlockPool, table: PageTable, cache: KVCache, num_new: jax.Array,
          values: jax.Array) -> tuple[BlockPool, PageTable, KVCache, jax.Array, jax.Array]:
    """An engine step's bookkeeping: reserve -> copy-on-write -> write each new token's K/V
    (values[g, s * MAX_NEW + i] for token i of slot s) at its cache position in every group."""
    old = table.seq_lens
    pool, table, (src, dst), ok = pt.reserve_tokens(pool, table, num_new)
    cache = kvc.copy_blocks(cache, src, dst)
    seq = jnp.repeat(jnp.arange(S), MAX_NEW)
    i = jnp.tile(jnp.arange(MAX_NEW), S)
    real = (i < num_new[seq]) & ok
    pos = pt.cache_positions(table, jnp.where(real, seq, -1), old[seq] + i)  # [G, T]
    for layer in range(len(GROUPS.layer_group)):
        g = cache.group_of(layer)
        kv = values[g][:, None, None]
        cache = kvc.write(cache, layer, pos[g], kv, -kv)
    return pool, table, cache, ok, jnp.sum(dst != 0)


@jax.jit
def _step(pool, table, cache, num_new, values):
    """A plain step: grow, then slide the windows at the new lengths."""
    pool, table, cache, ok, copies = _grow(pool, table, cache, num_new, values)
    return (*pt.slide(pool, table), cache, ok, copies)


@jax.jit
def _verify(pool, table, cache, num_new, values, accept):
    """A speculative verify step: grow by num_new, keep `accept` of them, then slide."""
    old = table.seq_lens
    pool, table, cache, ok, copies = _grow(pool, table, cache, num_new, values)
    pool, table = pt.truncate(pool, table, jnp.where(ok, old + accept, old))
    return (*pt.slide(pool, table), cache, ok, copies)


_add = jax.jit(pt.add_sequence)
_fork = jax.jit(pt.fork)
_release = jax.jit(pt.release)
_attach = jax.jit(pt.attach_prefix)
_mark = jax.jit(pool_lib.mark_cached)
_evict = jax.jit(pool_lib.evict)


class Hashed:
    """A slot's tokens (the model's list itself) and its block-hash memo (PrefixCache)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.block_hashes = tokens, []


class Model:
    """Tokens and abstract blocks per sequence slot; predicts the allocator exactly."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.cols: dict[int, list[dict[int, int]]] = {}  # slot -> per group: column -> block
        self.fresh = itertools.count(1)
        self.next_token = itertools.count(1)
        self.cached: dict[int, int] = {}  # abstract block -> physical id, while cached

    def add(self, slot: int) -> None:
        self.tokens[slot], self.cols[slot] = [], [{} for _ in range(G)]

    def held(self) -> set[int]:
        return {b for per in self.cols.values() for c in per for b in c.values()}

    def used(self) -> int:
        """Blocks off the free stack: held by a sequence, or cached (cached-free ones too)."""
        return len(self.held() | set(self.cached))

    def plan(self, counts: dict[int, int]) -> Plan | str:
        """What growing slot s by counts[s] allocates, or why it cannot: "long" (a sequence
        would pass P pages) or "pool" (more blocks than are free)."""
        if any(cdiv(len(self.tokens[s]) + n, K) > P for s, n in counts.items()):
            return "long"
        plan: Plan = {}
        for g in range(G):
            holders = Counter(b for per in self.cols.values() for b in per[g].values())
            last, writers = {}, defaultdict(list)
            for s in sorted(counts):  # device rows are g * S + s: lowest slot first
                old = len(self.tokens[s])
                if counts[s] and old % K:
                    last[s] = self.cols[s][g][old // K]
                    writers[last[s]].append(s)
            for s in sorted(counts):
                old, b = len(self.tokens[s]), last.get(s)
                # All holders writing at once: the first keeps the block, the others copy.
                keeps = b is not None and len(writers[b]) == holders[b] and writers[b][0] == s
                keeps &= b not in self.cached  # a cached block is never written in place
                copy = b is not None and (holders[b] > 1 or b in self.cached) and not keeps
                plan[g, s] = (cdiv(old + counts[s], K) - cdiv(old, K), copy)
        need = sum(grow + copy for grow, copy in plan.values())
        return plan if need <= CFG.num_blocks - 1 - self.used() else "pool"

    def grow(self, plan: Plan, new_tokens: dict[int, list[int]]) -> None:
        for (g, s), (grow, copy) in plan.items():
            old, cols = len(self.tokens[s]), self.cols[s][g]
            if copy:
                cols[old // K] = next(self.fresh)
            for c in range(cdiv(old, K), cdiv(old, K) + grow):
                cols[c] = next(self.fresh)
        for s, toks in new_tokens.items():
            self.tokens[s] += toks

    def truncate(self, slot: int, length: int) -> None:
        del self.tokens[slot][length:]
        for cols in self.cols[slot]:
            for c in [c for c in cols if c >= cdiv(length, K)]:
                del cols[c]

    def slide(self) -> None:
        for s, per in self.cols.items():
            for w, cols in zip(CFG.windows, per, strict=True):
                lo = first_kept(len(self.tokens[s]), w, K)
                for c in [c for c in cols if c < lo]:
                    del cols[c]


class HybridMachine(RuleBasedStateMachine):
    """Random add / release / fork / step / verify step / exhaustion on device and model."""

    executed = 0  # rule executions, over every run (test_ten_thousand_operations)
    labels: Counter[str] = Counter()  # events, over every run

    def _label(self, name: str) -> None:
        event(name)
        HybridMachine.labels[name] += 1

    def __init__(self) -> None:
        super().__init__()
        self.pool = init_pool(CFG.num_blocks)
        self.table = pt.init_page_table(CFG)
        self.cache = kvc.init_kv_cache(len(GROUPS.layer_group), 1, CFG.num_blocks, K, 1,
                                       jnp.float32, groups=GROUPS)
        self.model = Model()
        self.seen: np.ndarray | None = None  # host block tables after the last operation
        self.slid_from: dict[int, int] = {}  # physical block -> slot whose window dropped it
        self.prefix = PrefixCache(K, CFG.windows)
        self.hashed: dict[int, Hashed] = {}  # slot -> its tokens and hash memo
        self.history: list[list[int]] = []  # token lists registered, for later hits

    def _count(self) -> None:
        HybridMachine.executed += 1

    def _live(self) -> list[int]:
        return sorted(self.model.tokens)

    def _free(self) -> list[int]:
        return [s for s in range(S) if s not in self.model.tokens]

    # ---- rules ---------------------------------------------------------------------------
    @initialize()
    def first_sequence(self) -> None:
        self._add(0)

    def _add(self, slot: int) -> None:
        self.table = _add(self.table, slot)
        self.model.add(slot)
        self.hashed[slot] = Hashed(self.model.tokens[slot])

    @precondition(lambda self: len(self.model.tokens) < S)
    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        self._count()
        self._add(data.draw(st.sampled_from(self._free())))

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._count()
        gone = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, unique=True))
        mask = jnp.array([s in gone for s in range(S)])
        order = [b for s in gone for b in self.prefix.chain_blocks(  # tail first, all groups
            self.hashed[s], len(self.model.tokens[s]) // K)]
        self.pool, self.table = _release(self.pool, self.table, mask)
        for s in gone:
            del self.model.tokens[s], self.model.cols[s], self.hashed[s]
        self.prefix.on_release(np.asarray(self.pool.refcount), order)

    @precondition(lambda self: 0 < len(self.model.tokens) < S)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self._count()
        self._fork(data.draw(st.sampled_from(self._live())),
                   data.draw(st.sampled_from(self._free())))

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._count()
        chosen = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, unique=True))
        ran = self._run({s: data.draw(st.integers(0, MAX_NEW), label=f"n{s}") for s in chosen})
        if ran and data.draw(st.booleans(), label="register"):  # as the engine's settle does
            for s in chosen:
                self._register(s)

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        """Grow by n, keep old + a (0 <= a <= n): speculative decoding's rollback."""
        self._count()
        chosen = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, unique=True))
        counts = {s: data.draw(st.integers(1, MAX_NEW), label=f"n{s}") for s in chosen}
        self._run(counts, {s: data.draw(st.integers(0, n), label=f"a{s}")
                           for s, n in counts.items()})

    @precondition(lambda self: any(len(t) % K for t in self.model.tokens.values()))
    @rule(data=st.data())
    def fork_and_write(self, data: st.DataObject) -> None:
        """Fork a sequence with a partly filled last block, then write into it (one or both)."""
        self._count()
        src = data.draw(st.sampled_from([s for s in self._live()
                                         if len(self.model.tokens[s]) % K]))
        counts = {src: 1}
        if self._free():
            dst = self._free()[0]
            self._fork(src, dst)
            if data.draw(st.booleans(), label="both write"):
                counts[dst] = 1
        self._run(counts)

    @precondition(lambda self: self._exhaust_request() is not None)
    @rule(data=st.data())
    def exhaust(self, data: st.DataObject) -> None:
        """Ask for more blocks than are free: refused, and nothing changes."""
        self._count()
        full, ask = self._exhaust_request(), {}
        for s in data.draw(st.permutations(sorted(full))):
            ask[s] = MAX_NEW
            if self.model.plan(ask) == "pool":
                break
        verify = data.draw(st.booleans(), label="as a verify step")
        assert not self._run(ask, dict.fromkeys(ask, 0) if verify else None)
        self._label("exhaust: more than the pool holds is refused")

    def _exhaust_request(self) -> dict[int, int] | None:
        """MAX_NEW tokens for every sequence with room for them, if the pool cannot cover it."""
        room = {s: MAX_NEW for s, t in self.model.tokens.items()
                if cdiv(len(t) + MAX_NEW, K) <= P}
        return room if room and self.model.plan(room) == "pool" else None

    def _fork(self, src: int, dst: int) -> None:
        self.pool, self.table = _fork(self.pool, self.table, jnp.array([src]), jnp.array([dst]))
        self.model.tokens[dst] = list(self.model.tokens[src])
        self.model.cols[dst] = [dict(c) for c in self.model.cols[src]]
        self.hashed[dst] = Hashed(self.model.tokens[dst])

    # ---- prefix caching --------------------------------------------------------------------
    @precondition(lambda self: any(len(t) >= K for t in self.model.tokens.values()))
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        """A sequence's full blocks are registered in every group (the engine does it as
        they fill; here at any time later too), marked cached on the device."""
        self._count()
        self._register(data.draw(st.sampled_from([s for s, t in self.model.tokens.items()
                                                  if len(t) >= K])))

    def _register(self, slot: int) -> None:
        full, rows = len(self.model.tokens[slot]) // K, np.asarray(self.table.block_tables)
        for g in range(G):
            new = self.prefix.register(self.hashed[slot], 0, rows[g, slot, :full], g)
            self.pool = _mark(self.pool, jnp.array(new + [0], jnp.int32))
            for c, b in self.model.cols[slot][g].items():
                if int(rows[g, slot, c]) in new:
                    self.model.cached[b] = int(rows[g, slot, c])
        self.history.append(list(self.model.tokens[slot]))

    @precondition(lambda self: len(self.model.tokens) < S and self.history)
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        """A new sequence whose tokens begin with registered ones (and go on with a new
        one): it attaches what every group holds at the longest common hit point."""
        self._count()
        # Half the draws take the recent registration with the longest hit now: only hits
        # past a window leave its first columns out, and unbiased draws reach them rarely.
        longest = max(reversed(self.history[-16:]),
                      key=lambda p: self.prefix.lookup(Hashed(p + [0])).num_tokens)
        past = data.draw(st.one_of(st.just(longest), st.sampled_from(self.history)))
        cut = data.draw(st.one_of(st.just(len(past)), st.integers(0, len(past))), label="cut")
        query = Hashed(past[:cut] + [next(self.model.next_token)])
        slot = data.draw(st.sampled_from(self._free()))
        self._add(slot)
        hit = self.prefix.lookup(query)
        run = next((i for i in range(len(query.tokens) // K)
                    if self.prefix._entry(query, i, CFG.windows.index(None)) is None),
                   len(query.tokens) // K)
        if hit.num_tokens < min(run * K, len(query.tokens) - 1):
            self._label("prefix hit lowered by a sliding group's window")
        if not hit.blocks:
            return
        self.prefix.acquire(hit)
        blocks = np.zeros((G, P), np.int32)
        for g, cols in enumerate(hit.columns):
            blocks[g, :len(cols)] = cols
        self.pool, self.table = _attach(self.pool, self.table, slot, blocks, hit.num_tokens)
        abstract = {p: b for b, p in self.model.cached.items()}
        self.model.tokens[slot] = self.hashed[slot].tokens = query.tokens[:hit.num_tokens]
        self.model.cols[slot] = [{c: abstract[p] for c, p in enumerate(cols) if p}
                                 for cols in hit.columns]
        self._label("prefix hit")
        if any(0 in cols for cols in hit.columns):
            self._label("prefix hit: a sliding group attached only its window")

    @precondition(lambda self: self.prefix.evictable)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """The least recently used cached-free blocks go back on the free stack."""
        self._count()
        ids = self.prefix.evict(data.draw(st.integers(1, len(self.prefix.evictable))))
        self.pool = _evict(self.pool, jnp.array(ids + [0] * (CFG.num_blocks - len(ids)),
                                                jnp.int32))
        gone = set(ids)
        self.model.cached = {b: p for b, p in self.model.cached.items() if p not in gone}
        self._label("evicted cached blocks")

    def _run(self, counts: dict[int, int], accept: dict[int, int] | None = None) -> bool:
        """A step (accept None) or verify step on device and model; returns ok."""
        plan, m = self.model.plan(counts), self.model
        new = {s: [next(m.next_token) for _ in range(n)] for s, n in counts.items()}
        num_new, acc = np.zeros(S, np.int32), np.zeros(S, np.int32)
        vals = np.zeros((G, S, MAX_NEW), np.float32)
        for s, toks in new.items():
            num_new[s], acc[s] = len(toks), (len(toks) if accept is None else accept[s])
            vals[:, s, : len(toks)] = [[value(t, g) for t in toks] for g in range(G)]
        before = jax.tree.leaves((self.pool, self.table, self.cache))
        args = (self.pool, self.table, self.cache, num_new, vals.reshape(G, -1))
        out = _step(*args) if accept is None else _verify(*args, acc)
        self.pool, self.table, self.cache, ok, copies = out
        assert bool(ok) == isinstance(plan, dict), f"device ok={bool(ok)}, model: {plan}"
        if not isinstance(plan, dict):
            self._label(f"step refused ({plan}): nothing changes")
            after = jax.tree.leaves((self.pool, self.table, self.cache))
            for x, y in zip(before, after, strict=True):
                np.testing.assert_array_equal(x, y)
            return False
        assert int(copies) == sum(c for _, c in plan.values()), "copy-on-write count differs"
        for g, _ in [gs for gs, (_, copy) in plan.items() if copy]:
            self._label(f"copy-on-write in a {'sliding' if CFG.windows[g] else 'full'} group")
        m.grow(plan, new)
        for s, toks in new.items():
            if acc[s] < len(toks):
                self._label("verify step rolled back tokens")
                m.truncate(s, len(m.tokens[s]) - len(toks) + int(acc[s]))
        used = m.used()
        m.slide()
        if m.used() < used:
            self._label("slide freed blocks")
        self.prefix.on_release(np.asarray(self.pool.refcount), [])  # slid-past cached blocks
        return True

    # ---- checks after every operation -----------------------------------------------------
    @invariant()
    def device_matches_model(self) -> None:
        check_invariants(self.pool, self.table)
        host = Host(*jax.device_get((self.pool.num_free, self.table.block_tables,
                                     self.table.seq_lens, self.table.live,
                                     self.cache.k[0], self.cache.v[0])))
        _check_blocks(self.model, host)
        _check_contents(self.model, host)
        _check_cache(self.model, self.prefix, self.pool, host)
        self._note_reuse(host)

    def _note_reuse(self, host: Host) -> None:
        """Labels runs where a block freed by a slide went to another sequence (whose keys its
        old owner, reading only its kept columns, must never see)."""
        cur = host.tables
        for g, s, c in zip(*np.nonzero(cur), strict=True):
            if self.slid_from.pop(int(cur[g, s, c]), s) != s:
                self._label("a block slid out of one window now holds another sequence's keys")
        if self.seen is not None:
            freed = (self.seen != 0) & (cur == 0) & ~np.isin(self.seen, cur)
            for g, s, c in zip(*np.nonzero(freed), strict=True):
                w = CFG.windows[g]
                if w is not None and host.live[s] and c < first_kept(int(host.lens[s]), w, K):
                    self.slid_from[int(self.seen[g, s, c])] = int(s)
        self.seen = cur


def _check_blocks(model: Model, host: Host) -> None:
    """Used blocks, lengths and every table entry agree with the model, one-to-one."""
    live = sorted(model.tokens)
    assert CFG.num_blocks - 1 - int(host.num_free) == model.used(), "used blocks != model"
    assert np.flatnonzero(host.live).tolist() == live, "live slots differ from the model"
    assert host.lens[live].tolist() == [len(model.tokens[s]) for s in live]
    back = dict(model.cached)  # abstract -> physical block, and back
    fwd = {p: b for b, p in back.items()}
    for s in live:
        for g, cols in enumerate(model.cols[s]):
            row = host.tables[g, s]
            assert np.flatnonzero(row).tolist() == sorted(cols), (
                f"group {g} seq {s}: table {row} but the model keeps columns {sorted(cols)}")
            for c, b in cols.items():
                phys = int(row[c])
                assert fwd.setdefault(phys, b) == b and back.setdefault(b, phys) == phys, (
                    f"block {phys} (group {g} seq {s} column {c}) is not one model block")


def _check_cache(model: Model, prefix: PrefixCache, pool: BlockPool, host: Host) -> None:
    """The device's cached and cached-free blocks are the host's entries and LRU queue (and
    the model's cached blocks), and each cached block holds its tokens' K/V in its group."""
    cached, ref = np.asarray(pool.cached), np.asarray(pool.refcount)
    assert set(np.flatnonzero(cached).tolist()) == set(prefix.hash_of) == set(
        model.cached.values()), "cached blocks differ: device, host, model"
    assert set(np.flatnonzero(cached & (ref == 0)).tolist()) == set(prefix.evictable), (
        "cached-free blocks on the device are not the host's LRU queue")
    k = host.k[0, :, :, 0]
    for (_, g), e in prefix.entries.items():
        np.testing.assert_array_equal(k[e.block], [value(t, g) for t in e.tokens],
                                      err_msg=f"cached block {e.block} of group {g}")


def _check_contents(model: Model, host: Host) -> None:
    """Every live sequence reads back its own kept tokens, group by group."""
    k, v = host.k[0, :, :, 0], host.v[0, :, :, 0]  # head 0, dim 0: [N, K]
    assert not k[0].any() and not v[0].any(), "the zero block was written"
    for s, toks in model.tokens.items():
        for g, cols in enumerate(model.cols[s]):
            lo = min(cols, default=0) * K
            want = np.array([value(t, g) for t in toks[lo:]], np.float32)
            blocks = host.tables[g, s]
            np.testing.assert_array_equal(k[blocks].reshape(-1)[lo: len(toks)], want,
                                          err_msg=f"K of seq {s} in group {g}")
            np.testing.assert_array_equal(v[blocks].reshape(-1)[lo: len(toks)], -want,
                                          err_msg=f"V of seq {s} in group {g}")


SETTINGS = settings(max_examples=400, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MUST_HAPPEN = ("copy-on-write in a sliding group", "copy-on-write in a full group",
               "slide freed blocks", "verify step rolled back tokens",
               "exhaust: more than the pool holds is refused", "step refused (long): nothing "
               "changes", "a block slid out of one window now holds another sequence's keys",
               "prefix hit", "prefix hit: a sliding group attached only its window",
               "prefix hit lowered by a sliding group's window", "evicted cached blocks")


def test_ten_thousand_operations() -> None:
    """At least 10,000 random operations in one run, every check after each of them, and
    every situation the machine is about reached."""
    HybridMachine.executed, HybridMachine.labels = 0, Counter()
    # Derandomized: CI's clean clone runs the very operations a developer's run did (the fast
    # tier's TestHybridMachine keeps drawing new ones).
    run_state_machine_as_test(HybridMachine, settings=settings(SETTINGS, derandomize=True))
    assert HybridMachine.executed >= 10_000, f"only {HybridMachine.executed} operations ran"
    missing = [e for e in MUST_HAPPEN if not HybridMachine.labels[e]]
    assert not missing, f"never reached: {missing} ({dict(HybridMachine.labels)})"

def _evict_by_hash_in_group_0(self: PrefixCache, n: int) -> list[int]:
    """A per-group eviction bug: the victim's entry is looked up in group 0 whatever its
    group, so a sliding or full group keeps an entry naming a block back on the free stack."""
    out = []
    while self.evictable and len(out) < n:
        b, _ = self.evictable.popitem(last=False)
        h, _ = self.hash_of.pop(b)
        self.entries.pop((h, 0), None)
        out.append(b)
    return out


def test_a_planted_eviction_bug_is_caught(monkeypatch) -> None:
    """The machine must fail on a per-group eviction bug (the issue's mutation check)."""
    monkeypatch.setattr(PrefixCache, "evict", _evict_by_hash_in_group_0)
    with pytest.raises(Exception, match="cached|block|K of|differ"):
        run_state_machine_as_test(HybridMachine, settings=settings(
            SETTINGS, max_examples=200, stateful_step_count=40, database=None,
            phases=[Phase.generate]))  # found is enough: no shrinking


TestHybridMachine = HybridMachine.TestCase  # the fast tier's short search; slow: >= 10,000
TestHybridMachine.settings = settings(SETTINGS, max_examples=25, stateful_step_count=30)
