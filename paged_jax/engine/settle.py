"""What the device settles in every call, so the host never needs a call of its own for it.

    first   apply_batch_ops: the host's queued allocator work (cache/ops.py): releases of
            sequences only the host saw end (stop strings, aborts, preemption), evictions,
            beam-search forks
    last    settle: for the rows the scheduler owns, newly full blocks marked cached
            (prefix caching) and the rows that stopped (stop token, EOS, max_tokens) released
            report: the free count, each row's newly full blocks [R, G * F] and the refcounts [N]
            (the last two with prefix caching): all the host learns, in the call's one output
    run_ops a call with nothing else to do (an engine going idle, or a step whose sequences
            all wait for blocks a queued release gives back)

run_step (engine/step.py) and decode_window (engine/window.py) call these around their work.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.ops import KVOps, apply_ops
from paged_jax.cache.page_table import PageTable
from paged_jax.cache.pool import BlockPool
from paged_jax.engine import wire
from paged_jax.engine.state import EngineState, StepConfig
from paged_jax.types import Array, Bool, Int


def apply_batch_ops(state: EngineState, ops: KVOps | None) -> EngineState:
    """The host's queued allocator ops (cache/ops.py), first thing in a call."""
    if ops is None:
        return state
    pool, table = apply_ops(state.pool, state.table, ops)
    return dataclasses.replace(state, pool=pool, table=table)


def full_blocks(
    table: PageTable, slots: Int[Array, "R"], old_lens: Int[Array, "S"], width: int
) -> Int[Array, "R GF"]:
    """Each row's blocks that became full since `old_lens`, per KV cache group (group-major:
    [R, G * width]), in logical order; 0 pads, and 0 where a sliding group's window slid past
    the block inside the call (a decode window's or verify step's own slides: their few new
    tokens never fill a block and leave it in one call; run_step slides after settle)."""
    k, s = table.block_size, jnp.clip(slots, 0)
    lo, hi = old_lens[s] // k, table.seq_lens[s] // k
    col = lo[:, None] + jnp.arange(width)[None, :]
    ids = table.block_tables[:, s[:, None], jnp.clip(col, 0, table.max_blocks_per_seq - 1)]
    ids = jnp.where((col < hi[:, None]) & (slots >= 0)[:, None], ids, 0)  # [G, R, F]
    return jnp.swapaxes(ids, 0, 1).reshape(s.shape[0], -1)


def settle(
    state: EngineState, finished: Bool[Array, "R"], slots: Int[Array, "R"],
    own: Bool[Array, "R"], full: Int[Array, "R GF"], cfg: StepConfig,
    slide_cols: int | None = None,
) -> EngineState:
    """What the device decides itself at the end of a call, for the rows the scheduler owns:
    their newly full blocks in every group are marked cached (prefix caching; the host
    registers them from the report, and queues an eviction for any it will not keep), then
    those that stopped (stop token, EOS, max_tokens) are released, so the report's free
    count includes them. `slide_cols`: the windows slide between the two (page_table.slide's
    max_cols), so a block the step filled and its window left at once stays cached."""
    mine = own & (slots >= 0)
    pool = state.pool
    if cfg.prefix_caching:
        pool = pool_lib.mark_cached(pool, jnp.where(mine[:, None], full, 0).reshape(-1))
    table = state.table
    if slide_cols is not None:
        pool, table = pt.slide(pool, table, slide_cols)
    s = table.live.shape[0]
    gone = jnp.zeros((s,), bool).at[jnp.where(mine & finished, slots, s)].set(True, mode="drop")
    pool, table = pt.release(pool, table, gone)
    return dataclasses.replace(state, pool=pool, table=table)


def settle_and_report(
    state: EngineState, out, slots: Int[Array, "R"], own: Bool[Array, "R"],
    old_lens: Int[Array, "S"], cfg: StepConfig, width: int, wrote: Bool[Array, "R"],
    slide_cols: int | None = None,
):
    """`settle`, then the call's report in `out` (StepOut or WindowOut): the free count,
    newly full blocks [R, G * F] of the rows that wrote tokens, and refcounts [N] (the last two
    with prefix caching only), all of it packed into `out.wire` for the host's one read."""
    full = out.full_blocks  # [R, 0] without prefix caching
    if cfg.prefix_caching:
        full = jnp.where(out.ok & wrote[:, None],
                         full_blocks(state.table, slots, old_lens, width), 0)
    state = settle(state, out.finished, slots, own, full, cfg, slide_cols)
    refcount = state.pool.refcount if cfg.prefix_caching else out.refcount
    out = dataclasses.replace(out, num_free=state.pool.num_free, full_blocks=full,
                              refcount=refcount)
    return state, dataclasses.replace(out, wire=wire.pack(out))



@functools.partial(jax.jit, donate_argnames=("pool", "table"))
def run_ops(
    pool: BlockPool, table: PageTable, ops: KVOps
) -> tuple[BlockPool, PageTable, Int[Array, ""], Int[Array, "N"]]:
    """A call with nothing to compute but the host's queued ops (an engine going idle, or a
    step whose every sequence waits for blocks a pending release gives back).

    Returns:
      (pool', table', the free count, the refcounts).
    """
    pool, table = apply_ops(pool, table, ops)
    return pool, table, pool.num_free, pool.refcount
