"""Output processing: the tokens a step (or a window) sampled, appended to their sequences,
detokenized incrementally, checked for stop strings, with vLLM's logprob entries; prompt
logprobs and hidden states onto their requests. Called from Scheduler.update_from_output.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.engine.sequence import Sequence
from paged_jax.outputs import Logprob
from paged_jax.sample import sampler as smp
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.engine.runner import StepOutput
    from paged_jax.models.tokenizer import Tokenizer


def finish_reason(code: int, token: int) -> tuple[str, int | None]:
    """vLLM's (finish_reason, stop_reason) for a device stop code."""
    if code == smp.FINISH_LENGTH:
        return "length", None
    if code == smp.FINISH_STOP_TOKEN:
        return "stop", token
    return "stop", None


def logprob_entry(tok: int, lp: float, top_ids: np.ndarray, top_lps: np.ndarray,
                  k: int, text=None, rank: int | None = None) -> dict[int, Logprob]:
    """The chosen token's logprob (and `rank`, when known) plus the request's top-k, as vLLM
    reports them; `text` (a token id -> str function, None without detokenization) fills
    `decoded_token`."""
    text = text or (lambda _: None)
    entry = {int(i): Logprob(float(x), rank=r + 1, decoded_token=text(int(i)))
             for r, (i, x) in enumerate(zip(top_ids[:k], top_lps[:k], strict=True))}
    if tok not in entry:
        entry[tok] = Logprob(float(lp), rank=rank, decoded_token=text(tok))
    return entry


def prompt_logprobs(rows: list[Sequence], chunks: list[tuple[Sequence, int]],
                    starts: dict[int, int], prompt, tok: Tokenizer) -> None:
    """Fills the prompt_logprobs of the requests that asked, from a step's per-token results.

    Tokens lie in row order (build_step's layout); the token at position p gives the entry
    of prompt token p + 1. Entries already filled (a recompute after preemption) are kept.
    `starts`: each row's computed count before the step; `prompt` the step's host
    PromptLogprobs.
    """
    sizes, o = {id(s): n for s, n in chunks}, 0
    for seq in rows:
        n, req = sizes.get(id(seq), 0), seq.owner
        if n and req.prompt_logprobs is not None:
            text = (lambda i: tok.decode([i], False)) if req.params.detokenize else None
            first = starts[id(seq)]
            for j, p in enumerate(range(first + 1, first + n + 1)):
                if p < seq.prompt_len and req.prompt_logprobs[p] is None:
                    req.prompt_logprobs[p] = logprob_entry(
                        seq.tokens[p], prompt.logprobs[o + j], prompt.top_ids[o + j],
                        prompt.top_logprobs[o + j], req.params.prompt_logprobs, text,
                        rank=int(prompt.ranks[o + j]))
        o += n


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


def hidden_states(rows: list[Sequence], wanted: set[int], hidden: np.ndarray) -> None:
    """Keeps the last hidden state of each request whose first prefill ended in the step and
    asked for it (SamplingParams.return_hidden_states); `wanted`: ids of those rows'
    sequences, decided when the step was sent."""
    for i, seq in enumerate(rows):
        if id(seq) in wanted:
            seq.owner.hidden_states = np.array(hidden[i])


def constraint_end(seq: Sequence, tokens: list[int]) -> tuple[bool, str | None]:
    """Advances a constrained sequence's matcher over its new tokens: (whether the output
    ends, its stop_reason). It ends once the constraint is complete (at once, as at EOS:
    nothing but EOS could follow; stop_reason None), or when a token broke it (the mask
    allowed nothing, so only EOS could be sampled; stop_reason says why)."""
    m = seq.matcher
    if m is None:
        return False, None
    if not m.accept(tokens):
        return True, f"structured_outputs: {m.error or 'no token was allowed'}"
    return m.complete, None


def emit(seq: Sequence, out: StepOutput, row: int, count: int,
         tok: Tokenizer | None) -> tuple[int, bool]:
    """Appends the `count` tokens row `row` sampled (one step's, or one window's).

    Detokenizes once for the lot, except for requests with stop strings, which are checked
    after every token (the text must end at the first hit). Returns (tokens taken, finished).
    """
    take = lambda a: a[:count, row]  # noqa: E731
    toks = take(out.tokens).tolist()
    if not toks:
        return 0, False
    req, params = seq.owner, seq.owner.params
    now = time.time()
    if req.metrics.first_token_time is None:
        req.metrics.first_token_time = now
    req.metrics.last_token_time = now
    lps = take(out.logprobs)
    text = (lambda i: tok.decode([i], False)) if params.detokenize else None
    entries = [logprob_entry(t, lp, ti, tl, params.logprobs, text) for t, lp, ti, tl in zip(
        toks, lps, take(out.top_ids), take(out.top_logprobs), strict=True)] \
        if params.logprobs is not None else None
    steps = [len(toks)] if not params.stop else [1] * len(toks)
    taken = 0
    for n in steps:  # one pass, or one per token when stop strings must be checked
        seq.tokens += toks[taken:taken + n]
        seq.cumulative_logprob += float(lps[taken:taken + n].sum())
        if entries is not None:
            seq.logprobs += entries[taken:taken + n]
        ended, why = constraint_end(seq, toks[taken:taken + n])
        taken += n
        detokenize(seq, params, tok)
        hit = stop_string(seq, params)
        if hit is not None or ended:
            seq.finish_reason, seq.stop_reason = "stop", hit if hit is not None else why
            return taken, True
    if not out.finished[row]:
        return taken, False
    seq.finish_reason, seq.stop_reason = finish_reason(int(out.reason[row]), toks[-1])
    return taken, True
