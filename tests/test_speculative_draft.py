"""Speculative decoding with a draft model (engine/draft.py, engine/verify.py's rejection
rule): greedy output identical to plain decoding with a draft that is always right, partly
right and never right; seeded sampling reproducible; preemption, prefix hits and mixed
batches; the KV manager's mirror equal to the device after every step; a sampled distribution
that a chi-square test cannot tell from plain decoding's; LLM and server take vLLM's
`{"model": ...}` config."""

from unittest import mock

import jax
import numpy as np
import pytest

from paged_jax import compile_cache
from paged_jax.compile_cache import relieve_jit_mappings
from paged_jax.engine.programs import PROGRAMS
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.models.testing import random_params, tiny_config
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import BUCKETS, all_free, engine, model, run
from tests.test_speculative import (
    PROMPTS,
    homogeneity_p,
    outputs,
    second_run_compiles_no_verify,
    seeded_tokens,
    stop_requests,
)

SPEC = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def near(params, eps: float, seed: int = 7):
    """A draft that agrees with the target often, not always: its weights plus noise of
    `eps` times each matrix's spread (0.3 keeps about a third of greedy drafts here)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (a + eps * np.std(a) * rng.standard_normal(a.shape)).astype(
        a.dtype) if a.ndim >= 2 else a, params)


def drafted(draft, reqs, spec=SPEC, **overrides):
    """(plain outputs, speculative outputs, the speculating engine) of `reqs`."""
    c, p, _ = model()
    plain = outputs(run(engine(**BUCKETS, **overrides), reqs))
    eng = engine(**BUCKETS, speculative=spec, draft=(c, draft(p)), **overrides)
    return plain, outputs(run(eng, reqs)), eng


@pytest.mark.parametrize("kind", ["same", "near", "other"])
def test_greedy_is_plain_decoding_whatever_the_draft(kind):
    """The target itself as draft keeps every draft; a noisy copy some; an unrelated model
    none. Each gives plain decoding's tokens, with rolled-back blocks freed."""
    other = tiny_config(num_layers=1)
    draft = {"same": lambda p: p, "near": lambda p: near(p, 0.3),
             "other": lambda p: random_params(other, seed=3)}[kind]
    reqs = [(str(i), q, GREEDY) for i, q in enumerate(PROMPTS)]
    if kind == "other":
        c, p, _ = model()
        plain = outputs(run(engine(**BUCKETS), reqs))
        eng = engine(**BUCKETS, speculative=SPEC, draft=(other, draft(p)))
        spec = outputs(run(eng, reqs))
    else:
        plain, spec, eng = drafted(draft, reqs)
    assert spec == plain
    c = eng.scheduler.spec
    assert c.num_draft_tokens > 0
    if kind == "same":
        assert c.num_accepted_tokens == c.num_draft_tokens
    elif kind == "near":
        assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert all_free(eng)


def test_stops_logprobs_and_max_tokens_inside_accepted_runs():
    plain, spec, eng = drafted(lambda p: p, stop_requests())
    assert spec == plain
    assert eng.scheduler.spec.num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible():
    reqs = [(str(i), p, SamplingParams(temperature=0.8, top_k=30, seed=i, max_tokens=20,
                                        ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    c, p, _ = model()
    runs = [outputs(run(engine(**BUCKETS, speculative=SPEC, draft=(c, near(p, 0.3))), reqs))
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_the_middle_of_speculation(mode):
    """Sequences preempted between verify steps come back with draft_computed 0: the draft
    reads their whole context again (a swapped-in block carries no draft K/V)."""
    reqs = [(str(i), p * 2, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for i, p in enumerate(PROMPTS * 2)]
    plain, spec, eng = drafted(lambda p: near(p, 0.1), reqs, num_kv_blocks=24,
                               preemption_mode=mode)
    assert spec == plain
    assert eng.scheduler.num_preempted > 0 and eng.scheduler.refused_steps == 0
    assert eng.scheduler.spec.num_accepted_tokens > 0
    assert all_free(eng)


def test_prefix_hits_mixed_batches_and_long_catch_up():
    """Prefix hits (the draft reads the hit again), rows with penalties beside speculating
    ones, and a catch-up budget smaller than the prompts (the draft catches up over several
    steps before it drafts)."""
    shared = "a shared system prompt, long enough to fill blocks. "
    reqs = [(str(i), shared + p, SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True,
        repetition_penalty=1.3 if i % 2 == 0 else 1.0)) for i, p in enumerate(PROMPTS)]
    assert min(len(shared + p) for p in PROMPTS) > 32  # byte tokens: catch-up in parts
    plain, spec, eng = drafted(lambda p: p, reqs, enable_prefix_caching=True,
                               max_num_batched_tokens=32)
    assert spec == plain
    assert eng.prefix is not None and eng.prefix.hit_tokens > 0
    assert eng.scheduler.spec.num_accepted_tokens > 0
    assert any(s.kind == "verify" and s.running > 1 for s in eng.stats)


def test_the_same_work_again_compiles_no_verify_program():
    c, p, _ = model()
    second_run_compiles_no_verify(engine(**BUCKETS, speculative=SPEC, draft=(c, near(p, 0.3)),
                                         enable_prefix_caching=False), GREEDY)


def test_one_at_a_time_after_warm_up_compiles_no_verify_program():
    """Batch 1, as the experiment's batch-1 cells: after one warm-up request, prompts of
    other lengths whose max_tokens end anywhere in a run of drafts (fewer drafts fit) build
    no verify program: a draft model's verify shape follows the row bucket alone."""
    c, p, _ = model()
    eng = engine(**BUCKETS, speculative=SPEC, draft=(c, near(p, 0.3)),
                 enable_prefix_caching=False)
    relieve_jit_mappings(fraction=0.3)  # no program dropped while counting (test_speculative)
    with mock.patch.object(compile_cache, "relieve_jit_mappings", lambda *a, **k: False):
        run(eng, [("warm", PROMPTS[0], GREEDY)])
        before = PROGRAMS.built_by["run_verify"]
        for i, prompt in enumerate(PROMPTS[1:]):
            for most in (5, 6, 7, 13):
                sp = SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True)
                assert run(eng, [(f"{i} {most}", prompt, sp)])[f"{i} {most}"].outputs
        assert PROGRAMS.built_by["run_verify"] == before
    assert eng.scheduler.spec.num_draft_tokens > 0


STOPPING = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=3,
                             draft_stop_probability=0.5)


@pytest.mark.parametrize("kind", ["same", "near"])
def test_rows_that_stop_drafting_early_keep_plain_tokens(kind):
    """A row stops drafting once its drafts' probability under the draft falls below 0.5
    (the tiny random model is rarely that sure): plain decoding's tokens still, fewer drafts
    made than k per verify row, and the metrics count the drafts made (the target as its
    own draft keeps every one it made)."""
    draft = {"same": lambda p: p, "near": lambda p: near(p, 0.3)}[kind]
    reqs = [(str(i), q, GREEDY) for i, q in enumerate(PROMPTS)]
    plain, spec, eng = drafted(draft, reqs, spec=STOPPING)
    assert spec == plain
    c = eng.scheduler.spec
    assert 0 < c.num_drafts <= c.num_draft_tokens < STOPPING.k * c.num_drafts
    if kind == "same":
        assert c.num_accepted_tokens == c.num_draft_tokens
    assert all_free(eng)


def _codes(w):
    """A runtime weight's stored values and scales: the CPU kernel's panels (Packed), the
    GPU kernel's codes (QuantWeight), or a plain float array (scales None)."""
    for codes in ("panels", "q"):
        if hasattr(w, codes):
            return getattr(w, codes), w.scales
    return w, None


def quantized_draft(quantization: str, **overrides):
    """An engine whose draft is the target itself, stored as `quantization` codes."""
    c, p, _ = model()
    spec = SpeculativeConfig(method="draft_model", model="tiny", quantization=quantization,
                             num_speculative_tokens=3)
    return engine(speculative=spec, draft=(c, p), **overrides)


@pytest.mark.parametrize("quantization, per_byte", [("int8", 1), ("int4", 2)])
def test_quantized_draft_is_stored_as_codes(quantization, per_byte):
    """speculative_config's quantization stores the draft's projections and LM head as
    integer codes with scales, 1/4 (int8) or 1/8 (int4) of the float32 target's bytes
    (whichever matmul kernel runs them); the target is left float32."""
    eng = quantized_draft(quantization)
    draft, target = eng.runner.draft_params, eng.params
    pairs = [(draft["lm_head"], target.get("lm_head", target["embed"]), "lm_head")] + [
        (d[k], t[k], f"{i}.{k}") for i, (d, t) in enumerate(zip(draft["layers"],
                                                               target["layers"], strict=True))
        for k in ("w_qkv", "wo", "w_gate_up", "w_down")]
    for d, t, name in pairs:
        (codes, scales), (floats, none) = _codes(d), _codes(t)
        assert codes.dtype.itemsize == 1 and codes.dtype.kind in "iu", name
        assert scales is not None and none is None and floats.dtype == np.float32, name
        assert codes.nbytes * 4 * per_byte == floats.nbytes, name


def test_int8_draft_changes_no_token():
    """Greedy output with the int8 draft is plain decoding's, and it keeps drafts."""
    reqs = [(str(i), q, GREEDY) for i, q in enumerate(PROMPTS[:3])]
    eng = quantized_draft("int8")  # the tests' static shapes: few programs to compile
    assert outputs(run(eng, reqs)) == outputs(run(engine(**BUCKETS), reqs))
    c = eng.scheduler.spec
    assert 0 < c.num_accepted_tokens <= c.num_draft_tokens


def test_config_and_draft_errors_name_the_problem():
    c, p, _ = model()
    assert SpeculativeConfig.of({"model": "x", "num_speculative_tokens": 2}).draft_model
    for bad in ({"draft_stop_probability": 0.5}, {"model": "x", "draft_stop_probability": 1}):
        with pytest.raises(ValueError, match="draft_stop_probability"):
            SpeculativeConfig.of(bad)
    with pytest.raises(ValueError, match="draft `model`"):
        SpeculativeConfig.of({"method": "draft_model"})
    with pytest.raises(ValueError, match="pass its"):
        engine(**BUCKETS, speculative=SPEC)
    with pytest.raises(ValueError, match="vocabulary"):
        small = tiny_config(vocab_size=300)
        engine(**BUCKETS, speculative=SPEC, draft=(small, random_params(small)))
    with pytest.raises(ValueError, match="not 'draft_model'"):
        engine(**BUCKETS, draft=(c, p))


def _samples(spec, seeds: range, position: int) -> np.ndarray:
    """The token each seeded request samples at `position` (temperature 1) on the tiny
    model, with a noisy copy of it drafting (its q overlaps p, as a real draft's does)."""
    parts = model()
    draft = None if spec is None else (parts[0], near(parts[1], 0.3))
    eng = engine(parts=parts, **BUCKETS, speculative=spec, draft=draft, check=False)
    return seeded_tokens(eng, "abcdefgh " * 3, seeds, position, position + 3)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SPEC, STOPPING], ids=["k drafts", "stopping early"])
def test_sampled_distribution_matches_plain_decoding_chi_square(spec):
    """End to end: the 2nd output token's frequencies over independent seeds (drafted,
    then kept or redrawn) pass a chi-square homogeneity test at p > 0.001."""
    p = homogeneity_p(_samples(None, range(0, 600), 1), _samples(spec, range(1000, 1600), 1))
    assert p > 1e-3, f"draft-model sampling differs from plain sampling (p = {p:.2g})"


def _rejection_rule_samples(p: np.ndarray, q: np.ndarray, n: int) -> np.ndarray:
    """verify's rule applied to n rows, each [t, d] with d drawn from q and the target's
    distribution p at t: the token each row emits first (d kept, or the redraw)."""
    import jax.numpy as jnp

    from paged_jax.engine import verify
    from paged_jax.engine.step import StepBatch
    from paged_jax.sample import sampler as smp

    v, rng = p.shape[0], np.random.default_rng(0)
    d = rng.choice(v, size=n, p=q)
    tokens = np.stack([np.zeros(n, np.int32), d], 1).reshape(-1).astype(np.int32)
    rows = np.repeat(np.arange(n, dtype=np.int32), 2)
    none = np.full(1, -1, np.int32)
    batch = StepBatch(jnp.asarray(tokens), jnp.zeros(2 * n, jnp.int32), jnp.asarray(rows),
                      jnp.arange(n, dtype=jnp.int32), jnp.arange(0, 2 * n + 1, 2, jnp.int32),
                      jnp.ones(n, bool), none, none, none)
    sp = SamplingParams(temperature=1.0)
    rows_params = smp.sampling_rows([(sp, [], s) for s in range(n)], n, smp.MAX_STOP_IDS)
    state = smp.admit_rows(smp.init_sampling_state(n, v), jnp.arange(n), rows_params, None,
                           None)
    slot, j = verify._token_rows(batch)
    flags = smp.SampleFlags(filters=False, penalties=False, bias=False, logprobs=False)
    view = smp.rows_view(state, slot, False, False)
    logits = jnp.asarray(np.log(np.tile(p, (2 * n, 1))), jnp.float32)
    plain = smp.sample(logits, view, flags=flags).tokens
    qs = jnp.asarray(np.tile(q, (n, 1, 1)), jnp.float32)
    out = verify._rejection(logits, view, batch, j, qs, plain, flags)
    return np.asarray(out)[0::2]


def test_rejection_rule_emits_the_targets_distribution():
    """Leviathan et al.: keep d ~ q with probability min(1, p(d) / q(d)), else draw from
    max(p - q, 0): the first emitted token is distributed as p (chi-square goodness of fit
    over 4,000 rows, p > 0.001), where keeping every draft would give q and redrawing from
    p instead of the residual a mixture (both fail this test by far)."""
    from scipy.stats import chisquare

    p = np.array([0.45, 0.25, 0.15, 0.1, 0.05])
    q = np.array([0.05, 0.6, 0.05, 0.25, 0.05])
    got = _rejection_rule_samples(p, q, 4000)
    counts = np.bincount(got, minlength=p.shape[0])
    assert chisquare(counts, p * counts.sum()).pvalue > 1e-3, counts
    kept = np.mean(got == np.random.default_rng(0).choice(5, size=4000, p=q))
    assert 0.5 < kept < 0.8  # sum of min(p, q) = 0.55, plus residual draws equal to d


def test_llm_and_server_take_a_draft_model():
    import openai

    from tests.serve_helpers import MODEL, serve, tiny_llm

    cfg = {"model": "tiny-draft", "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].text for o in tiny_llm().generate(PROMPTS, sp, use_tqdm=False)]
    c, p, tok = model()
    llm = tiny_llm(speculative_config=cfg, draft_model_parts=(c, near(p, 0.1), tok))
    assert [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == plain
    assert llm.llm_engine.scheduler.spec.num_accepted_tokens > 0
    with serve(speculative_config=cfg, draft_model_parts=(c, p, tok)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60,
                               max_retries=0)
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0.0,
                                        max_tokens=16, extra_body={"ignore_eos": True})
        assert got.choices[0].text == plain[0]
