"""Host-side helpers of the engine: prompt checks, swapping, detokenization.

Kept apart from engine.py so the engine reads as the step loop and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import kv_cache as kv_lib
from paged_jax import page_table as pt
from paged_jax import sampling as smp
from paged_jax.models import ModelConfig, Tokenizer
from paged_jax.outputs import Logprob
from paged_jax.sampling_params import SamplingParams
from paged_jax.sequence import Sequence
from paged_jax.step import EngineState
from paged_jax.types import Array, Float, Int


# ---- admission checks ------------------------------------------------------------------------
def prompt_ids(prompt: str | list[int] | dict, tok: Tokenizer) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, token ids, or vLLM's dict forms."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _check_ids(list(prompt["prompt_token_ids"]))
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict needs a 'prompt' or 'prompt_token_ids' key, "
                             f"got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt, _check_ids(tok.encode(prompt))
    if isinstance(prompt, list | tuple):
        return None, _check_ids(list(prompt))
    raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt)}")


def _check_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    if not all(isinstance(i, int | np.integer) and i >= 0 for i in ids):
        raise ValueError("prompt_token_ids must be non-negative ints")
    return [int(i) for i in ids]


def check_fits(params: SamplingParams, ids: list[int], ec, mc: ModelConfig) -> SamplingParams:
    """Rejects a request that could never be served; fills max_tokens=None up to the limit."""
    if max(ids) >= mc.vocab_size:
        raise ValueError(f"prompt token id {max(ids)} is outside the model's vocabulary "
                         f"(vocab_size {mc.vocab_size})")
    prompt_len = len(ids)
    room = ec.max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt has {prompt_len} tokens, but max_model_len is "
                         f"{ec.max_model_len}: no room for any output token")
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=room)
    if prompt_len + params.max_tokens > ec.max_model_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                         f"exceeds max_model_len ({ec.max_model_len})")
    if params.n > ec.max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={ec.max_num_seqs}")
    # n sequences may each have to be recomputed privately after a preemption.
    blocks = params.n * -(-(prompt_len + params.max_tokens) // ec.block_size)
    if blocks > ec.num_kv_blocks - 1:
        raise ValueError(f"request needs up to {blocks} KV blocks (n={params.n} x "
                         f"{prompt_len + params.max_tokens} tokens) but the cache holds "
                         f"{ec.num_kv_blocks - 1}")
    if params.logprobs is not None and params.logprobs > ec.max_logprobs:
        raise ValueError(f"logprobs={params.logprobs} exceeds the engine's "
                         f"max_logprobs={ec.max_logprobs}")
    return params


# ---- swapping --------------------------------------------------------------------------------
def swap_out(state: EngineState, seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of the K/V blocks a sequence holds (before its blocks are freed)."""
    held = -(-seq.num_computed // state.table.block_size)
    blocks = np.asarray(state.table.block_tables[seq.slot])[:held]
    k, v = kv_lib.read_blocks(state.cache, jnp.asarray(blocks))
    return np.asarray(k), np.asarray(v)


@functools.partial(jax.jit, donate_argnums=(0,))
def _restore(
    state: EngineState, slot: Int[Array, ""], n_tokens: Int[Array, ""],
    k: Float[Array, "L H P K D"], v: Float[Array, "L H P K D"],
) -> EngineState:
    num_new = jnp.zeros_like(state.table.seq_lens).at[slot].set(n_tokens)
    table = pt.add_sequence(state.table, slot)
    pool, table, _, _ = pt.reserve_slots(state.pool, table, num_new)
    cache = kv_lib.write_blocks(state.cache, table.block_tables[slot], k, v)
    return EngineState(pool, table, cache, state.sampling)


def swap_in(state: EngineState, seq: Sequence) -> tuple[EngineState, int]:
    """Brings a swapped-out sequence's slot live again: allocates its blocks, restores K/V."""
    k, v = seq.swapped
    p = state.table.max_blocks_per_seq
    pad = [(0, 0), (0, 0), (0, p - k.shape[2]), (0, 0), (0, 0)]
    state = _restore(state, jnp.asarray(seq.slot), jnp.asarray(seq.num_computed),
                     jnp.asarray(np.pad(k, pad)), jnp.asarray(np.pad(v, pad)))
    seq.swapped = None
    return state, int(state.pool.num_free)


# ---- outputs ---------------------------------------------------------------------------------
def finish_reason(code: int, token: int) -> tuple[str, int | None]:
    """vLLM's (finish_reason, stop_reason) for a device stop code."""
    if code == smp.FINISH_LENGTH:
        return "length", None
    if code == smp.FINISH_STOP_TOKEN:
        return "stop", token
    return "stop", None


def logprob_entry(tok: int, lp: float, top_ids: np.ndarray, top_lps: np.ndarray,
                  k: int) -> dict[int, Logprob]:
    """The chosen token's logprob plus the request's top-k, as vLLM reports them."""
    entry = {int(i): Logprob(float(x), rank=r + 1)
             for r, (i, x) in enumerate(zip(top_ids[:k], top_lps[:k], strict=True))}
    if tok not in entry:
        entry[tok] = Logprob(float(lp))
    return entry


def detokenize(seq: Sequence, params: SamplingParams, tok: Tokenizer) -> None:
    """Incremental detokenization: decode only the tokens after the last stable point.

    A few committed tokens are decoded along as context, so tokenizers that drop a leading
    space at the start of a decode still join correctly; text ending in an incomplete
    UTF-8 sequence (U+FFFD) stays pending until the next token completes it.
    """
    if not params.detokenize:
        return
    ids, start = seq.output_ids, seq.read_offset
    ctx = ids[max(0, start - 4):start]
    skip = params.skip_special_tokens
    full, head = tok.decode(ctx + ids[start:], skip), tok.decode(ctx, skip)
    new = full[len(head):] if full.startswith(head) else tok.decode(ids[start:], skip)
    if new.endswith("\ufffd"):
        seq.text = seq.committed_text + new
        return
    seq.committed_text += new
    seq.read_offset = len(ids)
    seq.text = seq.committed_text


def stop_string(seq: Sequence, params: SamplingParams) -> str | None:
    """Ends the text at the first stop string (kept if include_stop_str_in_output)."""
    if not params.stop:
        return None
    hits = [(seq.text.find(s), s) for s in params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return None
    i, s = min(hits)
    seq.text = seq.text[: i + len(s)] if params.include_stop_str_in_output else seq.text[:i]
    return s


def emit(seq: Sequence, out, row: int, count: int, tok: Tokenizer) -> tuple[int, bool]:
    """Appends the `count` tokens row `row` sampled (one step's, or one window's).

    `out` is a host StepOut (fields [R]) or WindowOut (fields [W, R]). Detokenizes once
    for the lot, except for requests with stop strings, which are checked after every
    token (the text must end at the first hit). Returns (tokens taken, finished).
    """
    take = (lambda a: a[row:row + 1]) if out.tokens.ndim == 1 else (lambda a: a[:count, row])
    toks = take(out.tokens).tolist()
    if not toks:
        return 0, False
    req, params = seq.owner, seq.owner.params
    now = time.time()
    if req.metrics.first_token_time is None:
        req.metrics.first_token_time = now
    req.metrics.last_token_time = now
    lps = take(out.logprobs)
    entries = [logprob_entry(t, lp, ti, tl, params.logprobs) for t, lp, ti, tl in zip(
        toks, lps, take(out.top_ids), take(out.top_logprobs), strict=True)] \
        if params.logprobs is not None else None
    steps = [len(toks)] if not params.stop else [1] * len(toks)
    taken = 0
    for n in steps:  # one pass, or one per token when stop strings must be checked
        seq.tokens += toks[taken:taken + n]
        seq.cumulative_logprob += float(lps[taken:taken + n].sum())
        if entries is not None:
            seq.logprobs += entries[taken:taken + n]
        taken += n
        detokenize(seq, params, tok)
        hit = stop_string(seq, params)
        if hit is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
            return taken, True
    if not out.finished[row]:
        return taken, False
    seq.finish_reason, seq.stop_reason = finish_reason(int(out.reason[row]), toks[-1])
    return taken, True
