"""Loader errors, config parsing and the params-cache fingerprint (fast, no torch)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from paged_jax.models import ModelConfig, config_from_hf, default_model_path, load_model
from paged_jax.models.llama import inv_frequencies
from paged_jax.models.param_cache import fingerprint
from paged_jax.models.safetensors_loader import load_safetensors

HF_CONFIG = dict(
    architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=4, intermediate_size=6,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, eos_token_id=[2, 3],
    tie_word_embeddings=True,
)


def tiny_tensors(e: int = 4) -> dict[str, np.ndarray]:
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    pre = "model.layers.0."
    return {
        "model.embed_tokens.weight": z(8, e), "model.norm.weight": z(e),
        pre + "self_attn.q_proj.weight": z(4, e), pre + "self_attn.k_proj.weight": z(2, e),
        pre + "self_attn.v_proj.weight": z(2, e), pre + "self_attn.o_proj.weight": z(e, 4),
        pre + "mlp.gate_proj.weight": z(6, e), pre + "mlp.up_proj.weight": z(6, e),
        pre + "mlp.down_proj.weight": z(e, 6), pre + "input_layernorm.weight": z(e),
        pre + "post_attention_layernorm.weight": z(e),
    }


def write_folder(folder, config=HF_CONFIG, tensors=None):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tiny_tensors() if tensors is None else tensors, str(folder / "model.safetensors"))
    return folder


def test_tiny_folder_loads(tmp_path):
    config, params = load_safetensors(write_folder(tmp_path / "m"))
    assert config.eos_token_ids == (2, 3) and config.head_dim == 2
    assert params["layers"]["wq"].shape == (1, 4, 4)
    assert params["layers"]["wk"].shape == (1, 4, 2)
    assert "lm_head" not in params
    _, p16 = load_safetensors(tmp_path / "m", dtype=jnp.bfloat16)
    assert p16["embed"].dtype == jnp.bfloat16


def test_pickle_checkpoints_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="pickle"):
        load_model(folder, use_cache=False)
    with pytest.raises(ValueError, match="pickle"):
        load_model(folder / "pytorch_model.bin", use_cache=False)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found") as err:
        load_model(tmp_path / "nope.gguf")
    assert "hub id" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="hub id.*never downloads.*local folder"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    folder = write_folder(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_safetensors(folder)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_safetensors(write_folder(tmp_path / "m", {**HF_CONFIG, "architectures": ["GPT2"]}))


def test_shape_mismatch_and_missing_tensor(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        load_safetensors(write_folder(tmp_path / "a", tensors=tiny_tensors(e=5)))
    tensors = tiny_tensors()
    del tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="w_up"):
        load_safetensors(write_folder(tmp_path / "b", tensors=tensors))


def test_unsupported_dtype(tmp_path):
    tensors = {**tiny_tensors(), "model.norm.weight": np.zeros(4, np.int8)}
    with pytest.raises(ValueError, match="dtype"):
        load_safetensors(write_folder(tmp_path / "m", tensors=tensors))


def test_config_rope_and_json_roundtrip():
    rope = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = config_from_hf({**HF_CONFIG, "rope_parameters": rope})
    assert config.rope_theta == 5e5 and dict(config.rope_scaling)["factor"] == 8.0
    assert ModelConfig.from_json(config.to_json()) == config
    hash(config)
    gguf_style = config_from_hf(HF_CONFIG)
    gguf_style = ModelConfig(**{**gguf_style.__dict__, "rope_scaling": (
        ("factors", (1.0, 2.0)), ("rope_type", "freq_factors"))})
    base = inv_frequencies(config_from_hf(HF_CONFIG))
    np.testing.assert_allclose(inv_frequencies(gguf_style), base / [1.0, 2.0])
    assert ModelConfig.from_json(gguf_style.to_json()) == gguf_style


def test_fingerprint_tracks_content_not_path(tmp_path):
    a, b = tmp_path / "a" / "w.gguf", tmp_path / "b" / "w.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"x" * 3000)
    assert fingerprint([a]) == fingerprint([b])
    b.write_bytes(b"x" * 2999 + b"y")
    assert fingerprint([a]) != fingerprint([b])


def test_default_model_path():
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_tokenizer(folder) -> None:
    """A word-level tokenizer.json over the tiny vocabulary, plus tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<eot>", "hi", "there"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<eot>"])
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{{ eos_token }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        dict(bos_token="<s>", eos_token="</s>", chat_template=template)))


def test_hf_folder_through_load_model_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path / "cache"))
    folder = write_folder(tmp_path / "m", {**HF_CONFIG, "eos_token_id": 3},
                          tensors={k: np.random.default_rng(0).normal(size=v.shape)
                                   .astype(np.float32) for k, v in tiny_tensors().items()})
    write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    config, params, tok = load_model(folder)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    config2, params2, tok2 = load_model(folder)  # from the cache
    assert config2 == config
    np.testing.assert_array_equal(params2["layers"]["wq"], params["layers"]["wq"])
    for t in (tok, tok2):
        assert t.encode("hi there") == [4, 5]
        assert t.eos_token_ids == (3, 5, 2) and t.bos_token_id == 1
        assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi </s>"
    _, p16, _ = load_model(folder, dtype=jnp.bfloat16)
    assert p16["embed"].dtype == jnp.bfloat16
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_sharded_safetensors(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    tensors = {k: np.random.default_rng(1).normal(size=v.shape).astype(np.float32)
               for k, v in tiny_tensors().items()}
    names = sorted(tensors)
    shards = {"a.safetensors": names[:5], "b.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard))
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _, params = load_safetensors(folder)
    np.testing.assert_array_equal(
        params["layers"]["w_up"][0], tensors["model.layers.0.mlp.up_proj.weight"].T)
    (folder / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="b.safetensors"):
        load_safetensors(folder)
