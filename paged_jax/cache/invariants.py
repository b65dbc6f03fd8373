"""Allocator invariants, checked on the host after any operation (tests, notebooks).

    refcount[b] == number of live block-table entries that reference b   (b >= 1)
    free list   == exactly the blocks with refcount 0 that are not cached (block 0 excluded),
                   no duplicates
    cached-free == cached blocks with refcount 0: off the free list, waiting for a hit or eviction
    free + used + cached-free == num_blocks - 1
    a live sequence of length n holds, in each full-attention group, exactly ceil(n / K)
    blocks in its first columns; in a sliding-window group (cache/groups.py) exactly the
    columns first_kept(n) .. ceil(n / K) - 1 (the rest point at the zero block)
"""

from __future__ import annotations

import numpy as np

from paged_jax.cache.groups import first_kept
from paged_jax.cache.page_table import PageTable
from paged_jax.cache.pool import BlockPool
from paged_jax.sizes import cdiv
from paged_jax.types import NULL_BLOCK


class InvariantError(AssertionError):
    """An allocator invariant does not hold."""


def _check(cond: bool | np.bool_, msg: str) -> None:
    if not cond:
        raise InvariantError(msg)


def check_invariants(pool: BlockPool, table: PageTable) -> None:
    """Raises InvariantError naming the first broken invariant."""
    ref = np.asarray(pool.refcount)
    n_blocks = ref.shape[0]
    num_free = int(pool.num_free)
    free = np.asarray(pool.free_stack)[:num_free]
    tables = np.asarray(table.block_tables)
    lens = np.asarray(table.seq_lens)
    live = np.asarray(table.live)
    k = table.block_size

    _check(ref[NULL_BLOCK] == 0, f"zero block has refcount {ref[NULL_BLOCK]}")
    _check(NULL_BLOCK not in free, "zero block is on the free list")
    _check(len(set(free.tolist())) == num_free, f"duplicate ids on the free list {sorted(free)}")
    _check(bool(np.all((free > 0) & (free < n_blocks))), f"bad ids on the free list {free}")
    _check(bool(np.all(ref >= 0)), f"negative refcounts at {np.nonzero(ref < 0)[0]}")

    counts = np.bincount(tables[:, live].reshape(-1), minlength=n_blocks)
    counts[NULL_BLOCK] = 0
    bad = np.nonzero(counts != ref)[0]
    _check(bad.size == 0, f"refcount != table references for blocks {bad.tolist()}: "
                          f"refcount {ref[bad].tolist()} vs references {counts[bad].tolist()}")
    _check(bool(np.all(ref[free] == 0)), "a block on the free list has references")
    cached = np.asarray(pool.cached)
    _check(not cached[NULL_BLOCK], "the zero block is marked cached")
    _check(not cached[free].any(), f"cached blocks on the free list {free[cached[free]]}")
    used = int(np.count_nonzero(ref[1:]))
    cached_free = int(np.count_nonzero(cached & (ref == 0)))
    _check(used + num_free + cached_free == n_blocks - 1,
           f"free ({num_free}) + used ({used}) + cached-free ({cached_free}) "
           f"!= num_blocks - 1 ({n_blocks - 1})")

    for g, window in enumerate(table.windows):
        _check_rows(tables[g], lens, live, k, window, f"group {g}: " if g else "")


def _check_rows(tables: np.ndarray, lens: np.ndarray, live: np.ndarray, k: int,
                window: int | None, where: str) -> None:
    """One group's rows hold exactly the columns its window keeps (all of them without)."""
    for s in range(tables.shape[0]):  # messages built only on failure: this runs per step
        if not live[s]:
            if lens[s] != 0 or tables[s].any():
                raise InvariantError(f"{where}dead slot {s} holds blocks or length")
            continue
        lo, held = first_kept(int(lens[s]), window, k), cdiv(int(lens[s]), k)
        row = tables[s]
        if not np.all(row[lo:held] != NULL_BLOCK):
            raise InvariantError(f"{where}seq {s} (len {lens[s]}) misses a block in pages "
                                 f"{lo}..{held - 1}: {row}")
        if row[held:].any() or row[:lo].any():
            raise InvariantError(f"{where}seq {s} (len {lens[s]}) holds blocks outside pages "
                                 f"{lo}..{held - 1}: {row}")
