"""Beam search: same beams as a brute-force reference; beams share blocks; nothing leaks."""

import numpy as np

from paged_jax.cache.config import CacheConfig
from paged_jax.engine.beam_search import beam_search
from paged_jax.models.reference_loop import PagedLoop
from paged_jax.sampling_params import BeamSearchParams
from tests.engine_helpers import all_free, engine, model


def reference_beams(prompt_ids, width, steps):
    """Textbook beam search, recomputing every candidate's prefix from scratch."""
    config, params, _ = model()

    def logprobs(tokens):
        r = PagedLoop(config, params, CacheConfig(64, 8, 1, 32))
        logits = r.step([tokens])[0]
        return logits - np.logaddexp.reduce(logits)

    beams = [([], 0.0)]
    for _ in range(steps):
        cands = []
        for toks, cum in beams:
            lp = logprobs(prompt_ids + toks)
            for t in np.argsort(-lp)[: 2 * width]:
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
