"""The decode window: up to W decode steps on the device in one `lax.while_loop`.

    decode_window(params, state, row_slots, tokens, ops)
      the host's queued allocator ops first (cache/ops.py), then each iteration is one
      `step.step_body` over a decode-only batch (decode_batch); exits early when every row
      stopped or the pool cannot grow (no host sync inside); reports like run_step
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_jax.cache.ops import KVOps
from paged_jax.engine.settle import apply_batch_ops, settle_and_report
from paged_jax.engine.state import EngineState, StepConfig
from paged_jax.engine.step import StepBatch, StepShape, step_body
from paged_jax.models import Params
from paged_jax.types import Array, Bool, Float, Int


def decode_batch(
    row_slots: Int[Array, "R"], tokens: Int[Array, "R"], active: Bool[Array, "R"],
    seq_lens: Int[Array, "S"],
) -> StepBatch:
    """A decode-only batch: one token per row (inactive rows are padding)."""
    r = row_slots.shape[0]
    slots = jnp.where(active, row_slots, -1)
    rows = jnp.arange(r, dtype=jnp.int32)
    no_fork = jnp.full((1,), -1, jnp.int32)
    return StepBatch(
        token_ids=tokens, positions=seq_lens[jnp.clip(row_slots, 0)],
        token_rows=jnp.where(active, rows, -1), row_slots=slots,
        query_start=jnp.arange(r + 1, dtype=jnp.int32), sample=active,
        fork_src=no_fork, fork_dst=no_fork, fork_index=no_fork)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowOut:
    """Tokens of up to W decode steps: step i's token of row r is tokens[i, r] if valid[i, r];
    the cache report as in step.StepOut (full_blocks [R, G * F], refcount [N] or [0])."""

    tokens: Int[Array, "W R"]
    logprobs: Float[Array, "W R"]
    top_ids: Int[Array, "W R J"]
    top_logprobs: Float[Array, "W R J"]
    valid: Bool[Array, "W R"]
    finished: Bool[Array, "R"]
    reason: Int[Array, "R"]
    steps: Int[Array, ""]
    ok: Bool[Array, ""]
    num_free: Int[Array, ""]
    full_blocks: Int[Array, "R GF"]
    refcount: Int[Array, "N2"]
    drafted: Int[Array, "R"] | None = None  # a draft model's verify: drafts each row made
    wire: Int[Array, "B"] | None = None  # every field above, packed (engine/wire.py)


def empty_window(w: int, r: int, j: int, ok: bool, num_free: Int[Array, ""]) -> WindowOut:
    """A WindowOut of W x R rows with nothing emitted (a window's start; a refused verify)."""
    zi = jnp.zeros((w, r), jnp.int32)
    return WindowOut(zi, zi.astype(jnp.float32), jnp.zeros((w, r, j), jnp.int32),
                     jnp.zeros((w, r, j), jnp.float32), zi.astype(bool), zi[0].astype(bool),
                     zi[0], jnp.asarray(0), jnp.asarray(ok), num_free,
                     jnp.zeros((r, 0), jnp.int32), jnp.zeros((0,), jnp.int32))


@functools.partial(
    jax.jit, static_argnames=("cfg", "window", "shape"), donate_argnames=("state",))
def decode_window(
    params: Params, state: EngineState, row_slots: Int[Array, "R"], tokens: Int[Array, "R"],
    ops: KVOps | None = None, *, cfg: StepConfig, window: int, shape: StepShape,
) -> tuple[EngineState, WindowOut]:
    """Up to `window` decode steps in one `lax.while_loop`; the host syncs once per window.

    Args:
      params: model parameters (runtime form).
      state: device state (donated).
      row_slots: [R] the slot each row decodes (-1: padding row).
      tokens: [R] each row's last sampled token (the next input).
      ops: the host's queued allocator ops, applied first (None: none).
      cfg: static engine config.
      window: static W, the most steps.
      shape: static bounds; max_pages / decode_pages must cover every row's length at the
        end of the window.

    Returns:
      (state', WindowOut). The loop stops early when every row has stopped, or when the pool
      cannot cover the next step (that step did not run; the rest is kept). Rows that
      stopped are released (step.settle).
    """
    state = apply_batch_ops(state, ops)
    old_lens = state.table.seq_lens
    r, j = row_slots.shape[0], shape.flags.num_top_logprobs
    out0 = empty_window(window, r, j, True, state.pool.num_free)

    def cond(c):
        _, _, act, out = c
        return (out.steps < window) & act.any() & out.ok

    def body(c):
        st, tok, act, out = c
        st, o = step_body(params, st, decode_batch(row_slots, tok, act, st.table.seq_lens),
                          cfg, shape)
        i = out.steps
        valid = o.sampled & o.ok
        out = WindowOut(
            out.tokens.at[i].set(o.tokens), out.logprobs.at[i].set(o.logprobs),
            out.top_ids.at[i].set(o.top_ids), out.top_logprobs.at[i].set(o.top_logprobs),
            out.valid.at[i].set(valid), out.finished | (o.finished & valid),
            jnp.where(o.finished & valid, o.reason, out.reason),
            i + o.ok.astype(jnp.int32), o.ok, o.num_free, out.full_blocks, out.refcount)
        return st, jnp.where(valid, o.tokens, tok), act & ~(o.finished & valid), out

    state, _, _, out = jax.lax.while_loop(cond, body, (state, tokens, row_slots >= 0, out0))
    # What ran is kept even when the loop stopped for lack of blocks (ok False).
    out = dataclasses.replace(out, ok=jnp.asarray(True))
    return settle_and_report(state, out, row_slots, row_slots >= 0, old_lens, cfg,
                             shape.full_width, row_slots >= 0)

