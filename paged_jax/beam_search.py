"""Beam search on the engine's device state: beams are sequences that fork and free blocks.

    prompt prefill (one slot) -> top 2W next tokens
    each step: keep the W best (beam, token) candidates by cumulative logprob;
      a beam chosen k times is forked k-1 times (its blocks shared, refcount + k-1);
      a beam not chosen is released; the chosen tokens are decoded (one forced-token step)
      and give the next top 2W per beam. Copy-on-write splits a shared last block on write.

The host drives the loop (a beam decision needs every beam's candidates); each step's device
work is the same jitted `run_step` the engine uses, returning the top 2W logprobs per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import batch as batch_lib
from paged_jax import engine_input as inp
from paged_jax import page_table as pt
from paged_jax.engine import Engine, _to_host
from paged_jax.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from paged_jax.sampling import SampleFlags
from paged_jax.sampling_params import BeamSearchParams, SamplingParams
from paged_jax.scheduler import Plan
from paged_jax.sequence import Request, Sequence
from paged_jax.sizes import cdiv
from paged_jax.step import StepShape, decode_batch, run_step

_fork = jax.jit(pt.fork, donate_argnums=(0, 1))
_add = jax.jit(pt.add_sequence, donate_argnums=(0,))


@dataclasses.dataclass
class _Beam:
    slot: int
    tokens: list[int]
    cum: float = 0.0
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)


def beam_search(engine: Engine, prompt, params: BeamSearchParams) -> tuple[BeamSearchOutput, int]:
    """Beam search for one prompt on an idle engine.

    Returns:
      (the best `beam_width` beams, best first; the peak number of KV blocks in use).
    """
    if engine.has_unfinished():
        raise RuntimeError("beam_search needs an idle engine")
    w = params.beam_width
    text, ids = inp.prompt_ids(prompt, engine.tokenizer)
    inp.check_fits(SamplingParams(n=w, max_tokens=params.max_tokens, temperature=1.0), ids,
                  engine.config, engine.model_config)
    k = min(2 * w, engine.model_config.vocab_size)
    flags = SampleFlags(random=False, filters=False, penalties=False, logprobs=True,
                        num_top_logprobs=k, bias=False)
    free = engine.kv.free_slots
    slots = [free.pop() for _ in range(w)]
    try:
        return _search(engine, flags, ids, slots, params)
    finally:
        engine.kv.release_slots(slots)
        free.extend(reversed(slots))


def _search(engine, flags, ids, slots, params) -> tuple[BeamSearchOutput, int]:
    w, eos = params.beam_width, set(engine.model_config.eos_token_ids)
    top = _prefill(engine, flags, ids, slots[0])
    beams, done, peak = [_Beam(slots[0], [])], [], 0
    for step in range(params.max_tokens):
        cands = sorted(((b.cum + lp, b, t) for b in beams for t, lp in top[b.slot]),
                       key=lambda c: -c[0])
        entries = {b.slot: _entries(engine, top[b.slot]) for b in beams}
        chosen = []
        for score, b, t in cands:
            b = dataclasses.replace(b, logprobs=b.logprobs + [entries[b.slot]])
            if t in eos and not params.ignore_eos:
                done.append(_Beam(-1, b.tokens + [t], score, b.logprobs))
            else:
                chosen.append((score, b, t))
            if len(chosen) == w:
                break
        if not chosen or step == params.max_tokens - 1:
            done += [_Beam(-1, b.tokens + [t], s, b.logprobs) for s, b, t in chosen]
            break
        beams = _regroup(engine, chosen, slots)
        peak = max(peak, engine.config.num_kv_blocks - 1 - int(engine.state.pool.num_free))
        top = _decode(engine, flags, beams)
    return _output(engine, ids, done, params), peak


def _prefill(engine, flags, ids, slot) -> dict[int, list[tuple[int, float]]]:
    """Computes the prompt in slot `slot` (chunked); returns its top 2W next tokens."""
    engine.state = dataclasses.replace(engine.state, table=_add(engine.state.table, slot))
    req = Request("beam", None, ids, SamplingParams(temperature=0.0), 0.0, order=0)
    seq = Sequence(0, list(ids), len(ids), slot=slot, owner=req)
    req.seqs = [seq]
    eos, vocab = list(engine.model_config.eos_token_ids), engine.model_config.vocab_size
    out = None
    while seq.num_pending > 0:
        n = min(seq.num_pending, engine.config.max_num_batched_tokens)
        engine.kv.make_room(cdiv(seq.num_computed + n, engine.config.block_size)
                            - cdiv(seq.num_computed, engine.config.block_size))
        batch, shape, _, _ = batch_lib.build_step(Plan(chunks=[(seq, n)]), engine.config, [],
                                                  eos, vocab, engine.step_cfg.backend)
        engine.state, o = run_step(engine.params, engine.state, batch, cfg=engine.step_cfg,
                                   shape=dataclasses.replace(shape, flags=flags))
        out = _to_host(o)
        if not out.ok:
            raise RuntimeError("KV cache exhausted during beam search's prompt")
        seq.num_computed += n
    return {slot: list(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist(), strict=True))}


def _regroup(engine, chosen, slots) -> list[_Beam]:
    """Forks beams chosen several times, releases beams not chosen; one slot per new beam."""
    parents = {b.slot for _, b, _ in chosen}
    keep = {}
    free = [s for s in slots if s not in parents]
    src, dst, beams = [], [], []
    for score, b, t in chosen:
        if b.slot not in keep:
            keep[b.slot] = True
            beams.append(_Beam(b.slot, b.tokens + [t], score, b.logprobs))
        else:
            s = free.pop()
            src.append(b.slot)
            dst.append(s)
            beams.append(_Beam(s, b.tokens + [t], score, b.logprobs))
    engine.kv.release_slots([s for s in slots if s not in keep])  # fork targets must be empty
    if src:
        pad = engine.config.max_num_seqs
        fs = np.full(pad, -1, np.int32)
        fd = np.zeros(pad, np.int32)
        fs[: len(src)], fd[: len(dst)] = src, dst
        pool, table = _fork(engine.state.pool, engine.state.table, jnp.asarray(fs),
                            jnp.asarray(fd))
        engine.state = dataclasses.replace(engine.state, pool=pool, table=table)
    return beams


def _decode(engine, flags, beams) -> dict[int, list[tuple[int, float]]]:
    """Feeds each beam's newest token (a forced decode step); returns each beam's top 2W."""
    r = batch_lib.next_pow2(len(beams))
    row_slots, tokens = np.full(r, -1, np.int32), np.zeros(r, np.int32)
    for i, b in enumerate(beams):
        row_slots[i], tokens[i] = b.slot, b.tokens[-1]
    ends = [int(n) + 1 for n in np.asarray(engine.state.table.seq_lens)[row_slots[:len(beams)]]]
    ec = engine.config
    # Forked beams share their last block until they write it: every row may copy.
    shape = StepShape(max_q=1, max_copies=r, max_pages=batch_lib.page_bucket(max(ends), ec),
                      decode_pages=batch_lib.decode_page_bucket(ends, ec, r), flags=flags)
    engine.kv.make_room(2 * len(beams))  # a new block and a private copy per beam at most
    batch = decode_batch(jnp.asarray(row_slots), jnp.asarray(tokens), jnp.asarray(row_slots >= 0),
                         engine.state.table.seq_lens)
    engine.state, o = run_step(engine.params, engine.state, batch, cfg=engine.step_cfg,
                               shape=shape)
    out = _to_host(o)
    if not out.ok:
        raise RuntimeError("KV cache exhausted during beam search")
    return {b.slot: list(zip(out.top_ids[i].tolist(), out.top_logprobs[i].tolist(), strict=True))
            for i, b in enumerate(beams)}


def _entries(engine, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """A beam position's top 2W candidates as vLLM reports them (rank, decoded text)."""
    return {t: Logprob(lp, rank=r + 1, decoded_token=engine.tokenizer.decode([t], False))
            for r, (t, lp) in enumerate(top)}


def _output(engine, ids, done, params) -> BeamSearchOutput:
    def score(b: _Beam) -> float:
        n = len(ids) + len(b.tokens)
        n -= int(b.tokens[-1:] and b.tokens[-1] in engine.model_config.eos_token_ids)
        return b.cum / max(n, 1) ** params.length_penalty

    best = sorted(done, key=score, reverse=True)[: params.beam_width]
    return BeamSearchOutput([
        BeamSearchSequence(tokens=list(ids) + b.tokens, logprobs=b.logprobs, cum_logprob=b.cum,
                           text=engine.tokenizer.decode(b.tokens),
                           finish_reason="stop" if b.tokens and b.tokens[-1] in
                           engine.model_config.eos_token_ids else "length")
        for b in best])
