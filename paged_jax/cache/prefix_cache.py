"""Automatic prefix caching, host side: block hashes -> block ids, and the LRU eviction order.

A full block is named by a hash of (its parent block's hash, its K token ids), so a hash names
the whole prefix up to and including that block:

    tokens:  [ t0 .. t7 | t8 .. t15 | t16 .. t23 | t24 t25 ]      K = 8
    hashes:    h0 = H(None, t0..t7)   h1 = H(h0, t8..t15)   h2 = H(h1, t16..t23)   (partial: none)
    lookup:    h0 hit -> block 7, h1 hit -> block 3, h2 miss: stop.  Hit = blocks [7, 3], 16 tokens

A new request takes every leading full block already cached (refcount + 1, no recompute) and
computes the rest. At least the last prompt token is always computed, so there are logits to
sample: when the whole prompt hits, the sequence starts at len - 1 tokens and its last block is
copied on write (page_table._needs_copy copies any cached block before writing into it).

Blocks of finished requests stay cached while free (refcount 0, `pool.cached` set, off the free
stack) and are evicted least recently used first only when the pool needs them. Blocks of one
sequence are queued tail first, so a leaf block goes before the prefix it extends.

Why host-side: hashing variable-length token lists and keeping an LRU order are dictionary
work the scheduler (host) already needs to decide admission (how many blocks a request really
needs); the device only ever sees block ids, through pure jitted functions of the pool and page
table pytrees: `page_table.attach_prefix` (a hit), `pool.mark_cached` (registration) and
`pool.evict` (eviction). Lookups compare the stored tokens too, so a hash collision is a miss,
never a wrong hit.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Protocol

import numpy as np

from paged_jax.sizes import cdiv


class Hashed(Protocol):
    """What the cache reads of a sequence: its tokens, and the memo of its block hashes (a
    list the cache grows; tokens only ever grow, so the chain only grows)."""

    tokens: list[int]
    block_hashes: list[int]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One cached full block: where it lives and the exact prefix it holds."""

    block: int
    parent: int | None
    tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Hit:
    """The cached prefix of a sequence.

    Attributes:
      blocks: block ids to attach, in logical order.
      num_tokens: tokens the sequence starts with (K * len(blocks), or len(tokens) - 1 when
        the whole prompt hit and the last token is recomputed).
      num_evictable: hit blocks that are cached-free now: claiming them uses free capacity.
    """

    blocks: tuple[int, ...]
    num_tokens: int
    num_evictable: int


class PrefixCache:
    """Hash table of cached full blocks plus the LRU queue of the cached-free ones.

    Args:
      block_size: K, tokens per block.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.entries: dict[int, Entry] = {}
        self.hash_of: dict[int, int] = {}  # block id -> its entry's hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached-free, LRU first
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted = 0

    # ---- hashing -------------------------------------------------------------------------
    def chain(self, seq: Hashed, num_blocks: int) -> list[int]:
        """Hashes of seq's first `num_blocks` full blocks (memoized on the sequence: tokens
        only ever grow, so the chain only grows)."""
        k, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(seq.tokens[i * k:(i + 1) * k]))))
        return hashes[:num_blocks]

    def _entry(self, seq: Hashed, i: int, h: int) -> Entry | None:
        e, k = self.entries.get(h), self.block_size
        parent = seq.block_hashes[i - 1] if i else None
        if e is None or e.parent != parent or list(e.tokens) != seq.tokens[i * k:(i + 1) * k]:
            return None
        return e

    # ---- admission -----------------------------------------------------------------------
    def lookup(self, seq: Hashed) -> Hit:
        """The longest cached prefix of seq's tokens, leaving at least one token to compute."""
        k, n = self.block_size, len(seq.tokens)
        blocks = []
        for i, h in enumerate(self.chain(seq, n // k)):
            e = self._entry(seq, i, h)
            if e is None:
                break
            blocks.append(e.block)
        num_tokens = min(len(blocks) * k, n - 1)
        blocks = blocks[: cdiv(num_tokens, k)]
        return Hit(tuple(blocks), num_tokens, sum(b in self.evictable for b in blocks))

    def acquire(self, hit: Hit) -> None:
        """The hit's blocks are in use again: no longer evictable."""
        for b in hit.blocks:
            self.evictable.pop(b, None)

    def count(self, prompt_len: int, hit_tokens: int) -> None:
        """Hit-rate bookkeeping of one admitted request."""
        self.queried_tokens += prompt_len
        self.hit_tokens += hit_tokens

    # ---- registration --------------------------------------------------------------------
    def register(self, seq: Hashed, lo: int, ids: np.ndarray | list[int]) -> list[int]:
        """Registers seq's full blocks lo, lo + 1, ... held in blocks `ids` (in order).

        Returns the newly cached block ids (the device must `mark_cached` them). A block whose
        prefix is already cached elsewhere (computed twice, concurrently) stays uncached and is
        freed normally.
        """
        new, k = [], self.block_size
        hashes = self.chain(seq, lo + len(ids))
        for i, block in enumerate(map(int, ids), start=lo):
            if hashes[i] in self.entries or block in self.hash_of:
                continue
            parent = hashes[i - 1] if i else None
            self.entries[hashes[i]] = Entry(block, parent, tuple(seq.tokens[i * k:(i + 1) * k]))
            self.hash_of[block] = hashes[i]
            new.append(block)
        return new

    # ---- freeing and eviction ------------------------------------------------------------
    def on_release(self, refcount: np.ndarray, order: list[int],
                   taken: set[int] = frozenset()) -> None:
        """Queues cached blocks that reached refcount 0 (most recently used last).

        Args:
          refcount: [N] the pool's refcounts after the release.
          order: blocks just released, leaf first; other newly free cached blocks follow.
          taken: blocks in use again since those refcounts (hits of later calls).
        """
        for b in order + list(self.hash_of):
            if (refcount[b] == 0 and b in self.hash_of and b not in self.evictable
                    and b not in taken):
                self.evictable[b] = None

    def evict(self, n: int) -> list[int]:
        """Removes the `n` least recently used cached-free blocks; returns their ids."""
        out = []
        while self.evictable and len(out) < n:
            b, _ = self.evictable.popitem(last=False)
            del self.entries[self.hash_of.pop(b)]
            out.append(b)
        self.evicted += len(out)
        return out

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
