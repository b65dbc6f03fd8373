"""SamplingParams / BeamSearchParams: vLLM defaults, normalisation, and field-naming errors."""

import pytest

from paged_jax.sampling_params import BeamSearchParams, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert p.skip_special_tokens and p.detokenize and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    assert greedy.sampling_type == SamplingType.GREEDY
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.min_p) == (0.0, 0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-7).sampling_type == SamplingType.GREEDY
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_output_text_buffer_length():
    assert SamplingParams(stop=["ab", "xyz"]).output_text_buffer_length == 2
    kept = SamplingParams(stop="xyz", include_stop_str_in_output=True)
    assert kept.output_text_buffer_length == 0


def test_clone_does_not_share_lists():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.1), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(frequency_penalty=2.1), "frequency_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(seed="7"), "seed"),
        (dict(seed=True), "seed"),
        (dict(temperature=0.0, n=2), "n"),
        (dict(stop=["x"], detokenize=False), "stop"),
        (dict(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
        # wrong types that would otherwise pass as another (a dict as its keys, "no" as True)
        (dict(stop={"a": 1}), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids={1: 2}), "stop_token_ids"),
        (dict(allowed_token_ids="12"), "allowed_token_ids"),
        (dict(bad_words="abc"), "bad_words"),
        (dict(ignore_eos="no"), "ignore_eos"),
        (dict(skip_special_tokens=1), "skip_special_tokens"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
        (dict(detokenize=0), "detokenize"),
        (dict(return_hidden_states="yes"), "return_hidden_states"),
    ],
)
def test_invalid_field_is_named(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_beam_search_params():
    p = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (p.ignore_eos, p.temperature, p.length_penalty) == (False, 0.0, 1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(beam_width=0, max_tokens=8), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=8, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=8, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=8, temperature=0.5), "temperature"),
        (dict(beam_width=2, max_tokens=8, include_stop_str_in_output=True),
         "include_stop_str_in_output"),
        (dict(beam_width=2, max_tokens=8, ignore_eos="yes"), "ignore_eos"),
        (dict(beam_width=2, max_tokens=8, logit_bias=[1]), "logit_bias"),
        (dict(beam_width=2, max_tokens=8, logit_bias={1: float("inf")}), "logit_bias"),
        (dict(beam_width=2, max_tokens=8, allowed_token_ids=[]), "allowed_token_ids"),
        (dict(beam_width=2, max_tokens=8, allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(beam_width=2, max_tokens=8, bad_words="abc"), "bad_words"),
        (dict(beam_width=2, max_tokens=8, bad_words=[""]), "bad_words"),
    ],
)
def test_beam_search_invalid_field_is_named(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**kwargs)
