"""SamplingParams.return_hidden_states: the prompt's last-token hidden state (after the final
norm) comes back in RequestOutput.hidden_states, the vector the first output token's logits
are read from. Checked against a dense prefill's logits, across chunked prefill, prefix-cache
hits, n > 1, preemption and tensor parallelism; requests that do not ask get None."""

import dataclasses

import numpy as np
import pytest

from paged_jax.cache.config import CacheConfig
from paged_jax.models.reference_loop import PagedLoop
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import all_free, engine, model, run

PROMPT = "the request whose last hidden state the router reads, " * 2
ASK = SamplingParams(temperature=0.0, max_tokens=3, return_hidden_states=True)


def dense_last_logits(ids: list[int]) -> np.ndarray:
    """The logits after the prompt's last token, from one dense prefill [V]."""
    config, params, _ = model()
    return PagedLoop(config, params, CacheConfig(64, 8, 1, 32)).step([ids])[0]


def check(out, ids: list[int]) -> None:
    """The hidden state is [E] and the LM head maps it to the dense prefill's last logits."""
    config, params, _ = model()
    h = out.hidden_states
    assert h is not None and h.shape == (config.hidden_size,) and h.dtype == np.float32
    np.testing.assert_allclose(h @ np.asarray(params["lm_head"], np.float32).T,
                               dense_last_logits(ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [64, 16])
def test_hidden_state_gives_the_dense_prefill_logits(chunk):
    eng = engine(max_num_batched_tokens=chunk)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    outs = run(eng, [("a", PROMPT, ASK), ("plain", "no hidden state here", plain),
                     ("b", "a shorter prompt", ASK)])
    check(outs["a"], eng.tokenizer.encode(PROMPT))
    check(outs["b"], eng.tokenizer.encode("a shorter prompt"))
    assert outs["plain"].hidden_states is None
    assert all_free(eng)


def test_hidden_state_with_a_prefix_hit_and_n_2():
    eng = engine(enable_prefix_caching=True)
    ids = eng.tokenizer.encode(PROMPT)
    first = run(eng, [("warm", PROMPT, ASK)])["warm"]
    again = run(eng, [("hit", PROMPT, dataclasses.replace(ASK, n=2, temperature=1.0, seed=0))])
    assert again["hit"].num_cached_tokens > 0  # only the tail was computed
    check(again["hit"], ids)
    np.testing.assert_allclose(again["hit"].hidden_states, first.hidden_states, atol=1e-5)


def test_hidden_state_survives_preemption():
    """A pool too small for all requests at once: some are preempted and recomputed; each
    keeps the hidden state of its first prefill."""
    eng = engine(num_kv_blocks=12, max_num_seqs=4)
    sp = dataclasses.replace(ASK, max_tokens=16, ignore_eos=True)
    reqs = [(f"r{i}", f"{i} " + PROMPT[: 20 + 5 * i], sp) for i in range(4)]
    outs = run(eng, reqs)
    assert eng.scheduler.num_preempted > 0
    for rid, p, _ in reqs:
        check(outs[rid], eng.tokenizer.encode(p))


def test_hidden_state_under_tensor_parallelism():
    one = run(engine(), [("a", PROMPT, ASK)])["a"]
    two = run(engine(tensor_parallel_size=2), [("a", PROMPT, ASK)])["a"]
    np.testing.assert_allclose(two.hidden_states, one.hidden_states, atol=1e-4)
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
