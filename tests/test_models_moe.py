"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE,
OLMoE), saved by transformers' `save_pretrained` and loaded by our safetensors loader: logits
within 1e-4 of transformers' in fp32 through every expert path, identical greedy tokens."""

from __future__ import annotations

import dataclasses
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax.models import config_from_hf, load_safetensors  # noqa: E402
from paged_jax.models.reference_loop import paged_loop  # noqa: E402
from tests.test_models_tiny import hf_logits  # noqa: E402
from tests.test_models_tiny import make_hf as tiny_hf  # noqa: E402

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
    """test_models_tiny's random model on this file's base config, routers spread wider."""
    return tiny_hf(kind, overrides, folder, base=BASE, router_std=0.5)


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


# The converter's name for a layer's experts stacked into one tensor (convert_hf_to_gguf.py:
# LlamaModel for Mixtral, Qwen2MoeModel), which gguf-py's TensorNameMap maps to ffn_*_exps.
_MERGED = {"llama": "layers.{bid}.feed_forward.experts.{w}.weight",
           "qwen2moe": "model.layers.{bid}.mlp.experts.{w}.weight"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)"
                     r"\.weight")


def _gguf_from_hf(folder, path, arch: str, config) -> None:
    """The HF folder's weights (float32) converted as llama.cpp's convert_hf_to_gguf.py does
    it, names from gguf-py's own map (not our loader's table): each layer's experts stacked
    into one [X, out, in] tensor, q/k rows permuted for a "llama" file, the shared expert's
    gate a vector. A Mixtral ("llama") file sizes its experts by feed_forward_length (there
    is no expert key: llama.cpp reads n_ff), a Qwen2-MoE file by its expert keys."""
    import gguf
    from safetensors.numpy import load_file

    from tests.test_models_gguf import permute

    hf = load_file(folder / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama"
                                     else gguf.MODEL_ARCH.QWEN2MOE, 2)
    w = gguf.GGUFWriter(str(path), arch)
    sizes = (dict(feed_forward_length=config.moe_intermediate_size) if arch == "llama" else
             dict(feed_forward_length=96, expert_feed_forward_length=config.moe_intermediate_size,
                  expert_shared_feed_forward_length=config.shared_expert_intermediate_size))
    for k, v in dict(block_count=2, context_length=256, embedding_length=64,
                     **{"attention.head_count": 4, "attention.head_count_kv": 2},
                     expert_count=8, expert_used_count=2, **sizes,
                     **{"rope.dimension_count": 16}).items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "ab"] + [f"t{i}" for i in range(90)])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, x in hf.items():
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = x
            continue
        if arch == "llama" and (q := re.search(r"self_attn\.([qk])_proj\.", name)):
            x = permute(x, 4 if q[1] == "q" else 2)
        if name.endswith("shared_expert_gate.weight"):
            x = x[0]
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), x)
    for (bid, part), per in sorted(experts.items()):
        merged = _MERGED[arch].format(bid=bid, w=part)
        w.add_tensor(names.get_name(merged, try_suffixes=(".weight",)),
                     np.stack([per[x] for x in range(8)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_shapes(arch: str, f: int, s: int) -> dict[str, tuple[int, ...]]:
    """The MoE tensors llama.cpp creates for one layer, with its shapes (ggml order:
    innermost first, so [in, out, expert]; src/models/llama.cpp and qwen2moe.cpp): E = 64,
    8 experts of `f` rows, a shared expert of `s` rows and its gate [E] (Qwen2-MoE)."""
    out = {"ffn_gate_inp": (64, 8), "ffn_gate_exps": (64, f, 8), "ffn_up_exps": (64, f, 8),
           "ffn_down_exps": (f, 64, 8)}
    if arch == "qwen2moe":
        out |= {"ffn_gate_inp_shexp": (64,), "ffn_gate_shexp": (64, s),
                "ffn_up_shexp": (64, s), "ffn_down_shexp": (s, 64)}
    return out


@pytest.mark.parametrize("variant, arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_moe_gguf_is_laid_out_as_llama_cpp_reads_it(tmp_path, variant, arch):
    """The file the load test below reads, checked by gguf-py's reader against llama.cpp's
    own rules, so that the writer and our loader cannot agree on a wrong layout: every
    tensor is one the architecture has (gguf.MODEL_TENSORS), each MoE tensor has the shape
    llama.cpp creates (sized by the keys llama.cpp reads), and expert x of a merged tensor
    is the HF checkpoint's expert x (experts the outermost numpy axis)."""
    import gguf
    from safetensors.numpy import load_file

    make_hf(*VARIANTS[variant], tmp_path)
    config, _ = load_safetensors(tmp_path)
    _gguf_from_hf(tmp_path, tmp_path / "tiny.gguf", arch, config)
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    meta = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in gguf.MODEL_TENSORS[model_arch]
               for i in range(2) for suffix in (".weight", ".bias")}
    assert set(tensors) <= allowed, set(tensors) - allowed
    f = meta[f"{arch}.feed_forward_length" if arch == "llama" else
             f"{arch}.expert_feed_forward_length"]
    s = meta.get(f"{arch}.expert_shared_feed_forward_length", 0)
    assert (f, s) == (config.moe_intermediate_size, config.shared_expert_intermediate_size)
    hf = load_file(tmp_path / "model.safetensors")
    moe = "block_sparse_moe" if arch == "llama" else "mlp"
    parts = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
             "ffn_down_exps": ("w2", "down_proj")}
    for i in range(2):
        for name, shape in llama_cpp_shapes(arch, f, s).items():
            t = tensors[f"blk.{i}.{name}.weight"]
            assert tuple(int(n) for n in t.shape) == shape, (i, name)
        for name, (mix, qwen) in parts.items():
            data = np.asarray(tensors[f"blk.{i}.{name}.weight"].data)  # numpy order [X, out, in]
            for x in range(8):
                want = hf[f"model.layers.{i}.{moe}.experts.{x}.{mix if arch == 'llama' else qwen}"
                          ".weight"]
                np.testing.assert_array_equal(data[x], want, err_msg=f"{i} {name} {x}")


@pytest.mark.parametrize("variant, arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_moe_gguf_gives_the_safetensors_model(tmp_path, variant, arch):
    """An MoE GGUF (Mixtral as a "llama" file with experts, Qwen2-MoE with its shared expert)
    loads to the same config fields and the same weights as the HF folder it came from."""
    from paged_jax.models import load_gguf

    make_hf(*VARIANTS[variant], tmp_path)
    config, params = load_safetensors(tmp_path)
    _gguf_from_hf(tmp_path, tmp_path / "tiny.gguf", arch, config)
    got_cfg, got, _ = load_gguf(tmp_path / "tiny.gguf")
    for field in ("architecture", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                  "moe_intermediate_size", "shared_expert_intermediate_size",
                  "attention_bias", "tie_word_embeddings"):
        assert getattr(got_cfg, field) == getattr(config, field), field
    assert set(got["layers"]) == set(params["layers"])
    for key, want in params["layers"].items():
        np.testing.assert_array_equal(got["layers"][key], want, err_msg=key)
