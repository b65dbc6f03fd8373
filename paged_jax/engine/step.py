"""The jitted device side of an engine step: one ragged step, and a decode window.

A step runs over *rows*, not over every sequence slot: row r computes the tokens of slot
row_slots[r], and the host pads the rows to a power-of-two bucket of the sequences that run
(StepShape and batch.py hold the bucket rules). A step over one sequence costs one row.

    run_step(params, state, batch)                    one forward over a ragged batch
      0. ops                -> the host's queued allocator work (cache/ops.py): releases,
                               evictions, forks
         admissions         -> slots going live: table row reset, prefix-cache hit attached,
                               sampling parameters written (new requests)
      1. reserve_tokens      -> blocks at boundaries, copy-on-write pairs, ok
      2. copy_blocks        -> private copies of shared last blocks
      3. model forward      -> writes K/V at cache_positions, paged attention, logits per row;
                               then sliding-window groups drop the blocks their windows left
                               (page_table.slide, once the lengths are final)
      4. forks (n > 1)      -> children share the prompt's blocks, each with its own key
      5. sample             -> per-row parameters and keys; advance counts; stop on device
      6. settle             -> what the device decides itself, for the rows the scheduler
                               owns: newly full blocks marked cached (prefix caching), rows
                               that stopped released
      7. report             -> the free count, and with prefix caching each row's newly full
                               blocks and the pool's refcounts: all the host learns, in the
                               call's one output

The decode window (paged_jax/engine/window.py) runs `step_body` up to W times in a while_loop;
a verify step (paged_jax/engine/verify.py, speculative decoding) runs steps 1-3, then samples
every token and rolls back what it rejected.

If `reserve_tokens` reports the pool cannot cover the step, steps 1-5 do not run and the state
comes back as it was after the ops and admissions (`ok` False): the host preempts and retries.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.kv_cache import KVCache, copy_blocks
from paged_jax.engine import draft, settle
from paged_jax.engine.state import EngineState, StepConfig
from paged_jax.engine.step_types import Admissions, StepBatch, StepOut, StepShape  # noqa: F401
from paged_jax.models import Params, forward, parallel
from paged_jax.sample import sampler as smp
from paged_jax.types import Array, Bool, Float, Int


def _admit(state: EngineState, adm: Admissions | None) -> EngineState:
    """Applies a step's admissions: rows reset, prefix hits attached, sampling rows written."""
    if adm is None:
        return state
    table = pt.add_sequences(state.table, adm.slot)
    pool, table = pt.attach_prefixes(state.pool, table, adm.slot, adm.hit_blocks, adm.hit_tokens)
    new = jnp.where(adm.new_request, adm.slot, -1)
    sampling = smp.admit_rows(state.sampling, new, adm.sampling, adm.prompt_mask,
                              adm.logit_bias)
    return dataclasses.replace(state, pool=pool, table=table, sampling=sampling)


def _copies(
    src: Int[Array, "S"], dst: Int[Array, "S"], max_copies: int
) -> tuple[tuple[Int[Array, "C"], Int[Array, "C"]], Bool[Array, ""]]:
    """The copy-on-write pairs (dst != 0) packed into `max_copies` entries, and whether they fit.

    Copying costs a gather and a scatter of C blocks in every layer, so steps copy only as
    many blocks as the host says may be shared (usually none).
    """
    wanted = dst != 0
    fits = wanted.sum() <= max_copies
    if not max_copies:
        return (src[:0], dst[:0]), fits
    (idx,) = jnp.nonzero(wanted, size=max_copies, fill_value=src.shape[0])
    take = lambda a: jnp.where(idx < a.shape[0], a[jnp.clip(idx, 0, a.shape[0] - 1)], 0)  # noqa: E731
    return (take(src), take(dst)), fits


def _num_new(batch: StepBatch, num_slots: int) -> Int[Array, "S"]:
    """Tokens each slot gains: its row's token count (padding rows dropped)."""
    per_row = batch.query_start[1:] - batch.query_start[:-1]
    dest = jnp.where(batch.row_slots >= 0, batch.row_slots, num_slots)
    return jnp.zeros((num_slots,), jnp.int32).at[dest].add(per_row, mode="drop")


def forward_rows(
    params: Params, state: EngineState, batch: StepBatch, cfg: StepConfig, shape: StepShape
) -> tuple[Float[Array, "Q V"], KVCache, smp.PromptLogprobs, Float[Array, "R E"]]:
    """Model forward over the batch's rows: logits of each row's last token (Q = R; a verify
    step's are every token's, Q = T), the prompt logprobs of every token and each row's last
    hidden state (empty unless the shape asks).

    Attention sees only the first `max_pages` pages of each row (a static bucket covering the
    longest sequence in the step), so short contexts do not pay for max_model_len.
    """
    cache_pos, tables, seq_lens = pt.row_paging(state.table, batch.row_slots, batch.token_rows,
                                                batch.positions, shape.max_pages)
    every = shape.prompt_top is not None or shape.verify > 0
    args = (batch.token_ids, batch.positions, cache_pos, tables, seq_lens, batch.query_start)
    kw = dict(max_q=shape.max_q, backend=cfg.backend, max_q_rows=shape.max_q_rows,
              decode_pages=shape.decode_pages, all_logits=every, with_hidden=shape.hidden)
    if shape.lora:
        kw["lora_slots"] = token_adapters(params["lora"]["kv_slot"], batch)
    logits, cache = parallel.sharded_forward(  # plain `forward` without a mesh
        cfg.mesh, cfg.forward or forward, cfg.model, params, state.cache, *args, **kw)
    logits, hidden = logits if shape.hidden else (logits, _no_hidden(batch.row_slots.shape[0]))
    if not every or shape.verify:  # a verify step samples every token (engine/verify.py)
        return logits, cache, smp.PromptLogprobs.empty(), hidden
    prompt = smp.prompt_logprobs(logits, batch.next_ids, shape.prompt_top)
    return logits[jnp.clip(batch.query_start[1:] - 1, 0)], cache, prompt, hidden


def token_adapters(kv_slot: Int[Array, "S"], batch: StepBatch) -> Int[Array, "T"]:
    """Each token's adapter slot (-1: none, and for padding): its row's KV slot's."""
    slot = batch.row_slots[jnp.clip(batch.token_rows, 0)]
    live = (batch.token_rows >= 0) & (slot >= 0)
    return jnp.where(live, kv_slot[jnp.clip(slot, 0)], -1)


def _no_hidden(rows: int) -> Float[Array, "R 0"]:
    return jnp.zeros((rows, 0), jnp.float32)


def _fork_children(
    state: EngineState, logits: Float[Array, "R V"], batch: StepBatch
) -> tuple[EngineState, Float[Array, "R V"]]:
    """Creates parallel-sampling children after the prompt's K/V are written."""
    valid = batch.fork_src >= 0
    src = jnp.where(valid, batch.row_slots[jnp.clip(batch.fork_src, 0)], -1)
    dst = batch.row_slots[jnp.clip(batch.fork_dst, 0)]
    pool, table = pt.fork(state.pool, state.table, src, dst)
    sampling = smp.fork_slots(state.sampling, src, dst, batch.fork_index)
    rows = jnp.where(valid, batch.fork_dst, logits.shape[0])
    logits = logits.at[rows].set(logits[jnp.clip(batch.fork_src, 0)], mode="drop")
    return dataclasses.replace(state, pool=pool, table=table, sampling=sampling), logits


def _sample(
    state: EngineState, logits: Float[Array, "R V"], slots: Int[Array, "R"],
    active: Bool[Array, "R"], flags: smp.SampleFlags, masks: Int[Array, "R W"] | None = None,
) -> tuple[EngineState, StepOut]:
    with jax.named_scope("sampling"):  # experiments/step_profile.py's kinds
        rows = smp.rows_view(state.sampling, slots, flags.penalties, flags.bias)
        res = smp.sample(logits, rows, flags=flags, masks=masks, active=active)
        sampling = smp.update_rows(state.sampling, slots, res.tokens, active, flags.penalties)
        counted = dataclasses.replace(rows, num_generated=rows.num_generated + active)
        finished, reason = smp.stop_mask(counted, res.tokens)
    r = slots.shape[0]
    out = StepOut(res.tokens, res.logprobs, res.top_ids, res.top_logprobs, active,
                  finished & active, reason, jnp.asarray(True), state.pool.num_free,
                  smp.PromptLogprobs.empty(), _no_hidden(r), jnp.zeros((r, 0), jnp.int32),
                  jnp.zeros((0,), jnp.int32))
    return dataclasses.replace(state, sampling=sampling), out


def _empty_out(state: EngineState, rows: int, tokens: int, shape: StepShape,
               width: int) -> StepOut:
    j = shape.flags.num_top_logprobs
    zi, zf, zb = (jnp.zeros((rows,), t) for t in (jnp.int32, jnp.float32, bool))
    prompt = (smp.PromptLogprobs.empty() if shape.prompt_top is None
              else smp.PromptLogprobs.empty(tokens, shape.prompt_top))
    return StepOut(zi, zf, jnp.zeros((rows, j), jnp.int32), jnp.zeros((rows, j), jnp.float32),
                   zb, zb, zi, jnp.asarray(False), state.pool.num_free, prompt,
                   jnp.zeros((rows, width if shape.hidden else 0), jnp.float32),
                   jnp.zeros((rows, 0), jnp.int32), jnp.zeros((0,), jnp.int32))


def _resolve(state: EngineState, batch: StepBatch) -> StepBatch:
    """What only the device knows under async scheduling (the host plans a step before it
    has read the previous one): an input token of -1 is the slot's last sampled token, and a
    row whose slot the previous step released (it stopped there) computes nothing: its
    tokens become padding. Fork children's slots go live later in the step: they stay."""
    tok, rows = batch.token_ids, batch.token_rows
    r = batch.row_slots.shape[0]
    child = jnp.zeros((r,), bool).at[jnp.where(batch.fork_src >= 0, batch.fork_dst, r)].set(
        True, mode="drop")
    slots = jnp.clip(batch.row_slots, 0)
    alive = (batch.row_slots >= 0) & (state.table.live[slots] | child)
    row_of = jnp.clip(rows, 0)
    tok = jnp.where(tok < 0, state.sampling.last_token[slots[row_of]], tok)
    return dataclasses.replace(
        batch, token_ids=tok, token_rows=jnp.where((rows >= 0) & alive[row_of], rows, -1),
        row_slots=jnp.where(alive, batch.row_slots, -1), sample=batch.sample & alive)


def _reserve(
    state: EngineState, batch: StepBatch, shape: StepShape
) -> tuple[pool_lib.BlockPool, pt.PageTable, tuple[Int[Array, "C"], Int[Array, "C"]],
           Bool[Array, ""]]:
    """Grows each row's slot by its tokens (blocks at boundaries, copy-on-write pairs packed
    into shape.max_copies): (pool', table', (src, dst) copies, ok). Not ok: the pool cannot
    cover the step, or it needs more copies than the shape holds; pool and table unchanged."""
    num_new = _num_new(batch, state.table.live.shape[0])
    pool, table, (src, dst), ok = pt.reserve_tokens(
        state.pool, state.table, num_new, max_new_blocks=shape.max_new_blocks)
    (src, dst), fits = _copies(src, dst, shape.max_copies)
    pool, table = jax.tree.map(lambda a, b: jnp.where(fits, a, b), (pool, table),
                               (state.pool, state.table))
    return pool, table, (src, dst), ok & fits


def forward_if_room(params: Params, state: EngineState, batch: StepBatch, cfg: StepConfig,
                    shape: StepShape, after, empty, prepare=None, slide: bool = True):
    """Steps 1-3 (reserve, copy, forward), then `after(state', logits, prompt logprobs,
    hidden, batch, extra)` -> (state'', out); when the pool cannot cover the step, (state,
    empty) with nothing changed. Shared by `step_body` and the verify step (engine/verify.py),
    whose `prepare(state', batch) -> (state', batch', extra)` runs between the copies and the
    forward (a draft model writes its K/V into the blocks just reserved and fills in the
    drafts; extra is (their distributions, the drafts each row verifies): engine/draft.py)."""
    pool, table, (src, dst), ok = _reserve(state, batch, shape)

    def go(carry):
        st, _ = carry  # the state with the step's blocks reserved
        copy = (lambda c: copy_blocks(c, src, dst)) if shape.max_copies else (lambda c: c)
        draft = None if st.draft is None else copy(st.draft)
        st = dataclasses.replace(st, cache=copy(st.cache), draft=draft)
        st, b, extra = (st, batch, None) if prepare is None else prepare(st, batch)
        logits, cache, prompt, hidden = forward_rows(params, st, b, cfg, shape)
        st, out = after(dataclasses.replace(st, cache=cache), logits, prompt, hidden, b, extra)
        if not slide:  # the caller slides (run_step: after its new full blocks are cached)
            return st, out
        # Lengths are final: windows move on, by at most the blocks a row gained (+ 1).
        pool2, table2 = pt.slide(st.pool, st.table, shape.max_new_blocks + 1)
        return dataclasses.replace(st, pool=pool2, table=table2), out

    # Not ok: reserve changed nothing, so the state comes back as it was.
    return run_once(ok, go, (dataclasses.replace(state, pool=pool, table=table), empty))


def run_once(pred: Bool[Array, ""], fn, init):
    """fn(init) if pred else init: lax.cond's meaning as a while loop of at most one trip.
    XLA copies a whole buffer that a conditional's branch updates in place more than once
    (with KV cache groups several layers write each K/V buffer: a 9x slower decode step
    measured), while a loop body updates its carry in place."""
    body = lambda carry: (fn(carry[0]), jnp.asarray(False))  # noqa: E731
    return jax.lax.while_loop(lambda carry: carry[1], body, (init, pred))[0]


def step_body(
    params: Params, state: EngineState, batch: StepBatch, cfg: StepConfig, shape: StepShape,
    dparams: Params | None = None, slide: bool = True,
) -> tuple[EngineState, StepOut]:
    """One ragged step after its ops and admissions (unjitted; see `run_step`); with a draft
    model's `dparams`, the draft reads the step's tokens too (draft.prefill). `slide`: the
    windows move on at the end (else the caller slides them)."""

    def after(st, logits, prompt, hidden, *_):
        st, logits = _fork_children(st, logits, batch)
        st, out = _sample(st, logits, batch.row_slots, batch.sample & (batch.row_slots >= 0),
                          shape.flags, batch.masks)
        return st, dataclasses.replace(out, prompt=prompt, hidden=hidden)

    rows, tokens = batch.row_slots.shape[0], batch.token_ids.shape[0]
    empty = _empty_out(state, rows, tokens, shape, cfg.model.hidden_size)
    prepare = None if dparams is None else (
        lambda st, b: (draft.prefill(dparams, st, b, cfg, shape), b, None))
    return forward_if_room(params, state, batch, cfg, shape, after, empty, prepare, slide)


@functools.partial(jax.jit, static_argnames=("cfg", "shape"), donate_argnames=("state",))
def run_step(
    params: Params, state: EngineState, batch: StepBatch, dparams: Params | None = None, *,
    cfg: StepConfig, shape: StepShape,
) -> tuple[EngineState, StepOut]:
    """One ragged step (prefill chunks and/or decodes), the state donated.

    Args:
      params: model parameters (runtime form, models.llama.prepare_params).
      state: device state (donated).
      batch: the step's ops, admissions, tokens and rows.
      dparams: speculative decoding's draft model, which reads the tokens too (draft.py).
      cfg: static engine config.
      shape: static bounds of this step.

    Returns:
      (state', StepOut per row). When the pool cannot cover the step, ok is False and state'
      is the state after the ops and admissions (nothing sampled, nothing settled).
    """
    with jax.named_scope("bookkeeping"):
        state = _admit(settle.apply_batch_ops(state, batch.ops), batch.admit)
        batch = _resolve(state, batch)
    old_lens = state.table.seq_lens  # after the hits: their blocks are not new
    # The windows slide in settle, once the step's full blocks are cached: a chunk longer
    # than a window fills blocks its own slide drops, and those stay cached (prefix hits).
    state, out = step_body(params, state, batch, cfg, shape, dparams, slide=False)
    own = batch.own if batch.own is not None else jnp.zeros_like(batch.sample)
    # Fork children wrote nothing: their blocks are their parent's, reported in its row.
    wrote = batch.query_start[1:] > batch.query_start[:-1]
    with jax.named_scope("bookkeeping"):
        return settle.settle_and_report(state, out, batch.row_slots, own, old_lens, cfg,
                                        shape.full_width, wrote, shape.max_new_blocks + 1)
