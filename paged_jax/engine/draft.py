"""Speculative decoding with a draft model, device side: the drafts of a verify step.

A draft model (a smaller model over the same vocabulary) keeps its own K/V pages,
`EngineState.draft`, under the target's block ids and page tables: a block reserved for the
target holds the draft's K/V at the same place, so the draft's blocks are allocated, shared,
copied on write, cached and freed with the target's, and the pool's block size counts both.

Every ragged step (step.run_step: prompts, mixed steps) also runs the draft over its tokens
(`prefill`), so the draft has read a prompt when its sequence starts to speculate. Inside a
verify call (engine/verify.py), after the target's blocks are reserved and before its
forward, `propose` runs:

    catch-up   one ragged draft forward over each row's tokens the draft has not seen
               (host-tracked: Sequence.draft_computed .. the pending token; 1-2 tokens
               once a sequence speculates; more after decode windows, a swap-in or a
               recompute)
    k drafts   from the last catch-up logits, then K - 1 one-token draft steps in a loop:
               draft j + 1 is drawn from q_j, the draft's distribution after the row's own
               sampling processing (temperature, top-k / top-p / min-p, bias, min_tokens)
    fill       row r's verify tokens after its pending one become its k_r drafts

Its K/V cannot change what is emitted, only how much is accepted: every emitted token is the
target's (engine/verify.py). So a prefix-cache hit's blocks are trusted to hold the draft's
K/V as well (their prompts went through `prefill`; a position a verify step kept without
the draft reading it is stale, which only costs acceptance), while a swapped-in sequence,
whose draft pages were not kept, starts over (draft_computed 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.cache import kv_cache as kvc
from paged_jax.cache import page_table as pt
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.groups import KVGroups
from paged_jax.cache.kv_cache import KVCache
from paged_jax.engine.state import EngineState, StepConfig
from paged_jax.engine.step_types import StepBatch, StepShape
from paged_jax.models import ModelConfig, Params, forward
from paged_jax.sample import sampler as smp
from paged_jax.types import Array, Float, HostArray, Int

DRAW_SALT = 0x5EED
"""Key stream of the draft's draws (fold_in(fold_in(key, num_generated + j), DRAW_SALT)):
apart from the target's sampling key and verify's acceptance stream."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """The draft's catch-up tokens of one verify call and each row's draft count.

    Attributes:
      token_ids, positions: [C] tokens the draft has not seen, row by row; padding past
        query_start[R].
      token_rows: [C] row of each token, -1 for padding.
      seq_lens: [R] each row's draft context after the catch-up (0: the row has none).
      num_drafts: [R] drafts row r verifies (0 when its catch-up does not reach its pending
        token yet, or it does not speculate).
      query_start: [R + 1] cumulative offsets of the rows' catch-up tokens.
    """

    token_ids: Int[HostArray, "C"]
    positions: Int[HostArray, "C"]
    token_rows: Int[HostArray, "C"]
    seq_lens: Int[HostArray, "R"]
    num_drafts: Int[HostArray, "R"]
    query_start: Int[HostArray, "R+1"]  # after R's fields: jaxtyping binds R first


def init_cache(dm: ModelConfig, cc: CacheConfig, kv_dtype, groups: KVGroups | None) -> KVCache:
    """The draft model's pages (all zero) under the target's block ids; on a hybrid cache
    every draft layer reads a full-attention group's page tables, which hold every block of
    a sequence (kv_cache.reading_group)."""
    cache = kvc.init_kv_cache(dm.num_layers, dm.num_kv_heads, cc.num_blocks, cc.block_size,
                              dm.head_dim, kv_dtype)
    if groups is not None and groups.hybrid:
        cache = kvc.reading_group(cache, groups.full_group)
    return cache


def _draft_forward(dparams: Params, st: EngineState, cfg: StepConfig, shape: StepShape,
                   slots: Int[Array, "R"], tokens, positions, token_rows, query_start,
                   seq_lens=None, **hints):
    """One draft forward over a ragged batch in the rows' pages (`seq_lens`: the rows'
    lengths, default the page tables'): (last logits per row, the draft's K/V)."""
    cache_pos, tables, lens = pt.row_paging(st.table, slots, token_rows, positions,
                                            shape.max_pages)
    return forward(dparams, st.draft, tokens, positions, cache_pos, tables,
                   lens if seq_lens is None else seq_lens, query_start,
                   config=cfg.draft_model, backend=cfg.backend, **hints)


def prefill(dparams: Params, st: EngineState, batch: StepBatch, cfg: StepConfig,
            shape: StepShape) -> EngineState:
    """A ragged step's tokens through the draft too (run_step, after the reserve): prompts
    reach the draft where they reach the model, so a verify step's catch-up is the one or two
    tokens since the last verify (more only after decode windows, which skip the draft)."""
    _, cache = _draft_forward(dparams, st, cfg, shape, batch.row_slots, batch.token_ids,
                              batch.positions, batch.token_rows, batch.query_start,
                              max_q=shape.max_q, max_q_rows=shape.max_q_rows,
                              decode_pages=shape.decode_pages)
    return dataclasses.replace(st, draft=cache)


def _draw(logits: Float[Array, "R V"], view: smp.SamplingState, j: int | Int[Array, ""],
          flags: smp.SampleFlags
          ) -> tuple[Int[Array, "R"], Float[Array, "R V"] | None, Float[Array, "R"]]:
    """Draft token j + 1 of each row, q_j, the distribution it was drawn from (None when
    every row is greedy: the verify rule then needs only the token), and the draft's
    probability of that token (q_j's; a greedy row's softmax of the logits)."""
    view = dataclasses.replace(view, num_generated=view.num_generated + j)
    flags = dataclasses.replace(flags, grammar=False)  # constrained rows draft nothing
    if not flags.random:
        tok = smp.sample(logits, view, flags=dataclasses.replace(
            flags, logprobs=False, num_top_logprobs=0)).tokens
        return tok, None, _softmax_at(logits, tok)
    q = smp.distribution(logits, view, flags)
    tok = smp.draw_from(q, view, DRAW_SALT)
    sure = jnp.where(view.temperature > 0.0, jnp.take_along_axis(q, tok[:, None], 1)[:, 0],
                     _softmax_at(logits, tok))
    return tok, q, sure


def _softmax_at(logits: Float[Array, "R V"], tok: Int[Array, "R"]) -> Float[Array, "R"]:
    x = logits.astype(jnp.float32)
    return jnp.exp(jnp.take_along_axis(x, tok[:, None], 1)[:, 0]
                   - jax.nn.logsumexp(x, axis=-1))


def propose(dparams: Params, st: EngineState, batch: StepBatch, dbatch: DraftBatch,
            cfg: StepConfig, shape: StepShape
            ) -> tuple[EngineState, StepBatch, tuple[Float[Array, "R K V"] | None,
                                                     Int[Array, "R"]]]:
    """The module docstring's steps: (state with the draft's K/V written, the verify batch
    with its drafts filled in, (q [R, K, V] (None for an all-greedy batch), the drafts each
    row verifies: dbatch.num_drafts, or fewer where it stopped early)). A row stops
    drafting once its drafts' probability under the draft (their product) falls below
    cfg.draft_stop (a further draft step would likely be wasted); the loop ends when no row
    drafts on, so stopped rows save the draft's forwards at batch 1."""
    # rows with penalties draft nothing (speculative.may_speculate): the draft skips them
    k, flags = shape.verify - 1, dataclasses.replace(shape.flags, penalties=False)
    slots, r = batch.row_slots, batch.row_slots.shape[0]
    live = slots >= 0
    view = smp.rows_view(st.sampling, slots, False, flags.bias)
    logits, cache = _draft_forward(  # the host gives padding rows length 0
        dparams, st, cfg, shape, slots, dbatch.token_ids, dbatch.positions, dbatch.token_rows,
        dbatch.query_start, dbatch.seq_lens, max_q=shape.draft_q)
    st = dataclasses.replace(st, draft=cache)
    first, q0, sure = _draw(logits, view, 0, flags)
    pos0 = batch.positions[jnp.clip(batch.query_start[:-1], 0, batch.positions.shape[0] - 1)]
    drafts = jnp.zeros((r, k), jnp.int32).at[:, 0].set(first)
    qs = None if q0 is None else jnp.zeros((r, k, q0.shape[1]), jnp.float32).at[:, 0].set(q0)
    rows, one_each = jnp.arange(r, dtype=jnp.int32), jnp.arange(r + 1, dtype=jnp.int32)
    made = jnp.minimum(dbatch.num_drafts, live.astype(jnp.int32))  # draft 1 costs nothing more

    def going(j, made, sure):  # rows that draw draft j + 1 at step j
        return live & (made == j) & (j < dbatch.num_drafts) & (sure >= cfg.draft_stop)

    def step(carry):  # feed draft j (position pos0 + j), draw draft j + 1
        j, st, drafts, qs, made, sure = carry
        on = going(j, made, sure)
        pos = pos0 + j
        logits, cache = _draft_forward(
            dparams, st, cfg, shape, jnp.where(on, slots, -1), drafts[:, j - 1], pos,
            jnp.where(on, rows, -1), one_each, jnp.where(on, pos + 1, 0), max_q=1)
        tok, q, p = _draw(logits, view, j, flags)
        drafts = drafts.at[:, j].set(tok)
        qs = None if qs is None else qs.at[:, j].set(q)
        made, sure = made + on, jnp.where(on, sure * p, sure)
        return j + 1, dataclasses.replace(st, draft=cache), drafts, qs, made, sure

    _, st, drafts, qs, made, _ = jax.lax.while_loop(
        lambda c: (c[0] < k) & jnp.any(going(c[0], c[4], c[5])), step,
        (jnp.asarray(1, jnp.int32), st, drafts, qs, made, sure))
    return st, _fill(batch, drafts, dbatch.num_drafts), (qs, made)


def _fill(batch: StepBatch, drafts: Int[Array, "R K"], num: Int[Array, "R"]) -> StepBatch:
    """Row r's verify tokens 1 .. num[r] become its drafts."""
    t = batch.token_ids.shape[0]
    row = jnp.clip(batch.token_rows, 0)
    j = jnp.arange(t, dtype=jnp.int32) - batch.query_start[row] - 1
    use = (batch.token_rows >= 0) & (j >= 0) & (j < num[row])
    picked = drafts[row, jnp.clip(j, 0, drafts.shape[1] - 1)]
    return dataclasses.replace(batch, token_ids=jnp.where(use, picked, batch.token_ids))
