"""PageTable: each sequence slot's logical -> physical block map and length, as a pytree.

    seq_lens[s] = 37, block_size K = 16           block_tables[s] = [ 7, 3, 12, 0, 0, ... ]
    logical block:   0            1            2                    ^ padding -> zero block
    tokens:      [0 .. 15] -> 7 [16 .. 31] -> 3 [32 .. 36 | 5 free positions] -> 12

A sequence of length n holds exactly ceil(n / K) blocks; only its last block may be partly
filled, and only that block is ever written. Forked sequences share blocks (refcount > 1);
the first write into a shared last block gives the writer a private copy (copy-on-write).

With KV cache groups (cache/groups.py) every sequence has one row per group, all of one
length: block_tables is [G, S, P]. A sliding-window group's row keeps only the blocks its
window still reads (`slide`); the columns before them point at the zero block. Every function
here applies to all groups at once; a model without windows has G = 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.cache import groups
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.pool import BlockPool
from paged_jax.sizes import cdiv
from paged_jax.types import NULL_BLOCK, PAD_POSITION, Array, Bool, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """Block tables of `S` sequence slots in `G` KV cache groups.

    Attributes:
      block_tables: [G, S, P] physical block of each logical block per group; 0 = none.
      seq_lens: [S] tokens held by each sequence (the same in every group).
      live: [S] whether the slot holds a sequence.
      block_size: K, token positions per block (static).
      windows: per group, its sliding window or None (static; cache/groups.py).
    """

    block_tables: Int[Array, "G S P"]
    seq_lens: Int[Array, "S"]
    live: Bool[Array, "S"]
    block_size: int = dataclasses.field(metadata=dict(static=True))
    windows: tuple = dataclasses.field(default=(None,), metadata=dict(static=True))

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[2]

    @property
    def num_groups(self) -> int:
        return self.block_tables.shape[0]

    def first_kept(self, lens: Int[Array, "S"]) -> Int[Array, "G S"]:
        """Per group, the first column each sequence of length `lens` keeps."""
        return jnp.stack([groups.first_kept(lens, w, self.block_size) for w in self.windows])


def init_page_table(cfg: CacheConfig) -> PageTable:
    """An empty page table for `cfg.max_seqs` slots of `cfg.max_blocks_per_seq` pages."""
    s, p = cfg.max_seqs, cfg.max_blocks_per_seq
    return PageTable(
        block_tables=jnp.zeros((cfg.num_groups, s, p), jnp.int32),
        seq_lens=jnp.zeros((s,), jnp.int32),
        live=jnp.zeros((s,), bool),
        block_size=cfg.block_size,
        windows=cfg.windows,
    )


def num_blocks_held(table: PageTable) -> Int[Array, "S"]:
    """ceil(seq_len / K) per slot: the columns a full-attention group holds."""
    return cdiv(table.seq_lens, table.block_size)


def add_sequence(table: PageTable, slot: Int[Array, ""] | int) -> PageTable:
    """Marks `slot` live with length 0 (the caller picks a slot that is not live)."""
    return dataclasses.replace(
        table,
        block_tables=table.block_tables.at[:, slot].set(NULL_BLOCK),
        seq_lens=table.seq_lens.at[slot].set(0),
        live=table.live.at[slot].set(True),
    )


def add_sequences(table: PageTable, slots: Int[Array, "A"]) -> PageTable:
    """`add_sequence` for several slots at once; slots < 0 are padding."""
    dest = jnp.where(slots >= 0, slots, table.live.shape[0])  # index S is dropped
    return dataclasses.replace(
        table,
        block_tables=table.block_tables.at[:, dest].set(NULL_BLOCK, mode="drop"),
        seq_lens=table.seq_lens.at[dest].set(0, mode="drop"),
        live=table.live.at[dest].set(True, mode="drop"),
    )


def release(
    pool: BlockPool, table: PageTable, slots: Bool[Array, "S"]
) -> tuple[BlockPool, PageTable]:
    """Frees the sequences in `slots`: one reference dropped from each of their blocks."""
    rows = jnp.where(slots[None, :, None], table.block_tables, NULL_BLOCK)
    pool = pool_lib.decref(pool, rows)
    table = dataclasses.replace(
        table,
        block_tables=jnp.where(slots[None, :, None], NULL_BLOCK, table.block_tables),
        seq_lens=jnp.where(slots, 0, table.seq_lens),
        live=table.live & ~slots,
    )
    return pool, table


def truncate(
    pool: BlockPool, table: PageTable, new_lens: Int[Array, "S"]
) -> tuple[BlockPool, PageTable]:
    """Shortens every slot to `new_lens` (at most its length): blocks wholly past the new end
    lose the slot's reference (speculative decoding's rollback of rejected tokens)."""
    col = jnp.arange(table.max_blocks_per_seq)[None, None, :]
    keep = cdiv(new_lens, table.block_size)[None, :, None]
    drop = (col >= keep) & (col < num_blocks_held(table)[None, :, None])
    pool = pool_lib.decref(pool, jnp.where(drop, table.block_tables, NULL_BLOCK))
    table = dataclasses.replace(
        table, block_tables=jnp.where(drop, NULL_BLOCK, table.block_tables), seq_lens=new_lens)
    return pool, table


def fork(
    pool: BlockPool, table: PageTable, src: Int[Array, "F"], dst: Int[Array, "F"]
) -> tuple[BlockPool, PageTable]:
    """Makes each slot dst[f] a copy of src[f] that shares all its blocks (refcount + 1).

    Pairs with src < 0 are padding. dst slots must not be live (release them first).
    """
    valid = src >= 0
    s = table.live.shape[0]
    dst_idx = jnp.where(valid, dst, s)  # index S is dropped
    src_idx = jnp.clip(src, 0)
    rows = table.block_tables[:, src_idx]
    pool = pool_lib.incref(pool, jnp.where(valid[None, :, None], rows, NULL_BLOCK))
    table = dataclasses.replace(
        table,
        block_tables=table.block_tables.at[:, dst_idx].set(rows, mode="drop"),
        seq_lens=table.seq_lens.at[dst_idx].set(table.seq_lens[src_idx], mode="drop"),
        live=table.live.at[dst_idx].set(True, mode="drop"),
    )
    return pool, table


def reserve_tokens(
    pool: BlockPool, table: PageTable, num_new: Int[Array, "S"], max_new_blocks: int | None = None,
    skip_slid: bool = False,
) -> tuple[BlockPool, PageTable, tuple[Int[Array, "GS"], Int[Array, "GS"]], Bool[Array, ""]]:
    """Grows every sequence s by `num_new[s]` tokens, allocating blocks only at boundaries, in
    every group.

    A sequence whose partly filled last block is shared (refcount > 1) gets a private copy of
    it first: the returned (src, dst) pairs must be copied in the KV cache (`copy_blocks`)
    before the new tokens are written. dst == 0 marks "no copy".

    Args:
      max_new_blocks: static bound on blocks any one sequence gains in one group in this
        call, copies included (e.g. 2 for decode); the work is O(G * S * max_new_blocks).
        Default P.
      skip_slid: sliding-window groups allocate only the columns their window keeps at the
        new length (a swap-in, which computes nothing; a step's queries read the whole
        chunk's columns, which `slide` drops afterwards).

    Returns:
      (pool', table', (cow_src, cow_dst) over G * S rows, ok). If the pool cannot cover every
      sequence, or a sequence would exceed P pages, ok is False and pool', table' equal pool,
      table.
    """
    k, p, g = table.block_size, table.max_blocks_per_seq, table.num_groups
    m = p if max_new_blocks is None else min(max_new_blocks, p)
    n = jnp.where(table.live, num_new.astype(jnp.int32), 0)
    old_len, new_len = table.seq_lens, table.seq_lens + n
    old_blocks, new_blocks = cdiv(old_len, k), cdiv(new_len, k)
    s = table.live.shape[0]
    rows, grp = jnp.arange(s), jnp.arange(g)
    last = table.block_tables[:, rows, jnp.clip(old_blocks - 1, 0)]  # [G, S]
    writes = jnp.tile((n > 0) & (old_len % k != 0), g)
    cow = _needs_copy(pool, last.reshape(-1), writes).reshape(g, s)
    start = old_blocks[None, :] - cow  # first column allocated: a copy replaces the last
    if skip_slid:
        start = jnp.maximum(start, table.first_kept(new_len))
    want = new_blocks[None, :] - start
    fits = jnp.all(new_blocks <= p) & jnp.all(want <= m)
    want = jnp.where(fits, want, 0)
    pool2, ids, got = pool_lib.allocate(pool, want.reshape(-1), max_per_seq=m)
    ids = ids.reshape(g, s, m)
    ok = fits & got

    j = jnp.arange(m)[None, None, :]
    col = jnp.where(j < want[..., None], start[..., None] + j, p)  # p is out of bounds: dropped
    tables = table.block_tables.at[grp[:, None, None], rows[None, :, None], col].set(
        ids, mode="drop")
    cow_dst = jnp.where(cow & ok, ids[..., 0], NULL_BLOCK).reshape(-1)
    cow_src = jnp.where(cow & ok, last, NULL_BLOCK).reshape(-1)
    pool2 = pool_lib.decref(pool2, cow_src)  # the writer no longer references the shared block

    new_table = dataclasses.replace(table, block_tables=tables, seq_lens=new_len)
    pool_out = jax.tree.map(lambda a, b: jnp.where(ok, a, b), pool2, pool)
    table_out = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_table, table)
    return pool_out, table_out, (cow_src, cow_dst), ok


def slide(pool: BlockPool, table: PageTable,
          max_cols: int | None = None) -> tuple[BlockPool, PageTable]:
    """Drops each sliding-window group's references to blocks its window no longer reads (at
    the sequences' current lengths): their columns point at the zero block, and a block no
    one else holds goes back to the pool. A no-op without windows. Run once a step's lengths
    are final (after a verify step's rollback), so a later query never needs a dropped key.

    Args:
      max_cols: static bound on the columns any window left since the last slide (a step
        that grew each sequence by at most B blocks: B + 1); only the `max_cols` columns
        before each window's start are looked at. None: every column.
    """
    local = [i for i, w in enumerate(table.windows) if w is not None]
    if not local:
        return pool, table
    local, p = jnp.asarray(local), table.max_blocks_per_seq
    rows = table.block_tables[local]  # [Gl, S, P]
    first = table.first_kept(table.seq_lens)[local][..., None]
    col = (jnp.broadcast_to(jnp.arange(p), rows.shape) if max_cols is None
           else first - 1 - jnp.arange(min(max_cols, p)))
    ids = jnp.take_along_axis(rows, jnp.clip(col, 0, p - 1), axis=2)
    drop = (col >= 0) & (col < first) & (ids != NULL_BLOCK)
    pool = pool_lib.decref(pool, jnp.where(drop, ids, NULL_BLOCK))
    s = jnp.arange(rows.shape[1])[None, :, None]
    tables = table.block_tables.at[local[:, None, None], s, jnp.where(drop, col, p)].set(
        NULL_BLOCK, mode="drop")
    return pool, dataclasses.replace(table, block_tables=tables)


def _needs_copy(
    pool: BlockPool, last: Int[Array, "S"], writes: Bool[Array, "S"]
) -> Bool[Array, "S"]:
    """Rows whose partly filled last block is shared and must be copied before the write.

    When every holder of a shared block writes in this same call, the first of them keeps the
    block and only the others copy (what a sequential copy-on-write would do). Writers per
    block are counted with scatters into [N] arrays: O(N + S), not O(S^2). A block the prefix
    cache names is shared with the cache: it is always copied, never written in place (this
    happens when a whole prompt was a cache hit and its last token is recomputed).
    """
    n = pool.num_blocks
    rows = jnp.arange(last.shape[0])
    cached = pool.cached[last]
    cand = writes & ((pool.refcount[last] > 1) | cached)
    target = jnp.where(cand, last, n)
    writers = jnp.zeros((n,), jnp.int32).at[target].add(1, mode="drop")
    first = jnp.full((n,), last.shape[0], jnp.int32).at[target].min(rows, mode="drop")
    keeper = cand & ~cached & (writers[last] == pool.refcount[last]) & (first[last] == rows)
    return cand & ~keeper


def attach_prefix(
    pool: BlockPool, table: PageTable, slot: Int[Array, ""], blocks: Int[Array, "G P"],
    num_tokens: Int[Array, ""],
) -> tuple[BlockPool, PageTable]:
    """Gives live, empty `slot` the cached blocks of a prefix hit: rows, length, refcount + 1.

    Args:
      blocks: [G, P] the hit's blocks per group in logical order, 0-padded (a sliding
        group's columns before its window too).
      num_tokens: tokens the slot now holds (<= K * number of blocks; the last block may be
        only partly counted when the last prompt token is recomputed).
    """
    pool = pool_lib.incref(pool, blocks)
    table = dataclasses.replace(
        table,
        block_tables=table.block_tables.at[:, slot].set(blocks),
        seq_lens=table.seq_lens.at[slot].set(num_tokens),
    )
    return pool, table


def attach_prefixes(
    pool: BlockPool, table: PageTable, slots: Int[Array, "A"], blocks: Int[Array, "A G P"],
    num_tokens: Int[Array, "A"],
) -> tuple[BlockPool, PageTable]:
    """`attach_prefix` for several live, empty slots at once; slots < 0 are padding.

    A row of all-zero blocks with num_tokens 0 (no hit) changes nothing but the zero length.
    """
    valid = slots >= 0
    dest = jnp.where(valid, slots, table.live.shape[0])
    pool = pool_lib.incref(pool, jnp.where(valid[:, None, None], blocks, NULL_BLOCK))
    table = dataclasses.replace(
        table,
        block_tables=table.block_tables.at[:, dest].set(jnp.swapaxes(blocks, 0, 1), mode="drop"),
        seq_lens=table.seq_lens.at[dest].set(num_tokens, mode="drop"),
    )
    return pool, table


def cache_positions(
    table: PageTable, seq_ids: Int[Array, "T"], positions: Int[Array, "T"]
) -> Int[Array, "G T"]:
    """Flat cache position (block * K + offset) of each token in each group; PAD_POSITION where
    seq_ids < 0."""
    k = table.block_size
    seq = jnp.clip(seq_ids, 0)
    page = jnp.clip(positions // k, 0, table.max_blocks_per_seq - 1)
    block = table.block_tables[:, seq, page]
    return jnp.where(seq_ids >= 0, block * k + positions % k, PAD_POSITION)


def row_paging(
    table: PageTable, row_slots: Int[Array, "R"], token_rows: Int[Array, "T"],
    positions: Int[Array, "T"], max_pages: int | None = None,
) -> tuple[Int[Array, "G T"], Int[Array, "G R P2"], Int[Array, "R"]]:
    """What a ragged forward over rows reads of the page tables, per group: each token's cache
    position (padding tokens' and padding rows' PAD_POSITION), each row's first `max_pages`
    pages; and each row's length (0 for a padding row, slot -1)."""
    slots = jnp.clip(row_slots, 0)
    seq_ids = jnp.where(token_rows >= 0, row_slots[jnp.clip(token_rows, 0)], -1)
    return (cache_positions(table, seq_ids, positions),
            table.block_tables[:, slots][:, :, :max_pages],
            jnp.where(row_slots >= 0, table.seq_lens[slots], 0))
