"""The engine's prefix-caching steps: make room, attach hits, register blocks, queue frees.

    schedule(free = device free stack + cached-free)   the scheduler counts evictable as free
    make_room        evict LRU cached-free blocks if the device free stack is short of the plan
    take_hit         the hit chosen at admission, for the step's Admissions (the step puts its
                     blocks into the admitted slot's row, refcount + 1)
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

from paged_jax import pool as pool_lib
from paged_jax.batch import next_pow2
from paged_jax.prefix_cache import Hit
from paged_jax.scheduler import Plan, blocks_needed
from paged_jax.sequence import Sequence

_mark = jax.jit(pool_lib.mark_cached, donate_argnums=(0,))
_evict = jax.jit(pool_lib.evict, donate_argnums=(0,))


def _ids(ids: list[int]) -> jax.Array:
    """Block ids padded with the zero block to a power of two >= 8 (few compiled shapes)."""
    out = np.zeros(next_pow2(len(ids), 8), np.int32)
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


def take_hit(eng, seq: Sequence) -> Hit | None:
    """The hit chosen for seq at admission (the step attaches it on the device)."""
    hit, seq.prefix_hit = seq.prefix_hit, None
    if hit is not None and hit.num_tokens % eng.config.block_size:
        # The step copies the last cached block; the copy is then private, and the cached
        # block may drop to refcount 0 (queued for eviction after the step).
        eng.copy_hits.append(seq)
    return hit


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
    copied, eng.copy_hits = eng.copy_hits, []
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
