"""The NNX port of our Llama decoder (paged_jax/nn/llama.py) on SmolLM2-135M's real weights:
the functional decoder's logits within 1e-5 of their scale (float32), and the same 16 greedy
tokens through `LLM(model=<module>)` as through `LLM()`."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from paged_jax import LLM, SamplingParams
from paged_jax.models import load_model
from paged_jax.models.llama import forward, prepare_params
from paged_jax.nn import split_model
from paged_jax.nn.llama import LlamaForCausalLM
from tests.nn_helpers import assert_close, two_steps

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


@functools.cache
def smollm2():
    return load_model(None, jnp.float32)


def test_logits_and_pages_are_the_functional_decoders():
    config, params, tok = smollm2()
    prompt = tok.encode("Paged attention keeps a sequence's keys and values in blocks")
    _, state, fwd = split_model(LlamaForCausalLM.from_params(config, params))
    want = two_steps(config, forward, prepare_params(params), "float32", False, prompt)
    got = two_steps(config, fwd, state, "float32", False, prompt)
    for w, g in zip(want, got, strict=True):
        assert_close(g, w)
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all()


def test_llm_gives_the_same_16_greedy_tokens():
    config, params, tok = smollm2()
    kw = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = LLM(**kw).generate(PROMPTS, sp, use_tqdm=False)
    module = LlamaForCausalLM.from_params(config, params)
    got = LLM(model=module, tokenizer="smollm2", **kw).generate(PROMPTS, sp, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert len(g.outputs[0].token_ids) == 16
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
