"""The engine on a Gemma 3-shaped model (sliding-window layers): batched generation equals
one request at a time through prefix caching, forced preemption, n > 1 and beam search.

The tiny model's 8-token window is far shorter than the prompts, so a kernel or cache path that
ignored the window, or read blocks it should not, would change the tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from paged_jax.engine import Engine
from paged_jax.llm import LLM
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_gemma3_config
from paged_jax.sampling_params import BeamSearchParams, SamplingParams
from tests import engine_helpers as helpers
from tests.engine_helpers import GREEDY, all_free, prompts, run, tokens

SHARED = "a system prompt that every request shares, longer than the window: "


@functools.cache
def model():
    c = tiny_gemma3_config()
    return c, random_params(c), byte_tokenizer()


def engine(**overrides) -> Engine:
    return helpers.engine(model(), **overrides)


def requests(n: int) -> list[tuple[str, str, SamplingParams]]:
    return [(str(i), SHARED + p, GREEDY) for i, p in enumerate(prompts(n))]


@pytest.fixture(scope="module")
def batched():
    eng = engine(enable_prefix_caching=True)
    outs = run(eng, requests(16), check=True)
    assert all_free(eng)
    assert sum(o.num_cached_tokens for o in outs.values()) > 0, "the prefix cache was not hit"
    return outs


def test_batched_equals_one_at_a_time(batched):
    eng = engine()
    for rid, p, sp in requests(16):
        assert tokens(run(eng, [("s" + rid, p, sp)]), "s" + rid) == tokens(batched, rid), rid
    assert all_free(eng)


def test_window_matters():
    """The same prompts on the model without its window give other tokens (the test can fail)."""
    c, params, tok = model()
    full = helpers.engine((dataclasses.replace(c, layer_types=("full_attention",) * 3),
                           params, tok))
    eng = engine()
    reqs = requests(4)
    assert any(tokens(run(full, [r]), r[0]) != tokens(run(eng, [r]), r[0]) for r in reqs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_loses_nothing(batched, mode):
    eng = engine(num_kv_blocks=24, preemption_mode=mode)
    outs = run(eng, requests(16), check=True)
    assert sum(s.preempted for s in eng.stats) > 0, "the small cache should force preemption"
    for rid, *_ in requests(16):
        assert tokens(outs, rid) == tokens(batched, rid), rid
    assert all_free(eng)


def test_parallel_sampling_and_beam_search():
    c, params, tok = model()
    llm = LLM(model_parts=(c, params, tok), max_num_seqs=8, max_model_len=256,
              num_kv_blocks=160, block_size=8, enable_prefix_caching=True, static_shapes=True)
    prompt = SHARED + "tell me more"
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in again.outputs]
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 12 for o in out.outputs)
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10,
                                                       ignore_eos=True))[0].sequences
    assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
    assert [b.cum_logprob for b in beams] == sorted((b.cum_logprob for b in beams), reverse=True)
    assert all_free(llm.llm_engine)
