"""dtype="auto" on CPU (paged_jax/precision.py): bfloat16 only where this CPU's kernel has
bfloat16 dot products and the checkpoint's passage perplexity holds within 0.5%, checked once
per checkpoint and machine; an explicit dtype always wins."""

from __future__ import annotations

import pytest

from paged_jax import LLM, precision
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The checks' cache file in tmp_path (not the cache folder: the kernels load from it)."""
    monkeypatch.setattr(precision, "cache_file", lambda: tmp_path / "precision.json")
    return tmp_path


def fake_perplexities(monkeypatch, f32: float, bf16: float) -> list:
    calls = []

    def ppl(config, params, tokenizer, weights):
        calls.append(weights)
        return {"float32": f32, "bfloat16": bf16}[weights]

    monkeypatch.setattr(precision, "passage_perplexity", ppl)
    monkeypatch.setattr(precision, "bf16_dot_here", lambda: True)
    return calls


@pytest.mark.parametrize("bf16, want", [(10.04, "bfloat16"), (10.06, "float32")])
def test_the_quality_gate_decides_and_is_checked_once(cache, monkeypatch, bf16, want):
    calls = fake_perplexities(monkeypatch, 10.0, bf16)
    c = tiny_config()
    first = precision.choose(c, None, None, "ckpt-a")
    assert first["dtype"] == want and ("within" if want == "bfloat16" else "past") in (
        first["reason"])
    assert precision.choose(c, None, None, "ckpt-a") == first and len(calls) == 2  # cached
    precision.choose(c, None, None, "ckpt-b")  # another checkpoint: checked again
    assert len(calls) == 4 and (cache / "precision.json").exists()


def test_no_bfloat16_dot_products_keeps_float32(cache, monkeypatch):
    monkeypatch.setattr(precision, "bf16_dot_here", lambda: False)
    got = precision.choose(tiny_config(), None, None, "ckpt")
    assert got["dtype"] == "float32" and "no bfloat16 dot" in got["reason"]


def test_the_passage_perplexity_is_measured_on_both_paths(cache):
    """The tiny model's real passage perplexity on both packed paths (random weights: a large
    one): finite, and the same to within bfloat16's rounding of weights and activations."""
    c = tiny_config()
    params, tok = random_params(c), byte_tokenizer()
    f32 = precision.passage_perplexity(c, params, tok, "float32")
    bf16 = precision.passage_perplexity(c, params, tok, "bfloat16")
    assert 1 < f32 < float("inf") and abs(bf16 / f32 - 1) < 0.05, (f32, bf16)


def test_an_explicit_dtype_and_given_weights_are_not_second_guessed(monkeypatch):
    monkeypatch.setattr(precision, "choose", lambda *a: pytest.fail("checked"))
    c = tiny_config()
    parts = (c, random_params(c), byte_tokenizer())
    assert LLM(model_parts=parts, max_num_seqs=2).dtype_choice["dtype"] == "float32"
    llm = LLM(model_parts=parts, dtype="float32", max_num_seqs=2)
    assert llm.dtype_choice == dict(dtype="float32", reason="asked for")
