"""prompt_logprobs: every prompt token's logprob, rank and top alternatives, as a dense forward
over the whole prompt gives them; chunked prefill, prefix caching and n > 1 change nothing."""

import numpy as np
import pytest

from paged_jax.cache.config import CacheConfig
from paged_jax.models.reference_loop import PagedLoop
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import all_free, engine, model, run

PROMPT = "the prompt whose every token is scored, " * 2


def reference(ids: list[int]) -> np.ndarray:
    """Log-softmax of the logits after every prompt token [T, V] (one dense prefill)."""
    config, params, _ = model()
    logits = PagedLoop(config, params, CacheConfig(64, 8, 1, 32)).step([ids], all_logits=True)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def check(out, ids: list[int], k: int) -> None:
    lp = reference(ids)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, entry, tok = lp[p - 1], got[p], ids[p]
        assert tok in entry, p
        np.testing.assert_allclose(entry[tok].logprob, row[tok], atol=2e-4)
        assert entry[tok].rank == 1 + int((row > row[tok] + 1e-5).sum()), p
        top = [t for t, e in entry.items() if e.rank is not None and e.rank <= k]
        assert sorted(top) == sorted(np.argsort(-row)[:k].tolist()), p
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("chunk", [64, 16])
def test_prompt_logprobs_match_a_dense_forward(chunk):
    eng = engine(max_num_batched_tokens=chunk)
    ids = eng.tokenizer.encode(PROMPT)
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    outs = run(eng, [("a", PROMPT, sp), ("plain", "no prompt logprobs", SamplingParams(
        temperature=0.0, max_tokens=4))])
    check(outs["a"], ids, 3)
    assert outs["plain"].prompt_logprobs is None
    assert all_free(eng)


def test_prefix_hits_and_n_do_not_skip_prompt_tokens():
    eng = engine(enable_prefix_caching=True)
    ids = eng.tokenizer.encode(PROMPT)
    first = run(eng, [("warm", PROMPT, SamplingParams(temperature=0.0, max_tokens=2))])
    assert first["warm"].prompt_logprobs is None
    sp = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4, prompt_logprobs=0)
    outs = run(eng, [("b", PROMPT, sp)])
    assert outs["b"].num_cached_tokens == 0  # the cached prefix is not used: scored in full
    check(outs["b"], ids, 0)


def test_prompt_logprobs_over_max_logprobs_is_refused():
    eng = engine()
    with pytest.raises(ValueError, match="prompt_logprobs=5 exceeds"):
        eng.add_request("x", "hi", SamplingParams(prompt_logprobs=5))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
