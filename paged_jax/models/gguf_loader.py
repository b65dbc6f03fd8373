"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized by `gguf.quants`.

llama.cpp's converter permutes the rows of q/k weights of "llama"-architecture models so RoPE
rotates adjacent pairs (2i, 2i+1); our RoPE rotates (i, i + D/2) like Hugging Face, so
`unpermute` undoes it. Qwen2 and Gemma 3 GGUFs are not permuted.

Gemma 3 files leave some hyperparameters out, which llama.cpp fixes in code and so do we:
five sliding-window layers per full one, RoPE base 10k on the sliding layers, and a query
scale of head_dim ** -0.5 (hidden / heads for the 27B). Their norm weights already hold
Gemma's 1 + w.

Mixture-of-experts files (Mixtral as "llama" with expert keys, "qwen2moe", "qwen3moe") hold
each layer's experts merged in one [X, out, in] tensor per projection (llama.cpp's
`ffn_*_exps`); older Mixtral files with one tensor per expert are not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import Params
from paged_jax.models.params import build_params
from paged_jax.models.tokenizer import Tokenizer, gguf_stop_ids, tokenizer_from_gguf

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "gemma3", "qwen2moe", "qwen3moe")
# Mixture-of-experts files: our architecture name (a "llama" file with experts is Mixtral) and
# whether the kept experts' weights are renormalised (llama.cpp's rule per architecture).
MOE_ARCHS = {"llama": ("mixtral", True), "mistral": ("mixtral", True),
             "qwen2moe": ("qwen2_moe", False), "qwen3moe": ("qwen3_moe", True)}
PERMUTED_ARCHS = ("llama", "mistral")  # q/k rows interleaved for llama.cpp's RoPE
GEMMA3_PATTERN = 6  # every sixth layer attends globally (llama.cpp: set_swa_pattern(6))
GEMMA3_LOCAL_THETA = 10000.0
_GGUF_LAYER = {
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "bo": "attn_output.bias", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight", "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
    "router": "ffn_gate_inp.weight", "e_gate": "ffn_gate_exps.weight",
    "e_up": "ffn_up_exps.weight", "e_down": "ffn_down_exps.weight",
    "s_gate": "ffn_gate_shexp.weight", "s_up": "ffn_up_shexp.weight",
    "s_down": "ffn_down_shexp.weight", "s_router": "ffn_gate_inp_shexp.weight",
}
_GGUF_GLOBAL = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                "lm_head": "output.weight"}


def gguf_name(canonical: str) -> str:
    """GGUF tensor name of a canonical name ("3.wq" -> "blk.3.attn_q.weight")."""
    if canonical in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[canonical]
    layer, base = canonical.split(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[base]}"


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _gemma3_fields(key, n_layers: int, width: int, heads: int, head_dim: int) -> dict:
    """The Gemma 3 fields of ModelConfig (module docstring: what the file leaves out)."""
    scaling = None
    if key("rope.scaling.type") == "linear":
        scaling = (("factor", float(key("rope.scaling.factor"))), ("rope_type", "linear"))
    query = width // heads if n_layers == 62 else head_dim  # llama.cpp: 27B scales by E/Q
    return dict(
        architecture="gemma3", embed_scale=float(width) ** 0.5, hidden_act="gelu_tanh",
        qk_norm=True, sandwich_norm=True, query_scale=float(query) ** -0.5,
        sliding_window=int(key("attention.sliding_window")),
        layer_types=tuple("full_attention" if (i + 1) % GEMMA3_PATTERN == 0
                          else "sliding_attention" for i in range(n_layers)),
        rope_local_theta=GEMMA3_LOCAL_THETA, rope_scaling=scaling,
    )


def _moe_fields(arch: str, key) -> dict:
    """The mixture-of-experts fields of ModelConfig from a GGUF's expert keys."""
    name, norm = MOE_ARCHS.get(arch, (None, False))
    if name is None:
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported")
    return dict(architecture=name, num_experts=key("expert_count"),
                num_experts_per_tok=key("expert_used_count"),
                moe_intermediate_size=key("expert_feed_forward_length")
                or key("feed_forward_length"),
                shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0),
                norm_topk_prob=bool(key("expert_weights_norm", norm)),
                **(dict(qk_norm=True) if arch == "qwen3moe" else {}))


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any]) -> ModelConfig:
    """ModelConfig from GGUF metadata (and which tensors exist: output.weight, rope_freqs)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHS}")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads, width = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or width // heads
    scaling = None
    if "rope_freqs.weight" in tensors:  # llama.cpp bakes Llama-3 rope scaling into factors
        factors = dequantize(tensors["rope_freqs.weight"]).ravel().tolist()
        scaling = (("factors", tuple(factors)), ("rope_type", "freq_factors"))
    extra = (_gemma3_fields(key, key("block_count"), width, heads, head_dim)
             if arch == "gemma3" else {"rope_scaling": scaling})
    if key("expert_count"):
        extra.update(_moe_fields(arch, key))
    return ModelConfig(
        vocab_size=key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=width, intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"), num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        max_position_embeddings=key("context_length", 2048),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_stop_ids(meta),
        **extra,
    )


def dequantize(t: Any) -> np.ndarray:
    """One tensor as fp32 numpy in row-major [out, in] (ggml lists dims innermost first)."""
    try:
        x = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {t.name!r}: unsupported GGUF type {t.tensor_type.name}") from e
    return np.asarray(x, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute`: interleaved RoPE rows back to rotate-half."""
    r = w.shape[0]
    return w.reshape(n_heads, r // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: Path, dtype: DTypeLike = jnp.float32
) -> tuple[ModelConfig, Params, Tokenizer]:
    """(config, params, tokenizer) from a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, tensors)
    permuted = meta["general.architecture"] in PERMUTED_ARCHS

    def get(canonical: str) -> np.ndarray | None:
        t = tensors.get(gguf_name(canonical))
        if t is None:
            return None
        x = dequantize(t)
        base = canonical.rsplit(".", 1)[-1]
        if permuted and base in ("wq", "bq"):
            x = unpermute(x, config.num_heads)
        elif permuted and base in ("wk", "bk"):
            x = unpermute(x, config.num_kv_heads)
        return x.reshape(1, -1) if base == "s_router" else x  # llama.cpp: a vector

    params = build_params(config, get, dtype, file_name=gguf_name)
    return config, params, tokenizer_from_gguf(meta)
