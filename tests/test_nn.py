"""paged_jax.nn: a Flax NNX model on the paged cache. The NNX port of our Llama decoder
against the functional decoder (logits and K/V of a prefill and a decode step on every cache
layout, within 1e-5 of the logits' scale; greedy tokens through LLM), no program built for a
second module of the same structure, and the refusals by name. SmolLM2's real weights:
test_nn_smollm2.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import LLM, SamplingParams
from paged_jax.cache.kv_cache import init_kv_cache
from paged_jax.engine.programs import PROGRAMS
from paged_jax.models.llama import forward, prepare_params
from paged_jax.models.testing import (
    byte_tokenizer,
    random_params,
    tiny_config,
    tiny_gemma3_config,
    tiny_qwen2_config,
)
from paged_jax.nn import PagedAttention, RaggedStep, split_model
from paged_jax.nn.llama import LlamaForCausalLM
from tests.nn_helpers import BLOCK, assert_close, two_steps

WINDOWED = dict(sliding_window=8, layer_types=("sliding_attention", "full_attention"))
CONFIGS = {"llama": tiny_config(), "qwen2": tiny_qwen2_config(),
           "untied_bias": tiny_config(attention_bias=True),
           "windows": tiny_config(**WINDOWED)}


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_port_gives_the_functional_decoders_logits_and_pages(name, kv_dtype):
    """Every cache layout (one group and sliding-window groups, float and int8 pages with
    their rotation) is written and read the same way: logits and K within 1e-5 of their
    scale (float32)."""
    config = CONFIGS[name]
    params = random_params(config)
    _, state, fwd = split_model(LlamaForCausalLM.from_params(config, params))
    for hybrid in (False, True) if config.sliding_window else (False,):
        want = two_steps(config, forward, prepare_params(params), kv_dtype, hybrid)
        got = two_steps(config, fwd, state, kv_dtype, hybrid)
        for w, g in zip(want, got, strict=True):
            assert_close(g, w)


def test_a_different_positional_encoding_changes_the_logits():
    """The check above can fail: the same weights with another RoPE base differ."""
    config = tiny_config()
    params = random_params(config)
    other = tiny_config(rope_theta=500.0)
    _, state, fwd = split_model(LlamaForCausalLM.from_params(other, params))
    want = two_steps(config, forward, prepare_params(params), "float32", False)
    got = two_steps(config, fwd, state, "float32", False)
    assert np.abs(got[1] - want[1]).max() > 1e-2


def engine_kw(**kw) -> dict:
    return dict(num_kv_blocks=96, block_size=BLOCK, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=32, **kw)


PROMPTS = ["hello there, ", "a longer prompt, past one window of eight tokens"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("name, kw", [
    ("llama", {}),
    ("windows", dict(kv_cache_dtype="int8")),  # KV cache groups and int8 pages
    ("llama", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})),
])
def test_llm_serves_the_module_with_the_functional_decoders_tokens(name, kw):
    config = CONFIGS[name]
    params, tok = random_params(config), byte_tokenizer()
    want = LLM(model_parts=(config, params, tok), **engine_kw(**kw)).generate(
        PROMPTS, GREEDY, use_tqdm=False)
    module = LlamaForCausalLM.from_params(config, params)
    got = LLM(model=module, tokenizer=tok, **engine_kw(**kw)).generate(PROMPTS, GREEDY,
                                                                      use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_hidden_states_are_the_functional_decoders():
    config, tok = CONFIGS["llama"], byte_tokenizer()
    params = random_params(config)
    ask = SamplingParams(temperature=0.0, max_tokens=2, return_hidden_states=True)
    want = LLM(model_parts=(config, params, tok), **engine_kw()).generate(PROMPTS, ask,
                                                                          use_tqdm=False)
    module = LlamaForCausalLM.from_params(config, params)
    got = LLM(model=module, tokenizer=tok, **engine_kw()).generate(PROMPTS, ask,
                                                                   use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert_close(g.hidden_states, w.hidden_states)


def test_a_second_module_of_the_same_structure_builds_no_program():
    """Params are an argument of the step programs, not constants in them: another module
    of the same structure (other weights) runs on the programs the first one built."""
    config, tok = CONFIGS["llama"], byte_tokenizer()
    first = LLM(model=LlamaForCausalLM.from_params(config, random_params(config)),
                tokenizer=tok, **engine_kw())
    a = first.generate(PROMPTS, GREEDY, use_tqdm=False)
    built = PROGRAMS.built
    second = LLM(model=LlamaForCausalLM.from_params(config, random_params(config, seed=1)),
                 tokenizer=tok, **engine_kw())
    b = second.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert PROGRAMS.built == built
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(quantization="int8"), "quantization"),
    (dict(matmul_backend="cpu"), "matmul_backend='cpu'"),
    (dict(enable_lora=True), "enable_lora"),
])
def test_settings_a_module_cannot_run_with_are_named(kw, match):
    config = CONFIGS["llama"]
    module = LlamaForCausalLM.from_params(config, random_params(config))
    with pytest.raises(ValueError, match=match):
        LLM(model=module, tokenizer=byte_tokenizer(), **engine_kw(**kw))


def test_a_draft_model_beside_a_module_is_refused():
    config, tok = CONFIGS["llama"], byte_tokenizer()
    params = random_params(config)
    with pytest.raises(ValueError, match="draft model"):
        LLM(model=LlamaForCausalLM.from_params(config, params), tokenizer=tok,
            speculative_config={"model": "draft", "num_speculative_tokens": 2},
            draft_model_parts=(config, params, tok), **engine_kw())


class NoConfig(nnx.Module):
    def __call__(self, cache, step):
        return cache


class ListAttribute(nnx.Module):
    def __init__(self):
        self.config, self.sizes = CONFIGS["llama"], [1, 2]

    def __call__(self, cache, step):
        return cache


def test_what_a_module_misses_is_named():
    config = CONFIGS["llama"]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LLM(model=LlamaForCausalLM.from_params(config, random_params(config)), **engine_kw())
    with pytest.raises(ValueError, match="no `config`"):
        split_model(NoConfig())
    with pytest.raises(ValueError, match="cannot be hashed"):
        split_model(ListAttribute())
    with pytest.raises(ValueError, match=r"does not implement \['embed_scale', 'hidden_act'"):
        LlamaForCausalLM(tiny_gemma3_config(), rngs=nnx.Rngs(0))


def test_a_module_tokenizer_attribute_is_used():
    config = CONFIGS["llama"]
    module = LlamaForCausalLM.from_params(config, random_params(config))
    module.tokenizer = byte_tokenizer()
    llm = LLM(model=module, **engine_kw())
    assert llm.get_tokenizer() is module.tokenizer


def test_paged_attention_reads_the_pages_it_wrote():
    """One layer by hand: a token's K/V written at cache position 8 (block 1) and its query
    attending to it alone gives back its V for every query head."""
    cache = init_kv_cache(1, 1, 4, BLOCK, 4)
    step = RaggedStep(jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
                      jnp.asarray([[BLOCK]], jnp.int32), jnp.asarray([[[1]]], jnp.int32),
                      jnp.asarray([1], jnp.int32), jnp.asarray([0, 1], jnp.int32))
    q = jnp.ones((1, 2, 4))
    k, v = jnp.ones((1, 1, 4)), jnp.arange(4.0).reshape(1, 1, 4)
    o, cache = PagedAttention(0)(q, k, v, cache, step)
    np.testing.assert_allclose(o, jnp.broadcast_to(v, (1, 2, 4)))
    np.testing.assert_allclose(cache.k[0][0, 1, 0], k[0, 0])


def test_a_module_engine_sleeps_wakes_and_snapshots(tmp_path):
    """Sleep (both levels: level 2 takes the module's state back) and a snapshot mid-run
    work on a user's module as on our decoder: same tokens, nothing compiled on waking."""
    config = CONFIGS["llama"]
    module = LlamaForCausalLM.from_params(config, random_params(config, seed=2))
    llm = LLM(model=module, tokenizer=byte_tokenizer(), **engine_kw())
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    built = PROGRAMS.built
    llm.sleep(1), llm.wake_up()
    llm.sleep(2), llm.wake_up(params=nnx.state(module))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY,
                                                         use_tqdm=False)] == ref
    assert PROGRAMS.built == built
    for i, p in enumerate(PROMPTS):
        llm.llm_engine.add_request(f"s{i}", p, GREEDY)
    llm.llm_engine.step()
    llm.save_state(str(tmp_path / "s"))
    fresh = LLM(model=module, tokenizer=byte_tokenizer(), **engine_kw())
    fresh.restore_state(str(tmp_path / "s"))
    assert [o.outputs[0].token_ids for o in fresh.resume(use_tqdm=False)] == ref
