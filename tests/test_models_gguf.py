"""A tiny GGUF written with gguf.GGUFWriter (mixed tensor types, llama.cpp's q/k permutation):
our loader must recover the Hugging Face-layout weights exactly (no torch needed)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from paged_jax.models import load_gguf, load_model
from paged_jax.models.params import build_params

E, F, HEADS, KV, D, LAYERS, VOCAB = 64, 96, 4, 2, 16, 2, 32
TYPES = {"wq": Q.F16, "wk": Q.BF16, "wv": Q.Q8_0, "wo": Q.Q4_0, "w_gate": Q.Q4_1,
         "w_up": Q.F32, "w_down": Q.Q8_0}
NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
         "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` (rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def hf_weights(rng) -> dict[str, np.ndarray]:
    """Canonical [out, in] weights, already round-tripped through their GGUF type."""
    shapes = {"wq": (HEADS * D, E), "wk": (KV * D, E), "wv": (KV * D, E), "wo": (E, HEADS * D),
              "w_gate": (F, E), "w_up": (F, E), "w_down": (E, F)}
    out = {"embed": rng.normal(size=(VOCAB, E)).astype(np.float32),
           "final_norm": rng.normal(size=E).astype(np.float32)}
    for i in range(LAYERS):
        for base, shape in shapes.items():
            w = rng.normal(size=shape).astype(np.float32)
            out[f"{i}.{base}"] = gguf.quants.dequantize(gguf.quants.quantize(w, TYPES[base]),
                                                        TYPES[base])
        for base in ("attn_norm", "mlp_norm"):
            out[f"{i}.{base}"] = rng.normal(size=E).astype(np.float32)
    return out


def write_gguf(path, w: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(E)
    writer.add_feed_forward_length(F)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(D)
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab", "Ġ"] + [f"t{i}" for i in range(VOCAB - 7)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    writer.add_tensor("token_embd.weight", w["embed"])
    writer.add_tensor("output_norm.weight", w["final_norm"])
    for i in range(LAYERS):
        for base, name in NAMES.items():
            x = w[f"{i}.{base}"]
            x = permute(x, HEADS) if base == "wq" else permute(x, KV) if base == "wk" else x
            writer.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(x, TYPES[base]),
                              raw_dtype=TYPES[base])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", w[f"{i}.attn_norm"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", w[f"{i}.mlp_norm"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    weights = hf_weights(np.random.default_rng(0))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, weights)
    return path, weights


def test_gguf_config_params_and_tokenizer(tiny_gguf):
    path, weights = tiny_gguf
    config, params, tok = load_gguf(path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV, D)
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids == (2,) and config.vocab_size == VOCAB
    want = build_params(config, weights.get)
    for key in want["layers"]:
        np.testing.assert_allclose(params["layers"][key], want["layers"][key], rtol=0, atol=0,
                                   err_msg=key)
    np.testing.assert_array_equal(params["embed"], want["embed"])
    assert tok.encode("ab a") == [5, 6, 3]
    assert tok.encode(tok.apply_chat_template([{"role": "user", "content": "ab"}])) == [1, 5, 2]


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        load_model(path, use_cache=False)


def test_sentencepiece_gguf_tokenizer_gets_a_clear_error():
    from paged_jax.models.tokenizer import tokenizer_from_gguf

    with pytest.raises(ValueError, match="SentencePiece.*Hugging Face folder"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


def test_gguf_streamed_bytes_count_each_matrix_in_its_own_type(tiny_gguf):
    """llama.cpp's batch-1 roofline (make bench) reads every matrix in its file's type; this
    file has no output matrix, so its embedding table is the head and is counted whole."""
    from paged_jax.study.metrics import gguf_streamed_bytes

    path, w = tiny_gguf
    want = w["embed"].nbytes + sum(
        gguf.quants.quantize(w[f"{i}.{base}"], TYPES[base]).nbytes
        for i in range(LAYERS) for base in NAMES)
    assert gguf_streamed_bytes(path) == want
    assert want < sum(w[f"{i}.{b}"].nbytes for i in range(LAYERS) for b in NAMES) + w[
        "embed"].nbytes  # the 4- and 8-bit types read fewer bytes than float32 would
