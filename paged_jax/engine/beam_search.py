"""Beam search as a scheduled request: beams are sequences that fork and free blocks.

    Engine.add_beam_request -> a Request whose `beam` (BeamRun) holds the search, and whose
      W sequences hold W slots from admission on: the root (the prompt) and W-1 spares
      (slots for the forks to come, so a fork never waits for a slot)
    a step that computes a beam's last pending token: the host records its best 2W next
      tokens (`record`, raw logprobs) where a sampled request appends a token
    once every live beam has them (`advance`): keep the W best (beam, token) candidates by
      cumulative logprob; a beam no candidate extends is freed, one that k extend forks k-1
      children (its blocks shared, refcount + k-1; the first write into a shared, partly
      filled last block copies it); each candidate's token is appended, to be computed in
      the next step. A candidate ending in EOS is a finished beam; when no live beam is left
      or max_tokens is reached, the request finishes: its output is the best `beam_width`
      finished beams by cum_logprob / length ** length_penalty (vLLM's scoring).

The scheduler plans beams as any sequence (chunked prefill, prefix hits, preemption), but:
the device settles none of their rows (`Request.device_settles`: no stop, no cached blocks:
the host picks their tokens and ends), no step is planned ahead of them (async scheduling
waits), none runs in a decode window or a verify call, and a preempted beam request is
recomputed, never swapped (`Scheduler.preempt`). A beam request is host state like any
request, so engine snapshots carry it mid-run (engine/snapshot.py).

A logit bias (BeamSearchParams' logit_bias, allowed_token_ids, bad_words) is applied on the
host: the beam rows then return every token's raw logprob, the bias row is added and the
row log-softmaxed again (log_softmax(logits + bias) = log_softmax(raw logprobs + bias)), so
beams are scored exactly as vLLM's processed logits would score them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.engine import input as inp
from paged_jax.engine.sequence import Request, Sequence, Status
from paged_jax.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob
from paged_jax.sample.state import bias_row
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from paged_jax.engine.kv_manager import KVManager
    from paged_jax.engine.runner import StepOutput
    from paged_jax.lora.request import LoRARequest
    from paged_jax.models.tokenizer import Tokenizer

Top = list[tuple[int, float]]  # a beam's best next tokens: (token id, logprob), best first


@dataclasses.dataclass
class Finished:
    """A beam that ended (EOS, or the search's end)."""

    tokens: list[int]  # generated tokens
    cum: float
    logprobs: list[dict[int, Logprob]]


@dataclasses.dataclass
class BeamRun:
    """The host state of one beam search (the beams themselves are the request's sequences:
    tokens, cumulative_logprob, logprobs)."""

    params: BeamSearchParams
    eos: frozenset[int]
    bias: np.ndarray | None  # [V] added to every beam's logprobs; None: no bias
    tops: dict[Sequence, Top] = dataclasses.field(default_factory=dict)  # this round's
    done: list[Finished] = dataclasses.field(default_factory=list)

    @property
    def k(self) -> int:
        """Candidates kept per beam."""
        return 2 * self.params.beam_width

    @property
    def num_logprobs(self) -> int:
        """Top logprobs a beam row returns: 2W, or every token's when a bias re-ranks them."""
        return self.k if self.bias is None else self.bias.shape[0]


def make_request(request_id: str, prompt, params: BeamSearchParams, tok: Tokenizer | None,
                 ec, mc, arrival_time: float) -> Request:
    """A checked beam request (ValueError naming what is wrong), its W slots' sequences."""
    text, ids = inp.prompt_ids(prompt, tok)
    biased = params.bias_params()
    inp.check_tokenizer(biased, tok)
    inp.check_fits(dataclasses.replace(biased, n=params.beam_width, max_tokens=params.max_tokens,
                                       temperature=1.0), ids, ec, mc)
    bias = None
    if biased.has_logit_bias:
        banned = inp.bad_word_ids(biased, tok) if biased.bad_words else ()
        bias = bias_row(biased, mc.vocab_size, banned)
    run = BeamRun(params, frozenset(mc.eos_token_ids), bias)
    # Greedy rows returning 2W top logprobs; the device settles none of them (the host picks
    # tokens and ends), so max_tokens only sizes the request for policies.
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=params.max_tokens,
                        logprobs=run.num_logprobs)
    req = Request(request_id, text, ids, sp, arrival_time, order=-1, beam=run)
    req.seqs = [Sequence(i, list(ids), len(ids), owner=req, spare=i > 0)
                for i in range(params.beam_width)]
    return req


def record(seq: Sequence, out: StepOutput, row: int, tok: Tokenizer | None) -> None:
    """A beam's row of a step's output: its best 2W next tokens (under the bias), if the step
    computed its last pending token."""
    if not out.valid[0, row]:
        return
    run: BeamRun = seq.owner.beam
    pairs = list(zip(out.top_ids[0, row].tolist(), out.top_logprobs[0, row].tolist(),
                     strict=True))
    if run.bias is None:
        top = pairs[:run.k]
    else:
        lp = np.full(run.bias.shape[0], -np.inf)
        lp[[t for t, _ in pairs]] = [x for _, x in pairs]
        lp += run.bias
        lp -= np.logaddexp.reduce(lp)
        best = np.argsort(-lp, kind="stable")[:run.k]  # ties: the lower id, as lax.top_k
        top = [(int(t), float(lp[t])) for t in best if np.isfinite(lp[t])]
    run.tops[seq] = top


def advance(req: Request, kv: KVManager, free, tok: Tokenizer | None) -> list[Sequence]:
    """The search's next round once every live beam has its candidates (else nothing):
    returns the sequences to finish (all of the request's when the search ends); `free`
    frees sequences now (Scheduler.free)."""
    run, beams = req.beam, req.live_seqs()
    if any(s.num_pending or s not in run.tops for s in beams):
        return []
    chosen = _choose(run, beams, tok)
    run.tops.clear()
    if not chosen or len(beams[0].output_ids) + 1 >= run.params.max_tokens:
        run.done += [Finished(s.output_ids + [t], cum, s.logprobs + [e])
                     for s, t, cum, e in chosen]
        return req.held_seqs()
    _regroup(req, chosen, kv, free)
    return []


def _choose(run: BeamRun, beams: list[Sequence], tok) -> list[tuple]:
    """The W best candidates (beam, token, cum, logprob entry) that do not end the beam; those
    that end it on the way (EOS) join the finished beams."""
    entries = {s: _entries(run.tops[s], tok) for s in beams}
    cands = sorted(((s.cumulative_logprob + lp, s, t) for s in beams for t, lp in run.tops[s]),
                   key=lambda c: -c[0])
    chosen = []
    for cum, s, t in cands:
        if t in run.eos and not run.params.ignore_eos:
            run.done.append(Finished(s.output_ids + [t], cum, s.logprobs + [entries[s]]))
        else:
            chosen.append((s, t, cum, entries[s]))
        if len(chosen) == run.params.beam_width:
            break
    return chosen


def _regroup(req: Request, chosen: list[tuple], kv: KVManager, free) -> None:
    """Frees the beams no candidate extends (and the spares), forks those several extend into
    the freed slots, appends each candidate's token; spares keep the request at W slots."""
    parents = list(dict.fromkeys(s for s, *_ in chosen))
    free([s for s in req.held_seqs() if s not in parents])  # their slots serve the forks
    beams = []
    for parent in parents:
        group = [c for c in chosen if c[0] is parent]
        children = [Sequence(0, list(parent.tokens), parent.prompt_len, owner=req,
                             cumulative_logprob=parent.cumulative_logprob,
                             logprobs=list(parent.logprobs),
                             block_hashes=list(parent.block_hashes)) for _ in group[1:]]
        if children:
            kv.fork(parent, children)
        for (_, t, cum, entry), seq in zip(group, [parent, *children], strict=True):
            seq.tokens.append(t)
            seq.cumulative_logprob = cum
            seq.logprobs.append(entry)
            seq.status = Status.RUNNING
            beams.append(seq)
    spares = [Sequence(0, [], req.seqs[0].prompt_len, owner=req, spare=True)
              for _ in range(req.beam.params.beam_width - len(beams))]
    kv.allocate(spares)
    req.seqs, req.forked = beams + spares, True
    for i, s in enumerate(req.seqs):
        s.index = i


def _entries(top: Top, tok) -> dict[int, Logprob]:
    """A beam position's top 2W candidates as vLLM reports them (rank, decoded text)."""
    return {t: Logprob(lp, rank=r + 1, decoded_token=tok.decode([t], False) if tok else None)
            for r, (t, lp) in enumerate(top)}


def output(req: Request, tok: Tokenizer | None) -> BeamSearchOutput:
    """The best `beam_width` finished beams, best first (the live ones while it runs)."""
    run: BeamRun = req.beam
    ids = req.prompt_token_ids
    done = run.done if req.finished else [
        Finished(s.output_ids, s.cumulative_logprob, s.logprobs) for s in req.live_seqs()]

    def score(b: Finished) -> float:
        n = len(ids) + len(b.tokens) - int(bool(b.tokens) and b.tokens[-1] in run.eos)
        return b.cum / max(n, 1) ** run.params.length_penalty

    best = sorted(done, key=score, reverse=True)[: run.params.beam_width]
    return BeamSearchOutput([
        BeamSearchSequence(tokens=list(ids) + b.tokens, logprobs=b.logprobs, cum_logprob=b.cum,
                           text=tok.decode(b.tokens) if tok else "",
                           finish_reason="stop" if b.tokens and b.tokens[-1] in run.eos
                           else "length")
        for b in best])


def completions(req: Request, tok: Tokenizer | None) -> list[CompletionOutput]:
    """`output` as a RequestOutput's completions (generated tokens only), best first; the
    per-position candidates stay in `output` (nobody asked for logprobs here)."""
    return [CompletionOutput(index=i, text=b.text, token_ids=b.tokens[len(req.prompt_token_ids):],
                             cumulative_logprob=b.cum_logprob, logprobs=None,
                             finish_reason=b.finish_reason)
            for i, b in enumerate(output(req, tok).sequences)]


def beam_search(engine, prompt, params: BeamSearchParams,
                lora_request: LoRARequest | None = None) -> tuple[BeamSearchOutput, int]:
    """Beam search for one prompt on an idle Engine (every beam under `lora_request`'s
    adapter when given: paged_jax/lora), stepping it until the search ends.

    Returns:
      (the best `beam_width` beams, best first; the peak number of KV blocks in use).
    """
    if engine.has_unfinished():
        raise RuntimeError("beam_search needs an idle engine (add_beam_request runs beside "
                           "other requests)")
    rid = f"beam-search-{time.monotonic_ns()}"
    req = engine.add_beam_request(rid, prompt, params, lora_request=lora_request)
    peak = 0
    while not req.finished:
        engine.step()
        peak = max(peak, engine.kv.blocks_used())
    return output(req, engine.tokenizer), peak
