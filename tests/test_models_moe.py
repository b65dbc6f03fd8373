"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE,
OLMoE), saved by transformers' `save_pretrained` and loaded by our safetensors loader: logits
within 1e-4 of transformers' in fp32 through every expert path, identical greedy tokens."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax.models import config_from_hf, load_safetensors  # noqa: E402
from paged_jax.models.reference_loop import paged_loop  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
            rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
VARIANTS = {
    "mixtral": ("mixtral", dict(num_local_experts=8, intermediate_size=48)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, intermediate_size=96,
                                    norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=32, head_dim=16,
                                    norm_topk_prob=True, intermediate_size=96)),
    "olmoe": ("olmoe", dict(num_experts=8, intermediate_size=32)),
}
IMPLS = ("grouped", "dense", "ragged_dot")
TOL = dict(rtol=1e-4, atol=1e-4)


def make_hf(kind: str, overrides: dict, folder) -> torch.nn.Module:
    """A random HF model of `kind`, saved as safetensors into `folder`; norms random too (all
    ones would hide a wrong norm), the router scaled up so experts' weights differ clearly."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, **{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            elif "gate.weight" in name and "proj" not in name:  # routers and the shared gate
                p.copy_(torch.randn_like(p) * 0.5)
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
    model, config, params = tiny
    hf = model.config
    assert config.is_moe and config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.norm_topk_prob == (hf.model_type == "mixtral" or bool(hf.norm_topk_prob))
    assert config.attention_bias == (hf.model_type == "qwen2_moe")
    assert bool(config.shared_expert_intermediate_size) == (hf.model_type == "qwen2_moe")
    assert config.qk_norm == (hf.model_type in ("olmoe", "qwen3_moe"))
    assert params["layers"]["e_gate"].shape == (2, 8, 64, config.moe_intermediate_size)


@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_prefill_matches_hf(tiny, impl):
    model, config, params = tiny
    config = dataclasses.replace(config, moe_impl=impl)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (13, 5, 21)]
    runner = paged_loop(config, params, num_seqs=3, max_len=32, block_size=4, shuffle_seed=3)
    ours = runner.step(prompts, all_logits=True)
    want = np.concatenate([hf_logits(model, p) for p in prompts])
    np.testing.assert_allclose(ours, want, **TOL)


def test_greedy_decode_gives_transformers_tokens(tiny):
    """Prefill, then one token per step from our own argmax: the same 16 tokens as
    transformers' greedy `generate`."""
    model, config, params = tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (11, 7)]
    runner = paged_loop(config, params, num_seqs=2, max_len=40, block_size=4, shuffle_seed=7)
    logits, ours = runner.step(prompts), [[], []]
    for _ in range(16):
        nxt = [int(x) for x in np.argmax(logits, -1)]
        for s, t in enumerate(nxt):
            ours[s].append(t)
        logits = runner.step([[t] for t in nxt])
    for s, p in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 min_new_tokens=16)
        assert out[0, len(p):].tolist() == ours[s], s


def test_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_hf(*VARIANTS["mixtral"], tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        load_safetensors(tmp_path)


@pytest.mark.parametrize("extra, match", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
])
def test_configs_we_cannot_run_are_refused(extra, match):
    hf = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=96, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, **extra)
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


def test_olmoe_clip_qkv_is_refused():
    hf = dict(architectures=["OlmoeForCausalLM"], vocab_size=96, hidden_size=64,
              intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_experts=8, num_experts_per_tok=2, clip_qkv=8.0)
    with pytest.raises(ValueError, match="clip_qkv"):
        config_from_hf(hf)
