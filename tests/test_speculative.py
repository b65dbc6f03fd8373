"""Speculative decoding (engine/speculative.py, engine/verify.py): n-gram drafts verified in
one ragged step. The same outputs as plain decoding (greedy, seeded sampling, stop strings,
max_tokens inside an accepted run, preemption, prefix hits, mixed batches), the KV manager's
mirror equal to the device after every step (rolled-back tokens freed), and a sampled
distribution that a chi-square test cannot tell from plain decoding's."""

from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import compile_cache
from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.config import CacheConfig
from paged_jax.compile_cache import relieve_jit_mappings
from paged_jax.engine import EngineConfig
from paged_jax.engine import speculative as spec_lib
from paged_jax.engine.programs import PROGRAMS
from paged_jax.engine.speculative import SpeculativeConfig, ngram_propose
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import BUCKETS, all_free, engine, run

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
# Prompts that repeat themselves, so drafts are found and (on the tiny model) partly accepted.
PROMPTS = ["abcabcabcabc", "the cat sat on the mat. the cat sat on the", "xyzxyz xyzxyz xyz",
           "one two one two one two", "lorem ipsum lorem ipsum", "aaaa bbbb aaaa bbbb aaaa"]


def outputs(outs: dict) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for rid, o in outs.items()}


def both(reqs, **overrides):
    """`reqs` on a plain engine and on a speculating one: (plain, speculative outputs, the
    speculating engine)."""
    plain = run(engine(**BUCKETS, **overrides), reqs)
    eng = engine(**BUCKETS, speculative=SPEC, **overrides)
    return outputs(plain), outputs(run(eng, reqs)), eng


def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 1, 3) == [7, 8]
    assert ngram_propose([5, 1, 2, 6, 1, 2], 4, 1, 2) == [6, 1, 2]  # stops at the end
    assert ngram_propose([4, 5, 6], 3, 1, 3) == []  # nothing recurs
    assert ngram_propose([3, 3, 3], 2, 1, 2) == [3]  # overlapping match: the last token
    assert ngram_propose([1, 2, 9, 2], 3, 2, 2) == []  # only n-grams of the asked length


def test_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="takes none"):
        SpeculativeConfig.of({"method": "ngram", "model": "qwen2.5-coder-0.5b"})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.of({"method": "ngram", "lookahead": 3})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.of({"method": "eagle"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative=SPEC, async_scheduling=True)
    assert SpeculativeConfig.of({"num_speculative_tokens": 2}).k == 2


def test_truncate_frees_whole_blocks_past_the_new_end():
    cfg = CacheConfig(num_blocks=16, block_size=4, max_seqs=2, max_blocks_per_seq=4)
    pool, table = pool_lib.init_pool(16), pt.init_page_table(cfg)
    table = pt.add_sequences(table, jnp.array([0, 1], jnp.int32))
    pool, table, _, ok = pt.reserve_tokens(pool, table, jnp.array([10, 5], jnp.int32))
    assert ok and int(pool.num_free) == 15 - 5
    pool, table = pt.truncate(pool, table, jnp.array([5, 5], jnp.int32))  # 3 blocks -> 2
    assert np.asarray(table.seq_lens).tolist() == [5, 5]
    assert int(pool.num_free) == 11 and int((np.asarray(table.block_tables[0, 0]) != 0).sum()) == 2
    pool, table = pt.truncate(pool, table, jnp.array([4, 1], jnp.int32))
    assert int(pool.num_free) == 13


def test_greedy_is_identical_and_drafts_are_accepted_and_rolled_back():
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = [(str(i), p, greedy) for i, p in enumerate(PROMPTS)]
    plain, spec, eng = both(reqs)
    assert spec == plain
    c = eng.scheduler.spec
    assert c.num_accepted_tokens > 0, "no draft accepted: the test exercises nothing"
    assert c.num_accepted_tokens < c.num_draft_tokens, "no draft rejected: no rollback tested"
    kinds = {s.kind for s in eng.stats}
    assert "verify" in kinds
    assert all_free(eng)


def test_the_same_work_again_compiles_no_verify_program():
    """Verify buckets come from the rows' token counts (prefix caching off: hits would
    change the prefill steps and the copy-on-write bound)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    second_run_compiles_no_verify(engine(**BUCKETS, speculative=SPEC,
                                         enable_prefix_caching=False), greedy)


def second_run_compiles_no_verify(eng, sp: SamplingParams) -> None:
    """PROMPTS through `eng` twice: the second time compiles no verify program and gives
    the first time's tokens. The runner may drop every compiled program when the process
    nears its memory-mapping limit (compile_cache.relieve_jit_mappings), which would empty
    the cache being counted: room is made first, and no drop happens in between."""
    relieve_jit_mappings(fraction=0.3)
    with mock.patch.object(compile_cache, "relieve_jit_mappings", lambda *a, **k: False):
        first = run(eng, [(str(i), p, sp) for i, p in enumerate(PROMPTS)])
        before = PROGRAMS.built_by["run_verify"]
        again = run(eng, [(f"again {i}", p, sp) for i, p in enumerate(PROMPTS)])
        assert PROGRAMS.built_by["run_verify"] == before
    assert [again[f"again {i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        first[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]


def stop_requests() -> list[tuple[str, str, SamplingParams]]:
    """Greedy requests whose max_tokens, stop strings and logprobs land inside runs of
    accepted drafts."""
    greedy = lambda **kw: SamplingParams(temperature=0.0, ignore_eos=True, **kw)  # noqa: E731
    return [r for i, p in enumerate(PROMPTS) for r in (
        (f"m{i}", p, greedy(max_tokens=3 + i)),
        (f"t{i}", p, greedy(max_tokens=30, stop=["a", "o"])),
        (f"l{i}", p, greedy(max_tokens=12, logprobs=2)))]


def test_seeded_sampling_stop_strings_and_max_tokens_are_identical():
    reqs = stop_requests() + [
        (f"s{i}", p, SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=i,
                                    max_tokens=20, ignore_eos=True))
        for i, p in enumerate(PROMPTS)]
    plain, spec, eng = both(reqs)
    assert spec == plain
    assert eng.scheduler.spec.num_accepted_tokens > 0
    assert all_free(eng)


def test_logprobs_of_accepted_tokens_match_plain_decoding():
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    reqs = [(str(i), p, sp) for i, p in enumerate(PROMPTS[:3])]
    a = run(engine(**BUCKETS), reqs)
    b = run(engine(**BUCKETS, speculative=SPEC), reqs)
    for rid in a:
        x, y = a[rid].outputs[0], b[rid].outputs[0]
        assert [sorted(e) for e in x.logprobs] == [sorted(e) for e in y.logprobs]
        chosen = lambda o: [e[t].logprob for e, t in zip(o.logprobs, o.token_ids, strict=True)]  # noqa: E731
        np.testing.assert_allclose(chosen(x), chosen(y), atol=1e-4)


def test_preemption_during_speculation_gives_plain_tokens():
    """The fast tier's check of the slow test below (on the tests' static shapes, recompute
    preemption): sequences preempted between verify steps come back and give plain
    decoding's tokens, no step refused, every block freed."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reqs = [(str(i), p * 2, greedy) for i, p in enumerate(PROMPTS)]
    plain = outputs(run(engine(), reqs))
    eng = engine(speculative=SPEC, num_kv_blocks=24)
    assert outputs(run(eng, reqs)) == plain
    assert eng.scheduler.num_preempted > 0 and eng.scheduler.refused_steps == 0
    assert eng.scheduler.spec.num_accepted_tokens > 0
    assert all_free(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_the_middle_of_speculation(mode):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reqs = [(str(i), p * 2, greedy) for i, p in enumerate(PROMPTS * 2)]
    plain, spec, eng = both(reqs, num_kv_blocks=24, preemption_mode=mode)
    assert spec == plain
    assert eng.scheduler.num_preempted > 0 and eng.scheduler.refused_steps == 0
    assert eng.scheduler.spec.num_accepted_tokens > 0
    assert all_free(eng)


def test_prefix_hits_and_mixed_batches():
    """Shared prefixes hit the cache; requests with penalties decode beside speculating
    ones in the same steps (they draft nothing)."""
    shared = "a shared system prompt, long enough to fill blocks. "
    reqs = []
    for i, p in enumerate(PROMPTS):
        pen = i % 2 == 0
        reqs.append((str(i), shared + p, SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True,
            repetition_penalty=1.3 if pen else 1.0)))
    plain, spec, eng = both(reqs, enable_prefix_caching=True)
    assert spec == plain
    assert eng.scheduler.spec.num_accepted_tokens > 0
    assert eng.prefix is not None and eng.prefix.hit_tokens > 0
    mixed = [s for s in eng.stats if s.kind == "verify" and s.running > 1]
    assert mixed, "no verify step ran with several sequences"


def test_batch_size_limit_turns_speculation_off():
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reqs = [(str(i), p, greedy) for i, p in enumerate(PROMPTS)]
    off = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    eng = engine(**BUCKETS, speculative=off)
    got = outputs(run(eng, reqs))
    assert got == outputs(run(engine(**BUCKETS), reqs))
    # drafts only once fewer than 2 sequences decode
    assert all(s.running < 2 for s in eng.stats if s.kind == "verify")


def _sharp_parts():
    from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config

    c = tiny_config()
    return c, random_params(c, scale=3.0), byte_tokenizer()


def _samples(spec, seeds: range, position: int, monkeypatch) -> np.ndarray:
    """The token each seeded request samples at `position` (temperature 1) on a tiny model
    with sharp logits. With `spec`, the drafts are the model's greedy continuation (a
    proposer that is often, not always, right at temperature 1: the random model copies
    nothing, so n-gram drafts would all be rejected and test nothing)."""
    prompt, parts = "abcdefgh " * 3, _sharp_parts()
    eng = engine(parts=parts, **BUCKETS, speculative=spec, check=False)
    if spec is not None:
        greedy = run(engine(parts=parts, **BUCKETS, check=False), [("g", prompt, SamplingParams(
            temperature=0.0, max_tokens=position + 1, ignore_eos=True))])["g"]
        start, cont = len(greedy.prompt_token_ids), greedy.outputs[0].token_ids
        monkeypatch.setattr(spec_lib, "ngram_propose",
                            lambda toks, k, *_: cont[len(toks) - start:][:k])
    return seeded_tokens(eng, prompt, seeds, position, position + 1)


def seeded_tokens(eng, prompt: str, seeds: range, position: int, max_tokens: int) -> np.ndarray:
    """The token each seeded request (temperature 1) samples at `position`; with
    speculation, some drafts must have been kept and some not."""
    reqs = [(str(s), prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens,
                                           ignore_eos=True)) for s in seeds]
    outs, wave = {}, eng.config.max_num_seqs
    for i in range(0, len(reqs), wave):  # in waves: a step that admits does not draft
        outs |= run(eng, reqs[i:i + wave])
    if eng.config.speculative is not None:
        c = eng.scheduler.spec
        assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    return np.array([outs[str(s)].outputs[0].token_ids[position] for s in seeds])


def test_sampled_distribution_matches_plain_decoding_chi_square(monkeypatch):
    """Independent seeds on each side (not the same draws): the token frequencies at the
    6th output position pass a chi-square homogeneity test at p > 0.001."""
    a = _samples(None, range(0, 600), 5, monkeypatch)
    b = _samples(SPEC, range(1000, 1600), 5, monkeypatch)
    p = homogeneity_p(a, b)
    assert p > 1e-3, f"speculative sampling differs from plain sampling (p = {p:.2g})"


def homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity p-value of two token samples (tokens seen under 10 times
    pooled: the test needs expected counts); fails if fewer than 3 columns remain."""
    from scipy.stats import chi2_contingency

    vals = sorted(set(a) | set(b))
    table = np.array([[np.sum(a == v) for v in vals], [np.sum(b == v) for v in vals]])
    keep = table.sum(0) >= 10  # chi-square needs expected counts; rare tokens pooled
    table = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] >= 3, "too few distinct tokens: the test cannot tell anything"
    return chi2_contingency(table).pvalue


def test_llm_and_server_take_vllms_speculative_config():
    """LLM(speculative_config=...) gives plain decoding's tokens; the server streams them and
    counts drafts under vLLM's metric names; the CLI parses --speculative-config JSON."""
    import httpx
    import openai

    from paged_jax.serve.cli import parser
    from tests.serve_helpers import MODEL, metric, serve, tiny_llm

    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].text for o in tiny_llm().generate(PROMPTS, sp, use_tqdm=False)]
    llm = tiny_llm(speculative_config=cfg)
    assert not llm.engine_config.async_scheduling
    assert [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == plain
    with pytest.raises(FileNotFoundError, match="model path not found: x"):
        tiny_llm(speculative_config={"model": "x"})
    a = parser().parse_args(["--speculative-config", '{"num_speculative_tokens": 2}'])
    assert a.speculative_config == {"num_speculative_tokens": 2}
    with serve(speculative_config=cfg) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
        for p, want in zip(PROMPTS, plain, strict=True):
            chunks = c.completions.create(model=MODEL, prompt=p, temperature=0.0,
                                          max_tokens=16, stream=True,
                                          extra_body={"ignore_eos": True})
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
        assert metric(text, "vllm:spec_decode_num_drafts_total") > 0
        assert 0 < accepted <= drafts


def test_an_n_gt_1_prompt_forks_in_a_plain_step_not_a_verify():
    """A verify call does not fork: an n > 1 prompt whose last token was left to a decode
    step beside rows with drafts once had its children's rows written unforked, leaving a
    dead slot holding a length (the host mirror check after every step caught it). This
    mix (snapshot_helpers' first 8 requests) leaves such a token."""
    from tests.snapshot_helpers import workload

    reqs = workload(beams=False)[:8]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    eng = engine(speculative=spec, num_kv_blocks=400, decode_window=1)
    done = run(eng, reqs)
    assert sorted(done) == sorted(r for r, _, _ in reqs)
    assert all(len(done[r].outputs) == sp.n for r, _, sp in reqs)
    assert eng.scheduler.spec.num_drafts > 0
