"""vLLM's LLM arguments beyond the engine's: tokenizer, swap_space, gpu_memory_utilization,
chat(chat_template=...), decode_window beside async scheduling, on the tiny random model;
engines on one loaded model share its weights."""

import jax
import pytest

from paged_jax.engine.config import scheduling
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import model

SMALL = dict(num_kv_blocks=32, block_size=8, max_model_len=64, max_num_seqs=4,
             static_shapes=True)


def test_chat_template_argument_replaces_the_models():
    llm = LLM(model_parts=model(), **SMALL)
    template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   chat_template=template)[0]
    assert out.prompt == "[user: hi]"


def test_tokenizer_from_a_local_folder(tmp_path):
    tok = model()[2]
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(model_parts=model(), tokenizer=str(tmp_path), **SMALL)
    own = llm.get_tokenizer()
    assert own is not tok and own.encode("paged jax") == tok.encode("paged jax")
    with pytest.raises(ValueError, match="local Hugging Face folder"):
        LLM(model_parts=model(), tokenizer="org/not-a-folder", **SMALL)


def test_swap_space_and_memory_utilization():
    llm = LLM(model_parts=model(), swap_space=0.5, **SMALL)
    assert llm.llm_engine.kv.swap_space == 1 << 29
    with pytest.raises(ValueError, match="kv_cache_memory"):  # a CPU reports no memory size
        LLM(model_parts=model(), gpu_memory_utilization=0.5, **SMALL)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model_parts=model(), gpu_memory_utilization=1.5, **SMALL)


@pytest.mark.parametrize("msgs, match", [
    ([{"content": "hi"}], "messages\\[0\\] has no 'role'"),
    ([{"role": "user"}], "messages\\[0\\] has no 'content'"),
    ([{"role": "user", "content": "hi"}, "oops"], "messages\\[1\\] must be a dict"),
])
def test_a_malformed_chat_names_the_message(msgs, match):
    llm = LLM(model_parts=model(), **SMALL)
    template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    with pytest.raises(ValueError, match=match):
        llm.chat(msgs, use_tqdm=False, chat_template=template)


@pytest.mark.parametrize("field", ["block_size", "max_num_seqs", "max_num_batched_tokens",
                                   "decode_window"])
def test_a_zero_size_names_the_field(field):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got 0"):
        LLM(model_parts=model(), **{**SMALL, field: 0})


def test_engines_on_the_same_loaded_model_share_one_copy_of_its_weights():
    """Two LLMs built from the same parts (an experiment's sides) hold one laid-out copy;
    other parts, or another layout, get their own; each still decodes as before."""
    from paged_jax.models.testing import random_params, tiny_config

    parts = model()
    a, b = LLM(model_parts=parts, **SMALL), LLM(model_parts=parts, **SMALL)
    leaf = lambda llm: jax.tree.leaves(llm.llm_engine.params)[0]  # noqa: E731
    assert leaf(a) is leaf(b)
    c = tiny_config()
    other = LLM(model_parts=(c, random_params(c), parts[2]), **SMALL)
    assert leaf(other) is not leaf(a)
    assert leaf(LLM(model_parts=parts, matmul_backend="xla", **SMALL)) is not leaf(a)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert a.generate(["abc"], sp, use_tqdm=False)[0].outputs[0].token_ids == b.generate(
        ["abc"], sp, use_tqdm=False)[0].outputs[0].token_ids


NGRAM = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("window, async_, spec, want", [
    (None, None, None, (1, True)),  # the default: async, every step delivered (recorded 1)
    (1, None, None, (1, True)),
    (1, True, None, (1, True)),
    (4, None, None, (4, False)),  # an explicit window is honoured: sync decode windows
    (4, False, None, (4, False)),
    (None, False, None, (8, False)),  # sync without a window given: the default 8
    (None, None, NGRAM, (8, False)),  # drafts need sync
    (3, None, NGRAM, (3, False)),
])
def test_scheduling_records_what_applies(window, async_, spec, want):
    assert scheduling(window, async_, spec) == want


@pytest.mark.parametrize("kw, match", [
    (dict(decode_window=4, async_scheduling=True), "decode_window=4 .*async_scheduling=True"),
    (dict(async_scheduling=True, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2}),
     "speculative_config needs async_scheduling=False"),
    (dict(async_scheduling="yes"), "async_scheduling must be a bool"),
    (dict(decode_window=2.5), "decode_window must be a positive integer"),
    (dict(decode_window=True), "decode_window must be a positive integer"),
])
def test_settings_that_cannot_apply_together_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_parts=model(), **SMALL, **kw)


def test_engine_config_records_the_scheduling_that_runs():
    """What experiments read from llm.engine_config (results files record it): decode_window
    1 under async scheduling, where every step is delivered; the window given otherwise."""
    cfg = LLM(model_parts=model(), **SMALL).engine_config
    assert (cfg.async_scheduling, cfg.decode_window) == (True, 1)
    llm = LLM(model_parts=model(), decode_window=4, **SMALL)
    assert (llm.engine_config.async_scheduling, llm.engine_config.decode_window) == (False, 4)
    assert llm.llm_engine.config.decode_window == 4 and not llm.llm_engine.config.async_scheduling
