"""Small random models for fast tests, notebooks and experiments (no checkpoint needed)."""

from __future__ import annotations

import numpy as np
from jax.typing import DTypeLike

from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import Params
from paged_jax.models.params import LAYER_VECTORS, LAYER_WEIGHTS, build_params, expected_shapes

EOS = 256


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA Llama over a 257-token byte vocabulary (256 bytes + EOS)."""
    base = dict(vocab_size=EOS + 1, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096,
                bos_token_id=None, eos_token_ids=(EOS,))
    base.update(overrides)
    return ModelConfig(**base)


def tiny_gemma3_config(**overrides) -> ModelConfig:
    """`tiny_config` with every Gemma 3 feature on: an 8-token sliding window on two of its
    three layers (prompts of a few dozen bytes run past it), GeGLU, q/k and sandwich norms."""
    base = dict(architecture="gemma3", num_layers=3, num_kv_heads=1, embed_scale=8.0,
                hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True, query_scale=0.2,
                sliding_window=8, rope_theta=1e6, rope_local_theta=1e4,
                layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    return tiny_config(**{**base, **overrides})


def tiny_qwen2_config(**overrides) -> ModelConfig:
    """`tiny_config` shaped like Qwen2.5: q/k/v biases, tied embeddings, a 3:1 head ratio
    and RoPE base 1e6."""
    base = dict(attention_bias=True, tie_word_embeddings=True, num_heads=6, num_kv_heads=2,
                rope_theta=1e6, rms_norm_eps=1e-6)
    return tiny_config(**{**base, **overrides})


def tiny_moe_config(**overrides) -> ModelConfig:
    """`tiny_config` with a mixture of 8 experts of width 64 in every layer, each token sent
    to 2 (Mixtral's routing: the two weights renormalised)."""
    base = dict(architecture="mixtral", num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, norm_topk_prob=True)
    return tiny_config(**{**base, **overrides})


def random_params(config: ModelConfig, seed: int = 0, dtype: DTypeLike = np.float32,
                  scale: float = 0.5) -> Params:
    """Gaussian weights scaled so logits have a healthy spread (clear argmax margins)."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(config)

    def get(name: str) -> np.ndarray | None:
        base = name.split(".")[-1]
        if base in ("bq", "bk", "bv", "bo") and not config.attention_bias:
            return None
        if base == "lm_head" and config.tie_word_embeddings:
            return None
        if base.endswith("_norm"):
            return 1.0 + 0.1 * rng.standard_normal(shapes[base])
        fan_in = shapes[base][-1]
        return rng.standard_normal(shapes[base]) * scale / np.sqrt(fan_in) * (
            8.0 if base in ("embed", "lm_head") else 1.0)

    assert LAYER_WEIGHTS and LAYER_VECTORS  # the names build_params asks for
    return build_params(config, get, dtype)


def byte_tokenizer():
    """Byte-level tokenizer: one token per UTF-8 byte, id 256 = EOS."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from paged_jax.models.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["</s>"] = EOS
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=(EOS,), chat_template=template)


def _byte_of(c: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    if ord(c) in printable:
        return ord(c)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(c) - 256]
