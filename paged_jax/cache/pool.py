"""BlockPool: the physical KV blocks' free list and reference counts, as a pytree.

The free list is a stack (`free_stack[:num_free]`, top at `num_free - 1`), so allocating m
blocks and freeing m blocks each cost O(m) array work, never a scan of the whole pool per block.
Every function is pure and jittable; running out of blocks is reported through an `ok` flag and
leaves the pool unchanged (nothing raises inside jit).

Prefix caching adds a third state besides free and used: *cached-free*, a block with refcount 0
whose K/V a prefix-cache entry still names (`cached[b]`). `decref` leaves such blocks off the
free stack; only `evict` (the host picks which, least recently used first) pushes them back.

    block states:  free (on the stack)  --allocate-->  used (refcount > 0)
                   used --decref to 0--> free          (not cached)
                   used --decref to 0--> cached-free   (cached: kept for a later hit)
                   cached-free --incref (prefix hit)--> used;  --evict--> free

    free_stack: [ N-1, N-2, ...,  3,  2,  1 | stale ... ]   num_free = N - 1 at start
                                          ^ top: the next block handed out is 1, then 2, ...
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.types import NULL_BLOCK, Array, Bool, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockPool:
    """Reference counts and free list of `N` physical blocks (block 0 reserved).

    Attributes:
      refcount: [N] number of page-table entries referencing each block; 0 <=> free.
      free_stack: [N] free block ids in `free_stack[:num_free]`; the rest is stale.
      num_free: [] how many blocks are free.
      cached: [N] blocks a prefix-cache entry names; at refcount 0 they are cached-free.
    """

    refcount: Int[Array, "N"]
    free_stack: Int[Array, "N"]
    num_free: Int[Array, ""]
    cached: Bool[Array, "N"]

    @property
    def num_blocks(self) -> int:
        return self.refcount.shape[0]


def init_pool(num_blocks: int) -> BlockPool:
    """A pool with every block but the zero block free."""
    return BlockPool(
        refcount=jnp.zeros((num_blocks,), jnp.int32),
        free_stack=jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.asarray(num_blocks - 1, jnp.int32),
        cached=jnp.zeros((num_blocks,), bool),
    )


def allocate(
    pool: BlockPool, counts: Int[Array, "S"], max_per_seq: int
) -> tuple[BlockPool, Int[Array, "S M"], Bool[Array, ""]]:
    """Allocates `counts[s]` fresh blocks (refcount 1) for every row s, all or nothing.

    Args:
      pool: the pool.
      counts: [S] blocks wanted per row; rows are served in order from the top of the stack.
      max_per_seq: static upper bound M on any `counts[s]` (the output width).

    Returns:
      (pool', ids [S, M] with `ids[s, :counts[s]]` the new blocks and 0 elsewhere, ok).
      When the pool cannot cover `sum(counts)`, ok is False, ids are all 0 and pool' is pool.
    """
    counts = jnp.clip(counts.astype(jnp.int32), 0, max_per_seq)
    total = counts.sum()
    ok = total <= pool.num_free
    first = jnp.cumsum(counts) - counts  # rank of each row's first block
    j = jnp.arange(max_per_seq, dtype=jnp.int32)
    rank = first[:, None] + j[None, :]
    wanted = (j[None, :] < counts[:, None]) & ok
    top = pool.num_free - 1
    ids = jnp.where(wanted, pool.free_stack[jnp.clip(top - rank, 0)], NULL_BLOCK)
    # Rows that want nothing write to index N, which mode="drop" discards.
    target = jnp.where(wanted, ids, pool.num_blocks)
    refcount = pool.refcount.at[target].set(1, mode="drop")
    num_free = pool.num_free - jnp.where(ok, total, 0)
    return dataclasses.replace(pool, refcount=refcount, num_free=num_free), ids, ok


def incref(pool: BlockPool, ids: Int[Array, "..."]) -> BlockPool:
    """Adds one reference to every non-null id in `ids` (repeats count repeatedly)."""
    ids = ids.reshape(-1)
    target = jnp.where(ids != NULL_BLOCK, ids, pool.num_blocks)
    return dataclasses.replace(pool, refcount=pool.refcount.at[target].add(1, mode="drop"))


def decref(pool: BlockPool, ids: Int[Array, "..."]) -> BlockPool:
    """Drops one reference per non-null id in `ids`; blocks reaching 0 go back on the free list.

    Freed blocks are found among `ids` (a repeated id is pushed once, at its first position),
    never by scanning the pool's refcounts; they are pushed in the order they appear in `ids`.
    Cached blocks reaching 0 stay off the free list (cached-free) until `evict`.
    """
    ids = ids.reshape(-1)
    m, n = ids.shape[0], pool.num_blocks
    pos_in_ids = jnp.arange(m, dtype=jnp.int32)
    target = jnp.where(ids != NULL_BLOCK, ids, n)
    refcount = pool.refcount.at[target].add(-1, mode="drop")
    first = jnp.full((n,), m, jnp.int32).at[target].min(pos_in_ids, mode="drop")
    freed = (ids != NULL_BLOCK) & (first[ids] == pos_in_ids) & (refcount[ids] == 0)
    freed = freed & ~pool.cached[ids]
    return _push(dataclasses.replace(pool, refcount=refcount), ids, freed)


def _push(pool: BlockPool, ids: Int[Array, "M"], push: Bool[Array, "M"]) -> BlockPool:
    """Pushes `ids[push]` (distinct) on the free stack, in order."""
    pos = jnp.where(push, pool.num_free + jnp.cumsum(push) - 1, pool.num_blocks)
    free_stack = pool.free_stack.at[pos].set(ids, mode="drop")
    return dataclasses.replace(
        pool, free_stack=free_stack, num_free=pool.num_free + push.sum(dtype=jnp.int32))


def mark_cached(pool: BlockPool, ids: Int[Array, "M"]) -> BlockPool:
    """Marks blocks as named by a prefix-cache entry (they are in use when registered)."""
    target = jnp.where(ids != NULL_BLOCK, ids, pool.num_blocks)
    return dataclasses.replace(pool, cached=pool.cached.at[target].set(True, mode="drop"))


def evict(pool: BlockPool, ids: Int[Array, "M"]) -> BlockPool:
    """Drops the cache entries of `ids` (distinct); the cached-free ones go on the free stack.

    The host chooses the victims (LRU order lives host-side); a block that is in use again is
    only unmarked, never pushed, so a stale choice cannot corrupt the free list.
    """
    ids = ids.reshape(-1)
    real = ids != NULL_BLOCK
    push = real & pool.cached[ids] & (pool.refcount[ids] == 0)
    target = jnp.where(real, ids, pool.num_blocks)
    pool = dataclasses.replace(pool, cached=pool.cached.at[target].set(False, mode="drop"))
    return _push(pool, ids, push)


def num_cached_free(pool: BlockPool) -> Int[Array, ""]:
    """Cached blocks nobody references: reusable by a hit, or evictable on demand."""
    return jnp.sum(pool.cached & (pool.refcount == 0), dtype=jnp.int32)


def num_used(pool: BlockPool) -> Int[Array, ""]:
    """Blocks in use (excludes the zero block and cached-free blocks)."""
    return pool.num_blocks - 1 - pool.num_free - num_cached_free(pool)
