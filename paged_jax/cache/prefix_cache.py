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

With KV cache groups (cache/groups.py) an entry is keyed by (hash, group): a block id holds
one group's layers, and each group registers the blocks it filled. A hit must suit every group:

    full group      columns 0 .. b-1 all cached (scanned left to right, stopping at the first
                    miss: a hit of b blocks means every shorter one is there too)
    sliding group   only the columns its window reads at the hit point: first_kept(t) ..
                    ceil(t / K) - 1 for t hit tokens (scanned right to left); the columns
                    before them are attached as the zero block, as if slid past
    b               the largest length every group accepts: each sliding group lowers it to
                    its own best, repeated until none lowers it (one pass in the common case:
                    the full group sets b, and the window's blocks before b are there because
                    the sequence that registered the full group's blocks registered them too)

Blocks a window slides past leave the sequence in the step they fall behind (page_table.slide)
and join the LRU queue as any cached-free block does. When a sequence is released, its cached
blocks in every group are queued again tail first, the ones its windows slid past included: a
sliding group's block then goes no earlier than the full group's block of the same column, so
under memory pressure a hit shrinks a block at a time, as with one group, instead of losing its
window and with it the whole hit (the collapse of vLLM #48435).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Protocol

import numpy as np

from paged_jax.cache.groups import first_kept
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
      columns: per KV cache group, the block of each column 0 .. ceil(num_tokens / K) - 1 to
        attach, in logical order; 0 where a sliding group's window does not reach.
      num_tokens: tokens the sequence starts with (K * columns, or len(tokens) - 1 when the
        whole prompt hit and the last token is recomputed).
      num_evictable: hit blocks that are cached-free now: claiming them uses free capacity.
    """

    columns: tuple[tuple[int, ...], ...]
    num_tokens: int
    num_evictable: int

    @property
    def blocks(self) -> tuple[int, ...]:
        """Every block the hit attaches, group by group (the zero block left out)."""
        return tuple(b for col in self.columns for b in col if b)


def salt(seq: Hashed):
    """The parent of a sequence's first block: None, or what keys it apart (a LoRA
    adapter: Sequence.hash_salt), so equal tokens under another adapter never hit."""
    return getattr(seq, "hash_salt", None)


class PrefixCache:
    """Hash table of cached full blocks plus the LRU queue of the cached-free ones.

    Args:
      block_size: K, tokens per block.
      windows: per KV cache group, its sliding window or None (cache/groups.py).
    """

    def __init__(self, block_size: int, windows: tuple[int | None, ...] = (None,)):
        self.block_size, self.windows = block_size, windows
        # Within a column the full groups' blocks queue first (go first): a sliding group's
        # block of a column is evicted no earlier than the full group's (chain_blocks).
        self._full_first = sorted(range(len(windows)), key=lambda g: windows[g] is not None)
        self.entries: dict[tuple[int, int], Entry] = {}  # (hash, group) -> entry
        self.hash_of: dict[int, tuple[int, int]] = {}  # block id -> its entry's key
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
            parent = hashes[-1] if hashes else salt(seq)
            hashes.append(hash((parent, tuple(seq.tokens[i * k:(i + 1) * k]))))
        return hashes[:num_blocks]

    def _entry(self, seq: Hashed, i: int, group: int = 0) -> Entry | None:
        """Group `group`'s cached block i of seq (its chain holds hash i already), or None."""
        k = self.block_size
        e = self.entries.get((seq.block_hashes[i], group))
        parent = seq.block_hashes[i - 1] if i else salt(seq)
        if e is None or e.parent != parent or list(e.tokens) != seq.tokens[i * k:(i + 1) * k]:
            return None
        return e

    # ---- admission -----------------------------------------------------------------------
    def lookup(self, seq: Hashed) -> Hit:
        """The longest cached prefix of seq's tokens that every group holds (the module
        docstring), leaving at least one token to compute."""
        k, n = self.block_size, len(seq.tokens)
        b = len(self.chain(seq, n // k))
        for g, w in enumerate(self.windows):  # full groups: the leading run
            if w is None:
                b = next((i for i in range(b) if self._entry(seq, i, g) is None), b)
        sliding = [g for g, w in enumerate(self.windows) if w is not None]
        while (lower := min([b] + [self._window_hit(seq, g, b) for g in sliding])) < b:
            b = lower
        t = min(b * k, n - 1) if b else 0
        columns = tuple(tuple(self._entry(seq, i, g).block if i >= self._first(t, g) else 0
                              for i in range(cdiv(t, k))) for g in range(len(self.windows)))
        blocks = {x for col in columns for x in col if x}
        return Hit(columns, t, sum(x in self.evictable for x in blocks))

    def _first(self, t: int, group: int) -> int:
        return int(first_kept(t, self.windows[group], self.block_size))

    def _window_hit(self, seq: Hashed, group: int, b: int) -> int:
        """The largest hit of at most `b` blocks whose window columns `group` holds."""
        k, n = self.block_size, len(seq.tokens)
        for c in range(b, 0, -1):
            t = min(c * k, n - 1)
            if all(self._entry(seq, i, group) for i in range(self._first(t, group), cdiv(t, k))):
                return c
        return 0

    def acquire(self, hit: Hit) -> None:
        """The hit's blocks are in use again: no longer evictable."""
        for b in hit.blocks:
            self.evictable.pop(b, None)

    def count(self, prompt_len: int, hit_tokens: int) -> None:
        """Hit-rate bookkeeping of one admitted request."""
        self.queried_tokens += prompt_len
        self.hit_tokens += hit_tokens

    # ---- registration --------------------------------------------------------------------
    def register(self, seq: Hashed, lo: int, ids: np.ndarray | list[int],
                 group: int = 0) -> list[int]:
        """Registers group `group`'s blocks `ids`, holding seq's full blocks lo, lo + 1, ...
        (0: a column the group no longer holds, skipped).

        Returns the newly cached block ids (the device must `mark_cached` them). A block whose
        prefix is already cached elsewhere (computed twice, concurrently) stays uncached and is
        freed normally.
        """
        new, k = [], self.block_size
        hashes = self.chain(seq, lo + len(ids))
        for i, block in enumerate(map(int, ids), start=lo):
            key = (hashes[i], group)
            if not block or key in self.entries or block in self.hash_of:
                continue
            parent = hashes[i - 1] if i else salt(seq)
            self.entries[key] = Entry(block, parent, tuple(seq.tokens[i * k:(i + 1) * k]))
            self.hash_of[block] = key
            new.append(block)
        return new

    def register_call(self, seq: Hashed, lo: int, full: np.ndarray, most: int) -> list[int]:
        """Registers what one device call filled for seq: `full` [G * F], per group the
        blocks of its columns lo, lo + 1, ... (0: none, or slid past), at most `most` per
        group (what the host kept) and never past the last block the device reported (the
        hash chain is memoized: a block not full yet must not be hashed). Returns the
        reported blocks not kept (their cached marks must go)."""
        drop = []
        for g, row in enumerate(np.split(np.asarray(full), len(self.windows))):
            keep = min(most, int(np.flatnonzero(row)[-1]) + 1 if row.any() else 0)
            new = set(self.register(seq, lo, row[:keep], g)) if keep else set()
            drop += [int(b) for b in row if b and int(b) not in new]
        return drop

    def chain_blocks(self, seq: Hashed, num_blocks: int) -> list[int]:
        """The cached blocks of seq's first `num_blocks` full blocks in every group, tail
        first, the ones a window slid past included: the LRU order of a released sequence
        (module docstring)."""
        return [self.entries[h, g].block for h in reversed(seq.block_hashes[:num_blocks])
                for g in self._full_first if (h, g) in self.entries]

    # ---- freeing and eviction ------------------------------------------------------------
    def on_release(self, refcount: np.ndarray, order: list[int],
                   taken: set[int] = frozenset()) -> None:
        """Queues cached blocks that reached refcount 0 (most recently used last).

        Args:
          refcount: [N] the pool's refcounts after the release.
          order: blocks of the sequences just released, leaf first; those already queued (a
            window slid past them) move to the back with the rest. Other newly free cached
            blocks follow.
          taken: blocks in use again since those refcounts (hits of later calls).
        """
        # Vectorized: with windows this runs every step over every cached block.
        keys = np.fromiter(self.hash_of, np.int64, len(self.hash_of))
        idle = keys[np.asarray(refcount)[keys] == 0].tolist()
        fresh = set(idle) - self.evictable.keys() - set(taken)
        ordered = [b for b in order if b in self.hash_of and refcount[b] == 0 and b not in taken]
        for b in dict.fromkeys(ordered + [b for b in idle if b in fresh]):
            self.evictable[b] = None
            self.evictable.move_to_end(b)

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
