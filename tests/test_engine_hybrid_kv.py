"""The hybrid KV cache (cache/groups.py) in the engine: sliding-window layers in groups of their
own give exactly the tokens of one group of every layer, while holding only their windows.

The tiny Gemma 3 model's 8-token window is far shorter than the prompts, so a group that
dropped a block its window still reads, or read a block another sequence took, would change
the tokens; the engine checks its host mirror and the allocator invariants (per group) after
every step.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from paged_jax.cache.groups import plan_groups
from paged_jax.engine.beam_search import beam_search
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.llm import LLM, kv_groups_for
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_gemma3_config
from paged_jax.sampling_params import BeamSearchParams, SamplingParams
from tests import engine_helpers as helpers
from tests.engine_helpers import all_free, prompts, run, tokens

SHARED = "a system prompt that every request shares, longer than the window: "
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@functools.cache
def model():
    c = tiny_gemma3_config()
    return c, random_params(c), byte_tokenizer()


def groups():
    c = model()[0]
    return plan_groups(tuple(c.window(i) for i in range(c.num_layers)))


def engine(hybrid: bool, **overrides):
    kw = {"enable_prefix_caching": False, **overrides}
    return helpers.engine(model(), kv_groups=groups() if hybrid else None, **kw)


def requests(n: int) -> list[tuple[str, str, SamplingParams]]:
    return [(str(i), SHARED + p, LONG) for i, p in enumerate(prompts(n))]


@pytest.fixture(scope="module")
def one_group():
    return run(engine(False), requests(12))


def test_groups_of_gemma_layouts():
    """Gemma 3's pattern (5 sliding : 1 full): 270M's 18 layers make 6 groups of 3, 1B's 26
    make 13 of 2; every group holds layers of one type; no windows: one group."""
    for n, size, local in ((18, 3, 5), (26, 2, 11)):
        windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(n))
        g = plan_groups(windows)
        assert g.num_buffers == size and g.windows.count(512) == local
        assert g.num_groups * size == n and g.windows.count(None) == g.num_groups - local
        for grp in range(g.num_groups):
            members = [i for i in range(n) if g.layer_group[i] == grp]
            assert {windows[i] for i in members} == {g.windows[grp]}
            assert sorted(g.layer_buffer[i] for i in members) == list(range(size))
    assert not plan_groups((None,) * 4).hybrid


@pytest.mark.parametrize("static,caching", [(True, False), (False, False), (True, True),
                                            (False, True)])
def test_hybrid_equals_one_group(one_group, static, caching):
    """With prefix caching too: every request after the first hits the shared prompt, in
    every group (the sliding ones only their window's blocks before the hit point)."""
    eng = engine(True, static_shapes=static, enable_prefix_caching=caching)
    outs = run(eng, requests(12), check=True)
    for rid, *_ in requests(12):
        assert tokens(outs, rid) == tokens(one_group, rid), rid
    if caching:
        assert eng.kv.prefix.hit_tokens >= 8 * len(SHARED) // 2, eng.kv.prefix.hit_tokens
    assert all_free(eng)


def test_prefix_hits_past_the_window_in_every_group(one_group):
    """The same requests twice: the second time each starts from the cache far past the
    8-token window (its sliding groups attach only the window's blocks, zero before), and
    gives the tokens it gave the first time; a pool too small for the cache to keep
    everything evicts per group and still never serves a wrong block."""
    for blocks, want in ((400, 0.9), (60, 0.0)):
        eng = engine(True, enable_prefix_caching=True, num_kv_blocks=blocks)
        first = run(eng, requests(6), check=True)
        again = [(rid + "'", p, sp) for rid, p, sp in requests(6)]
        before = eng.kv.prefix.hit_tokens
        second = run(eng, again, check=True)
        for rid, *_ in requests(6):
            assert tokens(second, rid + "'") == tokens(first, rid) == tokens(one_group, rid)
        hit = eng.kv.prefix.hit_tokens - before
        prompt = sum(len(p) for _, p, _ in again)
        assert hit >= want * prompt, (blocks, hit, prompt)
        assert all_free(eng)


def test_sliding_groups_hold_only_their_window():
    """After a long prompt and a few decodes, the pool holds what the per-group arithmetic
    says (CacheConfig.blocks_for), far less than G full tables would."""
    eng = engine(True, static_shapes=False, max_model_len=256)
    eng.add_request("a", "x" * 150, SamplingParams(max_tokens=30, ignore_eos=True))
    cc = eng.config.cache
    while eng.has_unfinished():
        eng.step()
        (seq,) = [s for r in eng.scheduler.running for s in r.seqs] or [None]
        if seq is None or seq.num_computed == 0:
            continue
        used = cc.usable_blocks - int(eng.state.pool.num_free)
        assert used == cc.blocks_for(seq.num_computed), seq.num_computed
        full = cc.num_groups * -(-seq.num_computed // cc.block_size)
        assert seq.num_computed < 100 or used < 0.6 * full
    assert all_free(eng)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_loses_nothing(one_group, mode, caching):
    eng = engine(True, num_kv_blocks=40, max_num_batched_tokens=16, preemption_mode=mode,
                 enable_prefix_caching=caching)
    outs = run(eng, requests(12), check=True)
    assert sum(s.preempted for s in eng.stats) > 0, "the small cache should force preemption"
    for rid, *_ in requests(12):
        assert tokens(outs, rid) == tokens(one_group, rid), rid
    assert all_free(eng)


NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)


@pytest.mark.parametrize("caching", [False, True])
def test_speculation_under_preemption_matches_one_group(one_group, caching):
    """n-gram speculation in a pool too small for every request (the fast tier's check of
    the slow test below): verify steps roll back, preempted sequences come back, and the
    windows still slide over the right blocks: one group's plain tokens. With prefix
    caching, rolled-back tokens are never registered (blocks register after the rollback)."""
    eng = engine(True, num_kv_blocks=40, max_num_batched_tokens=16, speculative=NGRAM,
                 enable_prefix_caching=caching)
    assert eng.config.cache.num_groups > 1
    outs = run(eng, requests(12), check=True)
    assert eng.scheduler.num_preempted > 0, "the small cache should force preemption"
    c = eng.scheduler.spec
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens, "drafts kept and rolled back"
    for rid, *_ in requests(12):
        assert tokens(outs, rid) == tokens(one_group, rid), rid
    assert all_free(eng)


DRAFT = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=3)


@pytest.mark.parametrize("caching,mode", [(False, "recompute"), (True, "recompute"),
                                          (True, "swap")])
def test_a_draft_model_on_groups_reads_every_block(one_group, caching, mode):
    """The target as its own draft, on groups, in a pool small enough to preempt and (the
    second time round) from prefix hits past the 8-token window: its pages follow the full
    group's tables, so its full-attention layers see the whole sequence and every greedy
    draft is kept (a draft on a sliding group's tables would read zero blocks past the
    window and lose drafts); the tokens are one group's plain ones."""
    c, p, _ = model()
    eng = engine(True, num_kv_blocks=60, max_num_batched_tokens=16, speculative=DRAFT,
                 draft=(c, p), enable_prefix_caching=caching, preemption_mode=mode)
    assert eng.config.cache.num_groups > 1
    again = [(rid + "'", q, sp) for rid, q, sp in requests(6)]
    outs = {**run(eng, requests(6), check=True), **run(eng, again, check=True)}
    for rid, *_ in requests(6):
        assert tokens(outs, rid) == tokens(outs, rid + "'") == tokens(one_group, rid), rid
    spec = eng.scheduler.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert eng.scheduler.num_preempted > 0, "the small pool should force preemption"
    if caching:
        assert eng.kv.prefix.hit_tokens > 0
    assert all_free(eng)


def test_parallel_samples_and_beams_match_one_group():
    """n = 3 (forks in a step) and beam search (forks as ops, copy-on-write), one request
    each on the tests' static shapes (the fast tier's check of the slow test below): the
    tokens and scores of one group."""
    prompt = SHARED + "tell me more, tell me more"
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    beam = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    got, scores = {}, {}
    for hybrid in (True, False):
        eng = engine(hybrid, enable_prefix_caching=hybrid)  # groups with caching vs neither
        assert (eng.config.cache.num_groups > 1) == hybrid
        samples = tokens(run(eng, [("n3", prompt, sp)], check=True), "n3")
        out, _ = beam_search(eng, prompt, beam)
        got[hybrid] = samples, [b.tokens for b in out.sequences]
        scores[hybrid] = [b.cum_logprob for b in out.sequences]
        assert len(set(map(tuple, samples))) > 1, "three samples, not one copied"
        assert all_free(eng)
    assert got[True] == got[False]
    np.testing.assert_allclose(scores[True], scores[False], atol=1e-4)


def llm(hybrid: bool, **kw) -> LLM:
    return LLM(model_parts=model(), max_num_seqs=8, max_model_len=256, num_kv_blocks=300,
               block_size=8, hybrid_kv_cache=hybrid, **kw)  # prefix caching on (default)


def test_parallel_sampling_beams_and_speculation_match_one_group():
    """n > 1 (forks in a step), beam search (forks as ops, copy-on-write) and n-gram
    speculative decoding (verify steps roll back before the windows slide) give the tokens
    of one group."""
    prompt = SHARED + "tell me more, tell me more, tell me more"
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    beam = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    got = {}
    for hybrid in (True, False):
        eng = llm(hybrid)
        assert (eng.engine_config.kv_groups is not None) == hybrid
        samples = [o.token_ids for o in eng.generate([prompt], sp, use_tqdm=False)[0].outputs]
        beams = [(b.tokens, b.cum_logprob) for b in eng.beam_search([prompt], beam)[0].sequences]
        greedy = llm(hybrid, **spec).generate([prompt], LONG, use_tqdm=False)[0]
        got[hybrid] = samples, [b[0] for b in beams], greedy.outputs[0].token_ids
        np.testing.assert_allclose([b[1] for b in beams], sorted((b[1] for b in beams),
                                                                 reverse=True))
        assert all_free(eng.llm_engine)
    assert got[True] == got[False]


def test_blocks_a_long_chunk_fills_and_slides_past_stay_cached():
    """One 150-token chunk fills 18 columns and its own slide drops all but the window's in
    the sliding groups: those blocks are cached first, so a later prompt sharing 100 tokens
    hits 96 of them (its window's columns were slid past in that one step) and gives one
    group's tokens."""
    a, b = "q" * 40 + SHARED + "z" * 40, None
    b = a[:100] + "a different question?"
    got = {}
    for hybrid in (True, False):
        eng = engine(hybrid, enable_prefix_caching=True, max_num_batched_tokens=256,
                     static_shapes=False)
        run(eng, [("a", a, LONG)], check=True)
        out = run(eng, [("b", b, LONG)], check=True)["b"]
        got[hybrid] = tokens({"b": out}, "b"), out.num_cached_tokens
    assert got[True] == got[False] and got[True][1] == 96, got


def test_auto_choice_and_refusals():
    from paged_jax.serve.cli import HYBRID, parser

    assert HYBRID[parser().parse_args(["m.gguf", "--hybrid-kv-cache", "off"]).hybrid_kv_cache] \
        is False
    c = model()[0]
    assert kv_groups_for(c, None, False, None) == groups()
    assert kv_groups_for(c, None, True, None) == groups()  # with prefix caching too
    assert kv_groups_for(c, None, True, DRAFT) == groups()  # and a draft model
    assert kv_groups_for(c, False, False, None) is None
    every_layer_slides = plan_groups((8, 8))
    with pytest.raises(ValueError, match="every layer of this model slides"):
        EngineConfig(**{**helpers.BASE, "kv_groups": every_layer_slides, "speculative": DRAFT})
    assert kv_groups_for(helpers.model()[0], True, False, None) is None  # no windows
    on = LLM(model_parts=model(), enable_prefix_caching=True, num_kv_blocks=64,
             max_model_len=128)  # the defaults: prefix caching on, groups on
    assert on.engine_config.kv_groups == groups() and on.engine_config.enable_prefix_caching
