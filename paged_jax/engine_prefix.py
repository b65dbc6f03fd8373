"""The engine's prefix-caching steps: make room, attach hits, register blocks, queue frees.

    schedule(free = device free stack + cached-free)   the scheduler counts evictable as free
    make_room        evict LRU cached-free blocks if the device free stack is short of the plan
    attach           a hit's blocks go into the admitted slot's row (refcount + 1)
    <step>
    register         newly filled full blocks get hashes; the new ones are marked cached
    after_release    cached blocks whose refcount reached 0 join the LRU queue (leaf first)

Everything that touches device state is a pure jitted function of the pool / page table; the
host reads the page table once per registration batch and the refcounts once per release.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import page_table as pt
from paged_jax import pool as pool_lib
from paged_jax.engine_io import pow2
from paged_jax.scheduler import Plan, blocks_needed
from paged_jax.sequence import Sequence

_attach = jax.jit(pt.attach_prefix, donate_argnums=(0, 1))
_mark = jax.jit(pool_lib.mark_cached, donate_argnums=(0,))
_evict = jax.jit(pool_lib.evict, donate_argnums=(0,))


def _ids(ids: list[int]) -> jax.Array:
    """Block ids padded with the zero block to a power of two >= 8 (few compiled shapes)."""
    out = np.zeros(pow2(len(ids), 8), np.int32)
    out[: len(ids)] = ids
    return jnp.asarray(out)


def free_total(eng) -> int:
    """Blocks the scheduler may plan with: the free stack plus evictable cached-free blocks."""
    return eng.num_free + (len(eng.prefix.evictable) if eng.prefix else 0)


def make_room(eng, plan: Plan) -> None:
    """Evicts just enough cached-free blocks for the plan to fit on the device free stack.

    A decode window may grow every sequence once more inside the loop, so it gets one block
    of headroom per sequence (evicted only if the stack is that short).
    """
    if eng.prefix is None:
        return
    k = eng.config.block_size
    need = sum(blocks_needed(s, n, k) for s, n in plan.chunks)
    if plan.decode_only:
        need = max(need, len(plan.chunks))
    ids = eng.prefix.evict(need - eng.num_free) if need > eng.num_free else []
    if ids:
        pool = _evict(eng.state.pool, _ids(ids))
        eng.state = dataclasses.replace(eng.state, pool=pool)
        eng.num_free += len(ids)


def attach(eng, seq: Sequence) -> None:
    """Puts the hit chosen at admission into seq's (live, empty) slot."""
    hit, seq.prefix_hit = seq.prefix_hit, None
    row = np.zeros(eng.state.table.max_blocks_per_seq, np.int32)
    row[: len(hit.blocks)] = hit.blocks
    pool, table = _attach(eng.state.pool, eng.state.table, jnp.asarray(seq.slot),
                          jnp.asarray(row), jnp.asarray(hit.num_tokens))
    eng.state = dataclasses.replace(eng.state, pool=pool, table=table)
    if hit.num_tokens % eng.config.block_size:
        # The step copies the last cached block; the copy is then private, and the cached
        # block may drop to refcount 0 (queued for eviction after the step).
        eng._copy_hits = [*getattr(eng, "_copy_hits", []), seq]


def register(eng, done: list[tuple[Sequence, int]]) -> None:
    """Registers full blocks filled since `(seq, num_computed before)`; one table read."""
    if eng.prefix is None:
        return
    k = eng.config.block_size
    todo = [(s, a // k, s.num_computed // k) for s, a in done
            if s.slot >= 0 and s.num_computed // k > a // k]
    if todo:
        rows = np.asarray(eng.state.table.block_tables)
        new = [b for s, lo, hi in todo for b in eng.prefix.register(s, lo, hi, rows[s.slot])]
        if new:
            eng.state = dataclasses.replace(eng.state, pool=_mark(eng.state.pool, _ids(new)))
    copied, eng._copy_hits = getattr(eng, "_copy_hits", []), []
    for s in copied:
        s.maybe_shared_last = False  # its last block is private now (a fork may set it again)
    if copied:
        after_release(eng, [])


def release_order(eng, seqs: list[Sequence]) -> list[int]:
    """Cached blocks of sequences about to be released, tail (leaf) first."""
    if eng.prefix is None:
        return []
    k, out = eng.config.block_size, []
    for s in seqs:
        full = s.num_computed // k
        out += [eng.prefix.entries[h].block for h in reversed(s.block_hashes[:full])
                if h in eng.prefix.entries]
    return out


def after_release(eng, order: list[int]) -> None:
    """Queues cached blocks nobody references any more for LRU eviction."""
    if eng.prefix is not None:
        eng.prefix.on_release(np.asarray(eng.state.pool.refcount), order)
