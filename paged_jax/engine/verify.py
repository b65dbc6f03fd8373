"""The verify step of speculative decoding (engine/speculative.py proposes the drafts).

Row r feeds its last sampled token and k_r drafts, t d1 .. dk, at positions L .. L + k_r:

    run_verify(params, state, batch[, dparams, dbatch])
      0. ops                 the host's queued allocator work (no admissions: drafts are only
                             made in decode-only plans)
      1-3. reserve, copy, forward: as a ragged step (step.forward_if_room), every
                             token's logits kept; with a draft model, its drafts are made
                             between the copy and the forward (engine/draft.py)
      4. sample every token  token j of row r as plain decoding samples it there: the row's
                             parameters, num_generated + j (its key and min_tokens); with a
                             draft model's q, a row at temperature > 0 instead keeps draft
                             d(j+1) with probability min(1, p(d) / q(d)) and else draws
                             from max(p - q, 0) (Leviathan et al.)
      5. accept              drafts while d(j+1) == sample j; the row emits samples 0 .. a
                             (a = drafts accepted), cut at the first stop (EOS, stop id,
                             max_tokens) checked token by token as plain decoding would
      6. roll back           the slot keeps L + emitted tokens; blocks wholly past the end
                             are freed (page_table.truncate)
      7. settle and report   as run_step; the output is a WindowOut with W = K + 1

Rejected positions' K/V stay in the kept last block until later tokens overwrite them; no
attention reads past a sequence's length, and only full blocks are ever cached.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_jax.cache import page_table as pt
from paged_jax.engine import draft, settle
from paged_jax.engine.state import EngineState, StepConfig
from paged_jax.engine.step import StepBatch, StepShape, forward_if_room
from paged_jax.engine.window import WindowOut, empty_window
from paged_jax.models import Params
from paged_jax.sample import sampler as smp
from paged_jax.types import Array, Bool, Float, Int

ACCEPT_SALT, RESIDUAL_SALT = 0xACC, 0x2E5
"""Key streams of the rejection rule's uniforms and residual draws (a draft model's drafts):
fold_in(fold_in(key, num_generated + j), salt), apart from the row's sampling key."""


def _token_rows(batch: StepBatch) -> tuple[Int[Array, "T"], Int[Array, "T"]]:
    """Each token's slot (-1 for padding) and j, its offset in its row."""
    t = batch.token_ids.shape[0]
    row = jnp.clip(batch.token_rows, 0)
    slot = jnp.where(batch.token_rows >= 0, batch.row_slots[row], -1)
    j = jnp.arange(t, dtype=jnp.int32) - batch.query_start[row]
    return slot, j


def _next_in_row(
    tokens: Int[Array, "T"], batch: StepBatch, j: Int[Array, "T"],
    num: Int[Array, "R"] | None = None,
) -> tuple[Bool[Array, "T"], Int[Array, "T"]]:
    """Whether each token has a draft after it in its row, and that draft (`num`: the drafts
    each row verifies, when a draft model stopped some rows before their last slot)."""
    rows = batch.token_rows
    nxt_row = jnp.concatenate([rows[1:], jnp.full((1,), -1, rows.dtype)])
    nxt_tok = jnp.concatenate([batch.token_ids[1:], jnp.zeros((1,), tokens.dtype)])
    has = (rows >= 0) & (nxt_row == rows)
    if num is not None:
        has &= j < num[jnp.clip(rows, 0)]
    return has, nxt_tok


def _accepted(
    tokens: Int[Array, "T"], batch: StepBatch, j: Int[Array, "T"],
    num: Int[Array, "R"] | None = None,
) -> Int[Array, "R"]:
    """Per row, the tokens it may emit: the drafts that equal the sample before them, and
    the sample after the last of those (1 for a row without drafts)."""
    t, r = tokens.shape[0], batch.row_slots.shape[0]
    rows = batch.token_rows
    has_draft, nxt_tok = _next_in_row(tokens, batch, j, num)
    stops = (rows >= 0) & (~has_draft | (tokens != nxt_tok))  # the row's last emitted token
    first = jnp.full((r,), t, jnp.int32).at[jnp.where(rows >= 0, rows, r)].min(
        jnp.where(stops, j, t), mode="drop")
    return first + 1


def _rejection(
    logits: Float[Array, "T V"], view: smp.SamplingState, batch: StepBatch,
    j: Int[Array, "T"], q: Float[Array, "R K V"], plain: Int[Array, "T"],
    flags: smp.SampleFlags, num: Int[Array, "R"] | None = None,
) -> Int[Array, "T"]:
    """Leviathan et al.'s rule for a draft model's drafts, as the token each position
    "samples": the draft d after it where kept (with probability min(1, p(d) / q(d))),
    else a draw from max(p - q, 0) (never d). Greedy rows and each row's last token keep
    plain decoding's sample, so greedy output is plain decoding's."""
    has_draft, d = _next_in_row(plain, batch, j, num)
    row = jnp.clip(batch.token_rows, 0)
    qt = q[row, jnp.clip(j, 0, q.shape[1] - 1)]  # the distribution d was drawn from
    p = smp.distribution(logits, view, flags)
    at = lambda x: jnp.take_along_axis(x, d[:, None], axis=1)[:, 0]  # noqa: E731
    keep = smp.uniform(view, ACCEPT_SALT) * at(qt) < at(p)
    other = smp.draw_from(jnp.maximum(p - qt, 0.0), view, RESIDUAL_SALT)
    drawn = has_draft & (view.temperature > 0.0)
    return jnp.where(drawn, jnp.where(keep, d, other), plain)


def _sample_tokens(
    state: EngineState, logits: Float[Array, "T V"], batch: StepBatch, flags: smp.SampleFlags,
    q: Float[Array, "R K V"] | None, num: Int[Array, "R"] | None = None,
) -> tuple[smp.SampleResult, Int[Array, "T"]]:
    """Step 4: what every token samples (with q, the rejection rule's token) and its j."""
    slot, j = _token_rows(batch)
    # token j of a row is sampled as if the row's tokens before it were emitted
    view = smp.rows_view(state.sampling, slot, flags.penalties, flags.bias)
    view = dataclasses.replace(view, num_generated=view.num_generated + j)
    # structured outputs: every position's mask applied once, here (logprobs: masked, as plain)
    logits = smp.constrained(logits, flags, batch.masks)
    flags = dataclasses.replace(flags, grammar=False)
    if q is None:
        return smp.sample(logits, view, flags=flags), j
    quiet = dataclasses.replace(flags, logprobs=False, num_top_logprobs=0)
    plain = smp.sample(logits, view, flags=quiet).tokens
    return smp.with_logprobs(logits, _rejection(logits, view, batch, j, q, plain, flags, num),
                             flags), j


def _sample_all(
    state: EngineState, logits: Float[Array, "T V"], batch: StepBatch, shape: StepShape,
    q: Float[Array, "R K V"] | None = None, num: Int[Array, "R"] | None = None,
) -> tuple[EngineState, WindowOut]:
    """Steps 4-5: every token sampled (with a draft model's q, by the rejection rule), the
    accepted prefix of each row cut at its stop (`num`: a draft model's drafts per row)."""
    flags, k1 = shape.flags, shape.verify
    res, j = _sample_tokens(state, logits, batch, flags, q, num)
    active = batch.row_slots >= 0
    emit = _accepted(res.tokens, batch, j, num)
    t = logits.shape[0]
    idx = jnp.clip(batch.query_start[:-1][None, :] + jnp.arange(k1)[:, None], 0, t - 1)
    tokens = res.tokens[idx]  # [K1, R]
    base = smp.rows_view(state.sampling, batch.row_slots, False)
    sampling, done = state.sampling, jnp.zeros_like(active)
    reason, valid = jnp.zeros(active.shape, jnp.int32), []
    for i in range(k1):  # stops in order, as plain decoding meets them
        v = active & (i < emit) & ~done
        counted = dataclasses.replace(base, num_generated=base.num_generated + i + 1)
        stop, why = smp.stop_mask(counted, tokens[i])
        reason = jnp.where(v & stop, why, reason)
        done |= v & stop
        sampling = smp.update_rows(sampling, batch.row_slots, tokens[i], v, flags.penalties)
        valid.append(v)
    r = active.shape[0]
    out = WindowOut(
        tokens, res.logprobs[idx], res.top_ids[idx], res.top_logprobs[idx], jnp.stack(valid),
        done, reason, jnp.asarray(1), jnp.asarray(True), state.pool.num_free,
        jnp.zeros((r, 0), jnp.int32), jnp.zeros((0,), jnp.int32), num)
    return dataclasses.replace(state, sampling=sampling), out


def _roll_back(state: EngineState, batch: StepBatch, emitted: Int[Array, "R"]) -> EngineState:
    """Step 6: each row's slot keeps its length before the step plus what it emitted."""
    table = state.table
    fed = batch.query_start[1:] - batch.query_start[:-1]
    s = table.live.shape[0]
    dest = jnp.where(batch.row_slots >= 0, batch.row_slots, s)
    lens = table.seq_lens.at[dest].add(emitted - fed, mode="drop")
    pool, table = pt.truncate(state.pool, table, lens)
    return dataclasses.replace(state, pool=pool, table=table)


def verify_body(
    params: Params, state: EngineState, batch: StepBatch, cfg: StepConfig, shape: StepShape,
    dparams: Params | None = None, dbatch: draft.DraftBatch | None = None,
) -> tuple[EngineState, WindowOut]:
    """Steps 1-6 (unjitted); with a draft model (`dparams`, `dbatch`) its drafts are made
    after step 2 (engine/draft.py). Not ok (the pool cannot cover it): nothing runs."""

    def after(st, logits, _prompt, _hidden, b, drafted):  # drafted: (q, num) or None
        st, out = _sample_all(st, logits, b, shape, *(drafted or ()))
        return _roll_back(st, b, out.valid.sum(axis=0, dtype=jnp.int32)), out

    prepare = None if dbatch is None else (
        lambda st, b: draft.propose(dparams, st, b, dbatch, cfg, shape))
    empty = empty_window(shape.verify, batch.row_slots.shape[0],
                         shape.flags.num_top_logprobs, False, state.pool.num_free)
    if dbatch is not None:  # the same fields either way (a loop's carry)
        empty = dataclasses.replace(empty, drafted=jnp.zeros_like(dbatch.num_drafts))
    return forward_if_room(params, state, batch, cfg, shape, after, empty, prepare)


@functools.partial(jax.jit, static_argnames=("cfg", "shape"), donate_argnames=("state",))
def run_verify(
    params: Params, state: EngineState, batch: StepBatch, dparams: Params | None = None,
    dbatch: draft.DraftBatch | None = None, *, cfg: StepConfig, shape: StepShape,
) -> tuple[EngineState, WindowOut]:
    """One verify step (module docstring), the state donated.

    Args:
      params: model parameters (runtime form).
      state: device state (donated).
      batch: the rows' tokens (last sampled token, then its drafts: placeholders a draft
        model fills in) and the call's ops.
      dparams, dbatch: a draft model's parameters and its catch-up tokens (engine/draft.py);
        None for n-gram drafts.
      cfg: static engine config.
      shape: static bounds; shape.verify = K + 1.

    Returns:
      (state', WindowOut with W = K + 1: row r's emitted tokens are tokens[:, r] where valid).
    """
    state = settle.apply_batch_ops(state, batch.ops)
    old_lens = state.table.seq_lens
    state, out = verify_body(params, state, batch, cfg, shape, dparams, dbatch)
    own = batch.own if batch.own is not None else jnp.zeros_like(batch.sample)
    wrote: Bool[Array, "R"] = batch.query_start[1:] > batch.query_start[:-1]
    return settle.settle_and_report(state, out, batch.row_slots, own, old_lens, cfg,
                                    shape.full_width, wrote)
