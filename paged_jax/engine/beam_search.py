"""Beam search on the paged cache: beams are sequences that fork and free blocks.

    prompt prefill (one sequence) -> top 2W next tokens
    each step: keep the W best (beam, token) candidates by cumulative logprob;
      beams not chosen are released; a beam chosen k times is forked k-1 times (its blocks
      shared, refcount + k-1); each chosen token is appended and computed (one decode step
      for all beams), giving every beam's next top 2W. Copy-on-write splits a shared, partly
      filled last block on its first write.

A logit bias (BeamSearchParams' logit_bias, allowed_token_ids, bad_words) is applied on the
host: with one, `compute` returns every token's raw logprob, the bias row is added and the
row log-softmaxed again (log_softmax(logits + bias) = log_softmax(raw logprobs + bias)), so
beams are scored exactly as vLLM's processed logits would score them; without one, only the
top 2W come back.

The host picks the tokens (a beam decision needs every beam's candidates); the device work
goes through the engine's public seam for sequences it does not schedule:
`Engine.compute / fork / release`. Releases and forks are queued and ride in the next
compute call, so one beam step is one device call (and the peak is read after it).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from paged_jax.engine import Engine
from paged_jax.engine import input as inp
from paged_jax.engine.sequence import Request, Sequence
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from paged_jax.sample.state import bias_row
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

Top = list[tuple[int, float]]  # a beam's best next tokens: (token id, logprob), best first


@dataclasses.dataclass
class _Beam:
    seq: Sequence | None  # None once finished (its blocks are released)
    tokens: list[int]  # generated tokens
    cum: float = 0.0
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)


def beam_search(engine: Engine, prompt, params: BeamSearchParams,
                lora_request: LoRARequest | None = None) -> tuple[BeamSearchOutput, int]:
    """Beam search for one prompt on an idle engine (every beam under `lora_request`'s
    adapter when given: paged_jax/lora).

    Returns:
      (the best `beam_width` beams, best first; the peak number of KV blocks in use).
    """
    if engine.has_unfinished():
        raise RuntimeError("beam_search needs an idle engine")
    text, ids = inp.prompt_ids(prompt, engine.tokenizer)
    biased = params.bias_params()
    inp.check_tokenizer(biased, engine.tokenizer)
    inp.check_fits(dataclasses.replace(biased, n=params.beam_width, max_tokens=params.max_tokens,
                                       temperature=1.0), ids, engine.config, engine.model_config)
    bias = None
    if biased.has_logit_bias:  # [V], added to every beam's logits
        banned = inp.bad_word_ids(biased, engine.tokenizer) if biased.bad_words else ()
        bias = bias_row(biased, engine.model_config.vocab_size, banned)
    req = Request("beam-search", text, ids, SamplingParams(temperature=0.0), time.time(), 0)
    req.lora = engine.check_adapter(lora_request)
    live: list[Sequence] = []
    try:
        return _search(engine, req, params, live, bias)
    finally:
        engine.release(live)
        engine.settle()


def _search(engine: Engine, req: Request, params: BeamSearchParams, live: list[Sequence],
            bias: np.ndarray | None) -> tuple[BeamSearchOutput, int]:
    w, eos = params.beam_width, set(engine.model_config.eos_token_ids)
    k = min(2 * w, engine.model_config.vocab_size)
    root = Sequence(0, list(req.prompt_token_ids), len(req.prompt_token_ids), owner=req)
    live.append(root)
    beams, tops = [_Beam(root, [])], _tops(engine, [root], k, bias)
    done, peak = [], engine.kv.blocks_used()
    for step in range(params.max_tokens):
        cands = sorted(((b.cum + lp, b, t) for b, top in zip(beams, tops, strict=True)
                        for t, lp in top), key=lambda c: -c[0])
        entries = {id(b): _entries(engine, top) for b, top in zip(beams, tops, strict=True)}
        chosen = []
        for score, b, t in cands:
            nb = _Beam(b.seq, b.tokens + [t], score, b.logprobs + [entries[id(b)]])
            if t in eos and not params.ignore_eos:
                done.append(dataclasses.replace(nb, seq=None))
            else:
                chosen.append(nb)
            if len(chosen) == w:
                break
        if not chosen or step == params.max_tokens - 1:
            done += chosen
            break
        beams = _regroup(engine, chosen, live)
        tops = _tops(engine, [b.seq for b in beams], k, bias)
        peak = max(peak, engine.kv.blocks_used())
    return _output(engine, req.prompt_token_ids, done, params), peak


def _tops(engine: Engine, seqs: list[Sequence], k: int, bias: np.ndarray | None) -> list[Top]:
    """Each sequence's best k next tokens under the logit bias (None: none), best first."""
    if bias is None:
        return engine.compute(seqs, k)
    v = bias.shape[0]
    out = []
    for top in engine.compute(seqs, v):  # every token's raw logprob: the bias re-normalises
        lp = np.full(v, -np.inf)
        lp[[t for t, _ in top]] = [x for _, x in top]
        lp += bias
        lp -= np.logaddexp.reduce(lp)
        best = np.argsort(-lp, kind="stable")[:k]  # ties: the lower id, as lax.top_k breaks them
        out.append([(int(t), float(lp[t])) for t in best if np.isfinite(lp[t])])
    return out


def _regroup(engine: Engine, chosen: list[_Beam], live: list[Sequence]) -> list[_Beam]:
    """Releases the beams no candidate extends, forks those several extend, appends each
    candidate's token to its own sequence."""
    parents = {id(b.seq) for b in chosen}
    dropped = [s for s in live if id(s) not in parents]
    engine.release(dropped)  # first: their slots (and, in the next call, blocks) serve forks
    live[:] = [s for s in live if id(s) in parents]
    groups: dict[int, list[_Beam]] = {}
    for b in chosen:
        groups.setdefault(id(b.seq), []).append(b)
    out = []
    for group in groups.values():
        parent = group[0].seq
        children = [Sequence(0, list(parent.tokens), parent.prompt_len, owner=parent.owner)
                    for _ in group[1:]]
        if children:
            live += children  # first: released in beam_search's finally even if fork fails
            engine.fork(parent, children)
        for b, seq in zip(group, [parent, *children], strict=True):
            seq.tokens.append(b.tokens[-1])
            out.append(dataclasses.replace(b, seq=seq))
    return out


def _entries(engine: Engine, top: Top) -> dict[int, Logprob]:
    """A beam position's top 2W candidates as vLLM reports them (rank, decoded text)."""
    tok = engine.tokenizer
    return {t: Logprob(lp, rank=r + 1, decoded_token=tok.decode([t], False) if tok else None)
            for r, (t, lp) in enumerate(top)}


def _output(engine: Engine, ids: list[int], done: list[_Beam],
            params: BeamSearchParams) -> BeamSearchOutput:
    eos = engine.model_config.eos_token_ids

    def score(b: _Beam) -> float:
        n = len(ids) + len(b.tokens) - int(b.tokens[-1:] and b.tokens[-1] in eos)
        return b.cum / max(n, 1) ** params.length_penalty

    best = sorted(done, key=score, reverse=True)[: params.beam_width]
    return BeamSearchOutput([
        BeamSearchSequence(tokens=list(ids) + b.tokens, logprobs=b.logprobs, cum_logprob=b.cum,
                           text=engine.tokenizer.decode(b.tokens) if engine.tokenizer else "",
                           finish_reason="stop" if b.tokens and b.tokens[-1] in eos
                           else "length")
        for b in best])
