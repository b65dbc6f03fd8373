"""Beam search: same beams as a brute-force reference (with and without a logit bias); beams
share blocks; nothing leaks."""

import numpy as np
import pytest

from paged_jax.cache.config import CacheConfig
from paged_jax.engine import input as inp
from paged_jax.engine.beam_search import beam_search
from paged_jax.models.reference_loop import PagedLoop
from paged_jax.sampling_params import BeamSearchParams
from tests.engine_helpers import all_free, engine, model


def reference_beams(prompt_ids, width, steps, bias=None):
    """Textbook beam search, recomputing every candidate's prefix from scratch; `bias` [V]
    is added to the logits before the log-softmax (vLLM's order)."""
    config, params, _ = model()

    def logprobs(tokens):
        r = PagedLoop(config, params, CacheConfig(64, 8, 1, 32))
        logits = np.asarray(r.step([tokens])[0], np.float64)
        if bias is not None:
            logits = logits + bias
        return logits - np.logaddexp.reduce(logits)

    beams = [([], 0.0)]
    for _ in range(steps):
        cands = []
        for toks, cum in beams:
            lp = logprobs(prompt_ids + toks)
            for t in np.argsort(-lp, kind="stable")[: 2 * width]:
                if np.isfinite(lp[t]):
                    cands.append((toks + [int(t)], cum + float(lp[t])))
        beams = sorted(cands, key=lambda c: -c[1])[:width]
    return beams


def test_beams_match_reference_and_share_blocks():
    eng = engine()
    prompt = "beam me up"
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    out, peak = beam_search(eng, prompt, params)
    ids = eng.tokenizer.encode(prompt)
    ref = reference_beams(ids, 3, 5)
    got = sorted((s.tokens[len(ids):], s.cum_logprob) for s in out.sequences)
    want = sorted(ref)
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], atol=1e-4)
    for s in out.sequences:  # vLLM's per-position candidates: each chosen token among them
        new = s.tokens[len(ids):]
        pairs = list(zip(new, s.logprobs, strict=True))  # raises if the lengths differ
        assert all(t in d for t, d in pairs)
        assert np.isclose(sum(d[t].logprob for t, d in pairs), s.cum_logprob, atol=1e-4)
    independent = 3 * -(-(len(ids) + 5) // 8)
    assert peak < independent, (peak, independent)
    assert all_free(eng) and not eng.has_unfinished()


def test_logit_bias_allowed_ids_and_bad_words_steer_the_beams(monkeypatch):
    """BeamSearchParams' logit_bias, allowed_token_ids and bad_words score the beams on
    log_softmax(logits + bias), as the reference does; the plain search's beams differ, so
    a bias the search dropped would fail here."""
    eng = engine()
    ids = eng.tokenizer.encode("beam me up")
    plain = beam_search(eng, "beam me up", BeamSearchParams(3, 5, ignore_eos=True))[0]
    letters = list(range(ord("a"), ord("z") + 1))  # the byte tokenizer: id = byte
    top = plain.sequences[0].tokens[len(ids)]  # the plain search's favourite first token
    allowed = [t for t in letters if t != top] + [ord(" ")]
    bias = {ord("q"): 3.0, ord("z"): 2.5, ord(" "): -1.0}
    banned = (ord("e"),)  # " e" is two bytes: no real bad word is one token here
    monkeypatch.setattr(inp, "bad_word_ids", lambda sp, tok: banned)
    params = BeamSearchParams(3, 5, ignore_eos=True, logit_bias=bias,
                              allowed_token_ids=allowed, bad_words=["e"])
    out, _ = beam_search(eng, "beam me up", params)
    row = np.full(eng.model_config.vocab_size, -np.inf)
    row[allowed] = 0.0
    for t, b in bias.items():
        row[t] += b
    row[list(banned)] = -np.inf
    got = sorted((s.tokens[len(ids):], s.cum_logprob) for s in out.sequences)
    want = sorted(reference_beams(ids, 3, 5, row))
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], atol=1e-4)
    new = {t for s in out.sequences for t in s.tokens[len(ids):]}
    assert new <= set(allowed) and not new & set(banned)
    assert got != sorted((s.tokens[len(ids):], s.cum_logprob) for s in plain.sequences)
    for s in out.sequences:  # reported logprobs are the biased ones the beams were ranked by
        pairs = zip(s.tokens[len(ids):], s.logprobs, strict=True)
        assert np.isclose(sum(d[t].logprob for t, d in pairs), s.cum_logprob, atol=1e-4)
    assert all_free(eng) and not eng.has_unfinished()


def test_a_bias_outside_the_vocabulary_or_an_untokenizable_bad_word_is_refused():
    eng = engine()
    with pytest.raises(ValueError, match="logit_bias has token id 999"):
        beam_search(eng, "x", BeamSearchParams(2, 3, logit_bias={999: 1.0}))
    with pytest.raises(ValueError, match="bad_words.*2 tokens"):  # bytes: " x" is two
        beam_search(eng, "x", BeamSearchParams(2, 3, bad_words=["x"]))
    assert all_free(eng) and not eng.has_unfinished()


def _alone(prompt, params):
    out, _ = beam_search(engine(), prompt, params)
    return [(s.tokens, round(s.cum_logprob, 4)) for s in out.sequences]


@pytest.mark.parametrize("overrides", [
    dict(num_kv_blocks=40, max_num_seqs=8),  # a small pool: beams and samples preempted
    dict(num_kv_blocks=40, max_num_seqs=8, preemption_mode="swap", swap_space=1 << 30),
    dict(num_kv_blocks=40, max_num_seqs=8, async_scheduling=True),
])
def test_beam_requests_run_beside_sampled_ones_and_through_preemption(overrides):
    """Beam searches scheduled beside sampled requests, in a pool small enough to preempt
    them (beams are recomputed, never swapped), find the beams they find alone; the sampled
    requests get their own tokens; nothing is held afterwards (blocks or slots)."""
    from paged_jax.sampling_params import SamplingParams
    from tests.engine_helpers import prompts
    eng = engine(check=True, **overrides)
    beams = {f"b{i}": (p, BeamSearchParams(2 + i % 2, 14, ignore_eos=True))
             for i, p in enumerate(prompts(3))}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts(6)):  # the beams come in between: the latest preempted
        eng.add_request(f"s{i}", p + " and some more words" * 3, greedy)
        if i == 2:
            reqs = {rid: eng.add_beam_request(rid, p, bp) for rid, (p, bp) in beams.items()}
    outs = {}
    for _ in range(2000):  # bounded: a beam that can never finish fails here, not hangs
        outs |= {o.request_id: o for o in eng.step() if o.finished}
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished() and eng.scheduler.num_preempted > 0
    assert any(r.num_preemptions for r in reqs.values()), "no beam request was preempted"
    from paged_jax.engine.beam_search import output
    for rid, (p, bp) in beams.items():
        got = [(s.tokens, round(s.cum_logprob, 4)) for s in output(reqs[rid], eng.tokenizer)
               .sequences]
        assert got == _alone(p, bp), rid
        assert [c.token_ids for c in outs[rid].outputs] == [
            s.tokens[len(reqs[rid].prompt_token_ids):] for s in output(
                reqs[rid], eng.tokenizer).sequences]
    alone = engine()
    for i, p in enumerate(prompts(6)):
        alone.add_request(f"s{i}", p + " and some more words" * 3, greedy)
    while alone.has_unfinished():
        for o in alone.step():
            if o.finished:
                assert o.outputs[0].token_ids == outs[o.request_id].outputs[0].token_ids
    assert all_free(eng) and len(eng.kv.free_slots) == eng.config.max_num_seqs


def test_an_aborted_beam_request_gives_back_its_blocks_and_slots():
    eng = engine(check=True)
    eng.add_beam_request("b", "beam me up", BeamSearchParams(3, 20, ignore_eos=True))
    for _ in range(4):  # past its first forks
        eng.step()
    assert eng.requests["b"].forked
    eng.abort("b")
    assert all_free(eng) and len(eng.kv.free_slots) == eng.config.max_num_seqs
