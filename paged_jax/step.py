"""The jitted device side of an engine step: one ragged step, and a decode window.

    run_step(params, state, batch)                    one forward over a ragged batch
      1. reserve_slots      -> blocks at boundaries, copy-on-write pairs, ok
      2. copy_blocks        -> private copies of shared last blocks
      3. model forward      -> writes K/V at slot_mapping, paged attention, logits per row
      4. forks (n > 1)      -> children share the prompt's blocks, each with its own key
      5. sample             -> per-slot parameters and keys; advance counts; stop on device

    decode_window(params, state, tokens, active)      up to W decode steps in a while_loop:
      exits early when every sequence stopped or the pool cannot grow (no host sync inside)

If `reserve_slots` reports the pool cannot cover the step, nothing else runs and the state
comes back unchanged (`ok` False): the host preempts and retries.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_jax import page_table as pt
from paged_jax import sampling as smp
from paged_jax.kv_cache import KVCache, copy_blocks
from paged_jax.models import ModelConfig, Params, forward
from paged_jax.page_table import PageTable
from paged_jax.pool import BlockPool
from paged_jax.types import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
    """Everything the device holds between steps (donated to every step)."""

    pool: BlockPool
    table: PageTable
    cache: KVCache
    sampling: smp.SamplingState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One ragged step, padded to static shapes.

    Rows are the sequences taking part (prefill chunks first, then decodes); row r owns tokens
    query_start[r] .. query_start[r+1]-1.

    Attributes:
      token_ids, positions: [T] input token and its position; padding past query_start[R].
      token_rows: [T] row of each token, -1 for padding.
      row_slots: [R] page-table slot of each row, -1 for padding rows.
      query_start: [R + 1] cumulative token offsets of the rows.
      num_new: [S] tokens each slot gains this step.
      sample: [S] slots that sample a token after this step (their prompt is complete).
      fork_src, fork_dst, fork_index: [F] children created after the forward (parallel
        sampling): dst shares src's blocks and samples with fold_in(key, index); src < 0 pads.
    """

    token_ids: Int[Array, "T"]
    positions: Int[Array, "T"]
    token_rows: Int[Array, "T"]
    row_slots: Int[Array, "R"]
    query_start: Int[Array, "R+1"]
    num_new: Int[Array, "S"]
    sample: Bool[Array, "S"]
    fork_src: Int[Array, "F"]
    fork_dst: Int[Array, "F"]
    fork_index: Int[Array, "F"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOut:
    """Per-slot results of a step (only rows with `sampled` set are meaningful)."""

    tokens: Int[Array, "S"]
    logprobs: Float[Array, "S"]
    top_ids: Int[Array, "S R"]
    top_logprobs: Float[Array, "S R"]
    sampled: Bool[Array, "S"]
    finished: Bool[Array, "S"]
    reason: Int[Array, "S"]
    ok: Bool[Array, ""]
    num_free: Int[Array, ""]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static knobs of the step functions (hashable: part of the jit cache key)."""

    model: ModelConfig
    backend: str = "reference"
    num_top_logprobs: int = 0


def _forward_rows(
    params: Params, state: EngineState, batch: StepBatch, cfg: StepConfig, max_q: int,
    max_q_rows: int | None, max_pages: int | None,
) -> tuple[Float[Array, "S V"], KVCache]:
    """Model forward over the batch's rows; logits scattered back to page-table slots.

    Attention sees only the first `max_pages` pages of each row (a static bucket covering the
    longest sequence in the step), so short contexts do not pay for max_model_len.
    """
    table = state.table
    rows_valid = batch.row_slots >= 0
    slots = jnp.clip(batch.row_slots, 0)
    seq_ids = jnp.where(batch.token_rows >= 0, batch.row_slots[batch.token_rows], -1)
    slot_map = pt.slot_mapping(table, seq_ids, batch.positions)
    seq_lens = jnp.where(rows_valid, table.seq_lens[slots], 0)
    logits, cache = forward(
        params, state.cache, batch.token_ids, batch.positions, slot_map,
        table.block_tables[slots][:, :max_pages], seq_lens, batch.query_start,
        config=cfg.model, max_q=max_q, backend=cfg.backend, max_q_rows=max_q_rows,
    )
    s = table.live.shape[0]
    dest = jnp.where(rows_valid, batch.row_slots, s)
    slot_logits = jnp.zeros((s, logits.shape[-1]), jnp.float32).at[dest].set(logits, mode="drop")
    return slot_logits, cache


def _fork_children(
    state: EngineState, logits: Float[Array, "S V"], batch: StepBatch
) -> tuple[EngineState, Float[Array, "S V"], Bool[Array, "S"]]:
    """Creates parallel-sampling children after the prompt's K/V are written."""
    pool, table = pt.fork(state.pool, state.table, batch.fork_src, batch.fork_dst)
    sampling = smp.fork_slots(state.sampling, batch.fork_src, batch.fork_dst, batch.fork_index)
    s = table.live.shape[0]
    dst = jnp.where(batch.fork_src >= 0, batch.fork_dst, s)
    logits = logits.at[dst].set(logits[jnp.clip(batch.fork_src, 0)], mode="drop")
    is_child = jnp.zeros((s,), bool).at[dst].set(True, mode="drop")
    return EngineState(pool, table, state.cache, sampling), logits, is_child


def _sample(
    state: EngineState, logits: Float[Array, "S V"], active: Bool[Array, "S"], cfg: StepConfig
) -> tuple[EngineState, StepOut]:
    res = smp.sample(logits, state.sampling, cfg.num_top_logprobs)
    sampling = smp.update_after_sample(state.sampling, res.tokens, active)
    finished, reason = smp.stop_mask(sampling, res.tokens)
    state = dataclasses.replace(state, sampling=sampling)
    out = StepOut(res.tokens, res.logprobs, res.top_ids, res.top_logprobs, active,
                  finished & active, reason, jnp.asarray(True), state.pool.num_free)
    return state, out


def _empty_out(state: EngineState, cfg: StepConfig) -> StepOut:
    s, r = state.table.live.shape[0], cfg.num_top_logprobs
    zi, zf = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.float32)
    zb = jnp.zeros((s,), bool)
    return StepOut(zi, zf, jnp.zeros((s, r), jnp.int32), jnp.zeros((s, r), jnp.float32),
                   zb, zb, zi, jnp.asarray(False), state.pool.num_free)


def step_body(
    params: Params, state: EngineState, batch: StepBatch, cfg: StepConfig, max_q: int,
    max_q_rows: int | None, max_new_blocks: int, max_pages: int | None = None,
) -> tuple[EngineState, StepOut]:
    """One ragged step (unjitted; see `run_step`)."""
    pool, table, (src, dst), ok = pt.reserve_slots(
        state.pool, state.table, batch.num_new, max_new_blocks=max_new_blocks)

    def go(_):
        st = EngineState(pool, table, copy_blocks(state.cache, src, dst), state.sampling)
        logits, cache = _forward_rows(params, st, batch, cfg, max_q, max_q_rows, max_pages)
        st, logits, children = _fork_children(dataclasses.replace(st, cache=cache), logits, batch)
        return _sample(st, logits, batch.sample | children, cfg)

    return jax.lax.cond(ok, go, lambda _: (state, _empty_out(state, cfg)), None)


@functools.partial(
    jax.jit, static_argnames=("cfg", "max_q", "max_q_rows", "max_new_blocks", "max_pages"),
    donate_argnames=("state",))
def run_step(
    params: Params, state: EngineState, batch: StepBatch, *, cfg: StepConfig, max_q: int,
    max_q_rows: int | None = None, max_new_blocks: int = 2, max_pages: int | None = None,
) -> tuple[EngineState, StepOut]:
    """One ragged step (prefill chunks and/or decodes), the state donated.

    Args:
      params: model parameters.
      state: device state (donated).
      batch: the step's tokens and rows.
      cfg: static config.
      max_q: static bound on tokens of any row.
      max_q_rows: static; only the first max_q_rows rows may have more than one token.
      max_new_blocks: static bound on blocks one slot gains in this step (copies included).
      max_pages: static bound on pages any row holds after the step (None: all P).

    Returns:
      (state', StepOut). When the pool cannot cover the step, ok is False and state' is state.
    """
    return step_body(params, state, batch, cfg, max_q, max_q_rows, max_new_blocks, max_pages)


def decode_batch(
    tokens: Int[Array, "S"], active: Bool[Array, "S"], seq_lens: Int[Array, "S"]
) -> StepBatch:
    """A decode-only batch: one token per active slot, row r = slot r, tokens compacted."""
    s = tokens.shape[0]
    query_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(active, dtype=jnp.int32)])
    dest = jnp.where(active, query_start[:-1], s)
    put = lambda fill, vals: jnp.full((s,), fill, jnp.int32).at[dest].set(vals, mode="drop")  # noqa: E731
    rows = jnp.arange(s, dtype=jnp.int32)
    no_fork = jnp.full((1,), -1, jnp.int32)
    return StepBatch(
        token_ids=put(0, tokens), positions=put(0, seq_lens), token_rows=put(-1, rows),
        row_slots=jnp.where(active, rows, -1), query_start=query_start,
        num_new=active.astype(jnp.int32), sample=active,
        fork_src=no_fork, fork_dst=no_fork, fork_index=no_fork,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowOut:
    """Tokens of up to W decode steps: step i's token of slot s is tokens[i, s] if valid[i, s]."""

    tokens: Int[Array, "W S"]
    logprobs: Float[Array, "W S"]
    top_ids: Int[Array, "W S R"]
    top_logprobs: Float[Array, "W S R"]
    valid: Bool[Array, "W S"]
    finished: Bool[Array, "S"]
    reason: Int[Array, "S"]
    steps: Int[Array, ""]
    ok: Bool[Array, ""]
    num_free: Int[Array, ""]


@functools.partial(
    jax.jit, static_argnames=("cfg", "window", "max_pages"), donate_argnames=("state",))
def decode_window(
    params: Params, state: EngineState, tokens: Int[Array, "S"], active: Bool[Array, "S"], *,
    cfg: StepConfig, window: int, max_pages: int | None = None,
) -> tuple[EngineState, WindowOut]:
    """Up to `window` decode steps in one `lax.while_loop`; the host syncs once per window.

    Args:
      params: model parameters.
      state: device state (donated).
      tokens: [S] each slot's last sampled token (the next input).
      active: [S] slots that decode.
      cfg: static config.
      window: static W, the most steps.
      max_pages: static bound on pages any slot holds by the end of the window (None: all P).

    Returns:
      (state', WindowOut). The loop stops early when every slot has stopped, or when the pool
      cannot cover the next step (ok False; that step did not run).
    """
    s, r = tokens.shape[0], cfg.num_top_logprobs
    out0 = WindowOut(
        jnp.zeros((window, s), jnp.int32), jnp.zeros((window, s), jnp.float32),
        jnp.zeros((window, s, r), jnp.int32), jnp.zeros((window, s, r), jnp.float32),
        jnp.zeros((window, s), bool), jnp.zeros((s,), bool), jnp.zeros((s,), jnp.int32),
        jnp.asarray(0), jnp.asarray(True), state.pool.num_free)

    def cond(c):
        _, _, act, out = c
        return (out.steps < window) & act.any() & out.ok

    def body(c):
        st, tok, act, out = c
        batch = decode_batch(tok, act, st.table.seq_lens)
        st, o = step_body(params, st, batch, cfg, 1, None, 2, max_pages)
        i = out.steps
        valid = o.sampled & o.ok
        out = WindowOut(
            out.tokens.at[i].set(o.tokens), out.logprobs.at[i].set(o.logprobs),
            out.top_ids.at[i].set(o.top_ids), out.top_logprobs.at[i].set(o.top_logprobs),
            out.valid.at[i].set(valid), out.finished | (o.finished & valid),
            jnp.where(o.finished & valid, o.reason, out.reason),
            i + o.ok.astype(jnp.int32), o.ok, o.num_free)
        return st, jnp.where(valid, o.tokens, tok), act & ~(o.finished & valid), out

    state, _, _, out = jax.lax.while_loop(cond, body, (state, tokens, active, out0))
    return state, out


release_slots = jax.jit(pt.release, donate_argnums=(0, 1))
"""Jitted `page_table.release`: frees finished / aborted / preempted sequences' blocks."""
