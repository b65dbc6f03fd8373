"""Tiny random Llama-family models: our paged decoder vs Hugging Face transformers, fp32."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax.models import load_safetensors  # noqa: E402
from paged_jax.models.reference_loop import paged_loop  # noqa: E402

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    initializer_range=0.1, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=16)
GEMMA3_ROPE = {"full_attention": dict(rope_type="default", rope_theta=1e6),
               "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
VARIANTS = {
    "plain": ("llama", {}),
    "gqa": ("llama", dict(num_key_value_heads=2)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2)),
    "untied": ("mistral", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "llama3_rope": ("llama", dict(num_key_value_heads=2, rope_parameters=LLAMA3)),
    # Gemma 3: a 6-token window (the prompts reach 21), its own query scale and RoPE bases.
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE)),
}
TOL = dict(rtol=1e-4, atol=1e-4)


def make_hf(kind: str, overrides: dict, folder, base: dict = BASE,
            router_std: float | None = None) -> torch.nn.Module:
    """A random HF model of `kind` (config `base` updated by `overrides`), saved as
    safetensors into `folder`; `router_std`: MoE routers (and a shared expert's gate) drawn
    with this spread, so the experts' weights of a token differ clearly."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, **{**base, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random biases/norms: zeros and ones would hide layout bugs
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            elif router_std and "gate.weight" in name and "proj" not in name:
                p.copy_(torch.randn_like(p) * router_std)
    model.save_pretrained(folder)
    return model


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = make_hf(kind, overrides, folder)
    config, params = load_safetensors(folder)
    return model, config, params


def test_config_from_checkpoint(tiny):
    model, config, _ = tiny
    hf = model.config
    assert config.num_kv_heads == hf.num_key_value_heads
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.attention_bias == (hf.model_type == "qwen2")


def test_ragged_prefill_matches_hf(tiny):
    model, config, params = tiny
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (13, 5, 21)]
    runner = paged_loop(config, params, num_seqs=3, max_len=32, block_size=4, shuffle_seed=3)
    ours = runner.step(prompts, all_logits=True)
    want = np.concatenate([hf_logits(model, p) for p in prompts])
    np.testing.assert_allclose(ours, want, **TOL)


def test_token_by_token_decode_matches_hf(tiny):
    model, config, params = tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, 19).tolist() for _ in range(2)]
    runner = paged_loop(config, params, num_seqs=2, max_len=24, block_size=4, shuffle_seed=7)
    ours = np.stack([runner.step([[p[i]] for p in prompts]) for i in range(19)], axis=1)
    want = np.stack([hf_logits(model, p) for p in prompts])
    np.testing.assert_allclose(ours, want, **TOL)
    blocks = np.asarray(runner.table.block_tables[0])[:, :5]
    assert not np.array_equal(blocks.ravel(), np.arange(1, 11)), "blocks were not shuffled"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_kernels")
    model = make_hf(*VARIANTS["gemma3"], folder)
    return (model, *load_safetensors(folder))


@pytest.mark.parametrize("backend", ["cpu", "pallas"])
def test_sliding_window_kernels_match_hf(gemma3, backend):
    """The window through the C++ and Pallas kernels: prefill chunks, then decode steps past
    the window (the reference backend is covered above)."""
    model, config, params = gemma3
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, config.vocab_size, 17).tolist() for _ in range(2)]
    runner = paged_loop(config, params, num_seqs=2, max_len=24, block_size=4, backend=backend,
                        shuffle_seed=5)
    first = runner.step([p[:9] for p in prompts], all_logits=True)
    steps = [runner.step([[p[i]] for p in prompts]) for i in range(9, 17)]
    want = [hf_logits(model, p) for p in prompts]
    np.testing.assert_allclose(first, np.concatenate([w[:9] for w in want]), **TOL)
    np.testing.assert_allclose(np.stack(steps, 1), np.stack([w[9:] for w in want]), **TOL)


def test_gemma3_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_hf(*VARIANTS["gemma3"], tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_safetensors(tmp_path)


def test_gemma_configs_we_cannot_run_are_refused():
    from paged_jax.models import config_from_hf

    base = dict(architectures=["Gemma3ForCausalLM"], vocab_size=96, hidden_size=64,
                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, sliding_window=8)
    assert config_from_hf(base).layer_types == ("sliding_attention",) * 2  # pattern 6
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        config_from_hf({**base, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="unsupported architecture"):
        config_from_hf({**base, "architectures": ["Gemma2ForCausalLM"]})
