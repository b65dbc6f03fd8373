"""The host's one owner of the KV cache (vLLM V1's KVCacheManager, nano-vllm's BlockManager).

It holds the device side of the cache -- the block pool, the page tables and the K/V arrays,
pytrees changed only by the pure functions of pool.py, page_table.py and kv_cache.py -- and
every host fact about them, each written in one place:

    num_free     size of the device free stack (cached-free blocks not included); set from
                 each step's output and from each release, never counted by hand
    free_slots   page-table rows (sequence slots) no sequence owns
    slot_live    rows whose page-table entry is live on the device
    prefix       the prefix cache: hashes of full blocks, LRU queue of the cached-free ones
    swap space   host copies of swapped-out sequences' blocks (kept on the sequence)

The scheduler holds the manager and asks it `free_total` / `can_allocate` / `allocate` (a slot
per sequence) / `preempt` / `release`; the engine calls `evict` (room for a plan), `bring_live`
(slots a step admits) and `after_step` (with the step's output) around each device call, and
`fork` for the forks its callers make outside a step (beam search).

Terms: a *slot* is a sequence's row of the page table; a *block* is a page of the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import kv_cache as kv_lib
from paged_jax import page_table as pt
from paged_jax import pool as pool_lib
from paged_jax.config import CacheConfig
from paged_jax.prefix_cache import Hit, PrefixCache
from paged_jax.sequence import Sequence
from paged_jax.sizes import cdiv, next_pow2
from paged_jax.types import Array, Bool, Int

_mark = jax.jit(pool_lib.mark_cached, donate_argnums=(0,))
_evict = jax.jit(pool_lib.evict, donate_argnums=(0,))
_release = jax.jit(pt.release, donate_argnums=(0, 1))
_fork = jax.jit(pt.fork, donate_argnums=(0, 1))


def blocks_needed(seq: Sequence, n: int, block_size: int) -> int:
    """Upper bound on the blocks `seq` gains by computing `n` more tokens (copy included)."""
    have = cdiv(seq.num_computed, block_size)
    restore = have if seq.swapped is not None else 0  # swapped blocks come back first
    grow = cdiv(seq.num_computed + n, block_size) - have
    copy = int(seq.maybe_shared_last and seq.num_computed % block_size != 0 and n > 0)
    return restore + grow + copy


def _ids(ids: list[int]) -> jax.Array:
    """Block ids padded with the zero block to a power of two >= 8 (few compiled shapes)."""
    out = np.zeros(next_pow2(len(ids), 8), np.int32)
    out[: len(ids)] = ids
    return jnp.asarray(out)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _restore(
    pool: pool_lib.BlockPool, table: pt.PageTable, cache: kv_lib.KVCache,
    slot: Int[Array, ""], n_tokens: Int[Array, ""], *parts: Array,
) -> tuple[pool_lib.BlockPool, pt.PageTable, kv_lib.KVCache, Bool[Array, ""]]:
    """Swap-in on the device: the slot gets fresh blocks for its tokens, and `parts` (K, V
    [L, H, P, K, D], and scales [L, H, P, K, Z] for a quantized cache) are written back."""
    num_new = jnp.zeros_like(table.seq_lens).at[slot].set(n_tokens)
    table = pt.add_sequence(table, slot)
    pool, table, _, ok = pt.reserve_tokens(pool, table, num_new)
    return pool, table, kv_lib.write_blocks(cache, table.block_tables[slot], *parts), ok


class KVManager:
    """The KV cache of one engine: device pytrees plus their host mirror (see module doc).

    Args:
      cc: pool and page-table shape.
      num_layers, num_kv_heads, head_dim, dtype: the K/V arrays' shape and type.
      prefix_caching: keep full blocks for reuse across requests (prefix_cache.py).
      swap: preemption copies a sequence's blocks to the host instead of dropping them.
      swap_space: bytes of host memory swapped-out blocks may take; past it, a preempted
        sequence is recomputed instead (nothing is lost either way).
    """

    def __init__(self, cc: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype, *, prefix_caching: bool = True, swap: bool = False,
                 swap_space: int = 4 << 30, placement: tuple | None = None):
        self.config, self.swap, self.swap_space = cc, swap, swap_space
        self.swapped_bytes = 0
        self._block_bytes = kv_lib.kv_cache_bytes(num_layers, num_kv_heads, cc.block_size,
                                                  head_dim, dtype)
        # Committed to the device now: jit keys on placement, so uncommitted initial arrays
        # would make the second step compile everything again. `placement`: (bookkeeping,
        # cache) shardings under tensor parallelism (replicated, split by KV head).
        books, pages = placement or (jax.devices()[0],) * 2
        self.pool, self.table = jax.device_put(
            (pool_lib.init_pool(cc.num_blocks), pt.init_page_table(cc)), books)
        self.cache = jax.device_put(kv_lib.init_kv_cache(
            num_layers, num_kv_heads, cc.num_blocks, cc.block_size, head_dim, dtype), pages)
        self.num_free = cc.usable_blocks
        self.free_slots: list[int] = list(range(cc.max_seqs - 1, -1, -1))
        self.slot_live = np.zeros(cc.max_seqs, bool)
        self.prefix = PrefixCache(cc.block_size) if prefix_caching else None
        self._copy_hits: list[Sequence] = []  # hits whose last cached block the step copies

    # ---- capacity ------------------------------------------------------------------------
    def free_total(self) -> int:
        """Blocks a plan may use: the free stack plus evictable cached-free blocks."""
        return self.num_free + (len(self.prefix.evictable) if self.prefix else 0)

    def blocks_used(self) -> int:
        """Blocks held by sequences (cached-free blocks count as free, as in vLLM)."""
        return self.config.usable_blocks - self.free_total()

    def can_allocate(self, seqs: list[Sequence]) -> bool:
        """Whether every sequence without a slot can get one now."""
        return sum(s.slot < 0 for s in seqs) <= len(self.free_slots)

    def allocate(self, seqs: list[Sequence]) -> None:
        """Gives every sequence without a slot one (held until it finishes)."""
        for s in seqs:
            if s.slot < 0:
                s.slot = self.free_slots.pop()

    def free_slot(self, seq: Sequence) -> None:
        """Returns a finished or aborted sequence's slot and swap space (its blocks must be
        released already)."""
        if seq.swapped is not None:
            self.swapped_bytes -= sum(x.nbytes for x in seq.swapped)
            seq.swapped = None
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    # ---- before a step -------------------------------------------------------------------
    def evict(self, chunks: list[tuple[Sequence, int]], decode_only: bool) -> None:
        """Evicts just enough cached-free blocks for a plan to fit on the device free stack.

        A decode window may grow every sequence once more inside the loop, so it gets one
        block of headroom per sequence (evicted only if the stack is that short).
        """
        k = self.config.block_size
        need = sum(blocks_needed(s, n, k) for s, n in chunks)
        self.make_room(max(need, len(chunks)) if decode_only else need)

    def make_room(self, blocks: int) -> None:
        """Evicts cached-free blocks until the device free stack holds `blocks` (or the
        prefix cache has nothing left to evict)."""
        if self.prefix is None or blocks <= self.num_free:
            return
        ids = self.prefix.evict(blocks - self.num_free)
        if ids:
            self.pool = _evict(self.pool, _ids(ids))
            self.num_free += len(ids)

    def bring_live(self, seqs: list[Sequence]) -> list[tuple[Sequence, Hit | None]]:
        """Slots going live in the next step.

        Swapped-out sequences are restored here, in their own device call; the others are
        returned with the prefix hit chosen at admission, for the step's admissions.
        """
        out = []
        for seq in seqs:
            if self.slot_live[seq.slot]:
                continue
            self.slot_live[seq.slot] = True
            if seq.swapped is not None:
                self._swap_in(seq)
            else:
                out.append((seq, self._take_hit(seq)))
        return out

    def _take_hit(self, seq: Sequence) -> Hit | None:
        hit, seq.prefix_hit = seq.prefix_hit, None
        if hit is not None and hit.num_tokens % self.config.block_size:
            # The step copies the last cached block; the copy is then private, and the
            # cached block may drop to refcount 0 (queued for eviction after the step).
            self._copy_hits.append(seq)
        return hit

    def mark_live(self, seq: Sequence) -> None:
        """A slot the step made live itself (a fork's child)."""
        self.slot_live[seq.slot] = True

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Gives each child a slot that shares all of `parent`'s blocks (refcount + 1 each).

        Forks the engine's steps do not make themselves (beam search): the first step that
        writes a shared, partly filled last block copies it (copy-on-write).
        """
        if not self.can_allocate(children):
            raise RuntimeError(f"{len(children)} forks need free sequence slots; "
                               f"{len(self.free_slots)} left (raise max_num_seqs)")
        self.allocate(children)
        src, dst = np.full(self.config.max_seqs, -1, np.int32), np.zeros(self.config.max_seqs,
                                                                          np.int32)
        src[: len(children)], dst[: len(children)] = parent.slot, [c.slot for c in children]
        self.pool, self.table = _fork(self.pool, self.table, jnp.asarray(src), jnp.asarray(dst))
        shared = parent.num_computed % self.config.block_size != 0
        parent.maybe_shared_last |= shared
        for c in children:
            c.num_computed, c.maybe_shared_last = parent.num_computed, shared
            self.slot_live[c.slot] = True

    # ---- after a step --------------------------------------------------------------------
    def after_step(self, num_free: int, done: list[tuple[Sequence, int]]) -> None:
        """Takes a step's output: the free count, and full blocks filled since
        `(seq, num_computed before)`, registered in the prefix cache (one table read)."""
        self.num_free = num_free
        if self.prefix is None:
            return
        k = self.config.block_size
        todo = [(s, a // k, s.num_computed // k) for s, a in done
                if s.slot >= 0 and s.num_computed // k > a // k]
        if todo:
            rows = np.asarray(self.table.block_tables)
            new = [b for s, lo, hi in todo for b in self.prefix.register(s, lo, hi, rows[s.slot])]
            if new:
                self.pool = _mark(self.pool, _ids(new))
        copied, self._copy_hits = self._copy_hits, []
        for s in copied:
            s.maybe_shared_last = False  # its last block is private now (a fork may share it)
        if copied:
            self.prefix.on_release(np.asarray(self.pool.refcount), [])

    # ---- freeing -------------------------------------------------------------------------
    def release(self, seqs: list[Sequence]) -> None:
        """Frees the blocks of live sequences (finished, aborted or preempted); cached blocks
        whose last reference goes join the prefix cache's LRU queue, leaf first."""
        mask = np.zeros(self.config.max_seqs, bool)
        gone = [s for s in seqs if s.slot >= 0 and self.slot_live[s.slot]]
        for s in gone:
            mask[s.slot], self.slot_live[s.slot] = True, False
        if not gone:
            return
        self._free_rows(mask, self._cached_blocks(gone))

    def _free_rows(self, mask: np.ndarray, order: list[int]) -> None:
        """The device release of `mask`'s rows; the free count and the prefix cache's LRU
        queue (cached blocks `order`, leaf first) follow it."""
        self.pool, self.table = _release(self.pool, self.table, jnp.asarray(mask))
        self.num_free = int(self.pool.num_free)
        if self.prefix is not None:
            self.prefix.on_release(np.asarray(self.pool.refcount), order)

    def _cached_blocks(self, seqs: list[Sequence]) -> list[int]:
        """Cached blocks of sequences about to be released, tail (leaf) first."""
        if self.prefix is None:
            return []
        k, out = self.config.block_size, []
        for s in seqs:
            out += [self.prefix.entries[h].block
                    for h in reversed(s.block_hashes[:s.num_computed // k])
                    if h in self.prefix.entries]
        return out

    def preempt(self, seqs: list[Sequence]) -> int:
        """Frees running sequences' blocks, copying them to the host first in swap mode.

        Returns the blocks a plan may use now (`free_total`).
        """
        if self.swap:
            for s in seqs:
                size = cdiv(s.num_computed, self.config.block_size) * self._block_bytes
                if self.swapped_bytes + size <= self.swap_space:  # else: recompute
                    s.swapped = self._swap_out(s)
                    self.swapped_bytes += size
        self.release(seqs)
        return self.free_total()

    # ---- swap space ----------------------------------------------------------------------
    def _swap_out(self, seq: Sequence) -> tuple[np.ndarray, ...]:
        """Host copies of the sequence's blocks: K, V (and their scales when quantized)."""
        held = cdiv(seq.num_computed, self.config.block_size)
        blocks = np.asarray(self.table.block_tables[seq.slot])[:held]
        return tuple(np.asarray(x) for x in kv_lib.read_blocks(self.cache, jnp.asarray(blocks)))

    def _swap_in(self, seq: Sequence) -> None:
        parts = seq.swapped
        grow = self.config.max_blocks_per_seq - parts[0].shape[2]
        padded = [jnp.asarray(np.pad(x, [(0, 0), (0, 0), (0, grow)] + [(0, 0)] * (x.ndim - 3)))
                  for x in parts]
        self.pool, self.table, self.cache, ok = _restore(
            self.pool, self.table, self.cache, jnp.asarray(seq.slot),
            jnp.asarray(seq.num_computed), *padded)
        if not ok:  # the scheduler counted the restore (blocks_needed): a planning bug
            raise RuntimeError(f"swap-in of slot {seq.slot} found too few free blocks")
        self.num_free = int(self.pool.num_free)
        self.swapped_bytes -= sum(x.nbytes for x in parts)
        seq.swapped = None
