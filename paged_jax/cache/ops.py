"""Allocator work the host queues between device calls, applied first thing in the next one.

The device releases what it can decide itself (a sequence that stops on a stop token or at
max_tokens, in the call that samples that token: engine/step.py's `settle`). What only the
host knows -- a stop string, an abort, a preemption, the prefix cache's choice of victims,
beam search's forks -- is queued here and done inside the next jitted call, so no step needs
a jitted call or a device -> host read of its own for bookkeeping:

    apply_ops(pool, table, ops):
      1. release  slots of sequences the host ended or preempted: one reference dropped from
                  each of their blocks (cached ones at 0 become cached-free)
      2. evict    cached blocks the host chose: unmarked, and back on the stack if free
                  (least recently used cached-free blocks, or duplicates of a cached prefix)
      3. fork     slot dst becomes a copy of slot src sharing all its blocks (beam search)

The order matters: an eviction of a block released in the same call frees it; a released
slot can be a fork's destination. Every field has a static shape ([N] and [S] masks, [S]
pairs), so queueing ops never compiles a new program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.page_table import PageTable
from paged_jax.cache.pool import BlockPool
from paged_jax.types import Array, Bool, HostArray, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVOps:
    """One call's allocator ops (see the module docstring for their order).

    Attributes:
      release: [S] slots to release.
      evict: [N] cached blocks to unmark (and push back on the free stack if free).
      fork_src, fork_dst: [S] slot pairs: dst becomes a sharing copy of src; src < 0 pads.
    """

    release: Bool[HostArray, "S"]
    evict: Bool[HostArray, "N"]
    fork_src: Int[HostArray, "S"]
    fork_dst: Int[HostArray, "S"]


def no_ops(num_blocks: int, num_slots: int) -> dict[str, np.ndarray]:
    """Host arrays of a KVOps that does nothing (fill them in)."""
    return dict(release=np.zeros(num_slots, bool),
                evict=np.zeros(num_blocks, bool), fork_src=np.full(num_slots, -1, np.int32),
                fork_dst=np.zeros(num_slots, np.int32))


def _ids(mask: Bool[Array, "N"]) -> Int[Array, "N"]:
    """The ids set in a block mask, padded with the zero block (which every op ignores)."""
    (ids,) = jnp.nonzero(mask, size=mask.shape[0], fill_value=0)
    return ids.astype(jnp.int32)


def apply_ops(pool: BlockPool, table: PageTable, ops: KVOps) -> tuple[BlockPool, PageTable]:
    """Applies `ops` in order: release, evict, fork (pure; see the module docstring)."""
    pool, table = pt.release(pool, table, ops.release)
    pool = pool_lib.evict(pool, _ids(ops.evict))
    return pt.fork(pool, table, ops.fork_src, ops.fork_dst)
