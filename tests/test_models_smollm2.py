"""SmolLM2-135M-Instruct (Q4_1 GGUF): our decoder vs transformers loading the same file, fp32.

transformers dequantizes the GGUF itself (its own reader and kernels), so this also checks our
dequantization and the undoing of llama.cpp's q/k permutation.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from paged_jax.models import default_model_path, load_model, loader  # noqa: E402
from paged_jax.models.reference_loop import greedy, paged_loop  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "What is 17 times 3?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
]
MAX_TOKENS = 32
LOGIT_ATOL = 2e-3  # logits reach ~40; observed max |diff| ~1e-4


def _must_not_parse(*args, **kwargs):
    raise AssertionError("second load re-read the GGUF instead of the params cache")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Our model loaded twice through a fresh params cache: (cold, cached, times)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGED_JAX_CACHE", str(tmp_path_factory.mktemp("param_cache")))
    times = []
    results = []
    for attempt in range(2):
        if attempt == 1:  # the second load must come from the cache: parsing the GGUF fails it
            mp.setattr(loader, "_load_uncached", _must_not_parse)
        t0 = time.perf_counter()
        results.append(jax.block_until_ready(load_model()))
        times.append(time.perf_counter() - t0)
    mp.undo()
    print(f"\nSmolLM2 load: cold {times[0]:.1f}s, cached {times[1]:.1f}s")
    return results[0], results[1], times


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    torch.set_num_threads(os.cpu_count() or 1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_cached_load_is_identical_and_skips_parsing(loaded):
    (cfg0, p0, tok0), (cfg1, p1, tok1), _ = loaded
    assert cfg0 == cfg1
    assert jax.tree.structure(p0) == jax.tree.structure(p1)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert tok1.encode("Hello 123 world") == tok0.encode("Hello 123 world")


def test_greedy_matches_transformers(loaded, hf_model):
    config, params, tok = loaded[0]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    max_len = max(map(len, prompts)) + MAX_TOKENS
    runner = paged_loop(config, params, len(prompts), max_len, shuffle_seed=0)
    gen, step_logits = greedy(runner, prompts, MAX_TOKENS)
    ours = np.stack(step_logits, axis=1)  # [S, MAX_TOKENS, V]

    # One teacher-forced HF forward over prompt + generated tokens (right padded) gives the
    # logits HF's own greedy loop would see: same argmax everywhere <=> same generation.
    seqs = [p + g[:-1] for p, g in zip(prompts, gen, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        hf = hf_model(input_ids=ids, attention_mask=mask).logits.numpy()
    want = np.stack([hf[i, len(p) - 1 : len(p) - 1 + MAX_TOKENS] for i, p in enumerate(prompts)])
    diff = np.abs(ours - want).max()
    print(f"\nSmolLM2 max |logit diff| vs transformers: {diff:.2e}")
    assert diff < LOGIT_ATOL
    np.testing.assert_array_equal(want.argmax(-1), np.array(gen))
    assert all(tok.decode(g).strip() for g in gen)


def test_tokenizer_and_chat_template(loaded):
    tok = loaded[0][2]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi 2026!"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi 2026!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single tokens
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(tok.encode("2026")) == 4  # SmolLM splits digits one by one
    # <|im_end|>, then <|endoftext|>: a control token that ends generation (llama.cpp's rule)
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1


def test_bad_words_ban_single_token_words(loaded):
    from paged_jax.engine.input import bad_word_ids
    from paged_jax.sampling_params import SamplingParams

    tok = loaded[1][2]
    ids = bad_word_ids(SamplingParams(bad_words=["the"]), tok)
    assert set(ids) == {tok.encode("the")[0], tok.encode(" the")[0]} and len(ids) == 2
    with pytest.raises(ValueError, match="single token"):
        bad_word_ids(SamplingParams(bad_words=["antidisestablishmentarianism"]), tok)
