"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache, as pure functions.

Params are a plain pytree (dict) with the layers stacked on a leading L axis so the decoder is
one `lax.scan` (one layer traced, compile time independent of depth):

    embed [V, E]     final_norm [E]     lm_head [E, V] (absent when embeddings are tied)
    layers: attn_norm [L, E]  wq [L, E, Q*D]  wk, wv [L, E, H*D]  wo [L, Q*D, E]
            bq [L, Q*D]  bk, bv [L, H*D]  (q/k/v bias, optional)   bo [L, E] (optional)
            mlp_norm [L, E]  w_gate, w_up [L, E, F]  w_down [L, F, E]

Weights are stored [in, out] so every projection is `x @ w`. RoPE uses Hugging Face's
rotate-half pairing (dims i and i + D/2); GGUF loaders un-permute llama.cpp's interleaved q/k.
D2 in annotations is D / 2 (one inverse frequency per rotated pair).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import kv_cache as kv_lib
from paged_jax.attention import paged_attention
from paged_jax.kv_cache import KVCache
from paged_jax.models.config import ModelConfig
from paged_jax.types import Array, Float, Int

Params = dict[str, Any]


def rms_norm(x: Float[Array, "T E"], w: Float[Array, "E"], eps: float) -> Float[Array, "T E"]:
    """RMSNorm computed in fp32, cast back before the weight (as Hugging Face does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def inv_frequencies(config: ModelConfig) -> np.ndarray:
    """[D/2] RoPE inverse frequencies in fp32, with Llama-3 scaling when configured."""
    d = config.head_dim
    inv = (1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(
        np.float32
    )
    rs = config.rope_scaling_dict
    if rs.get("rope_type") == "freq_factors":
        return (inv / np.asarray(rs["factors"], np.float32)).astype(np.float32)
    if rs.get("rope_type") != "llama3":
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(
    x: Float[Array, "T X D"], positions: Int[Array, "T"], inv_freq: Float[Array, "D2"]
) -> Float[Array, "T X D"]:
    """Rotates pairs (i, i + D/2) by position * inv_freq[i] (HF rotate_half layout), in fp32."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _proj(x: Array, p: Params, w: str, b: str) -> Array:
    y = x @ p[w]
    return y + p[b] if b in p else y


def attention_block(
    p: Params, x: Float[Array, "T E"], cache: KVCache, layer: Int[Array, ""], batch: tuple,
    inv_freq: Float[Array, "D2"], config: ModelConfig, max_q: int, backend: str,
    max_q_rows: int | None = None,
) -> tuple[Float[Array, "T E"], KVCache]:
    """Self-attention of one layer: project, RoPE, write K/V to the pages, paged attention."""
    positions, slots, block_tables, seq_lens, query_start = batch
    t, d = x.shape[0], config.head_dim
    q = _proj(x, p, "wq", "bq").reshape(t, config.num_heads, d)
    k = _proj(x, p, "wk", "bk").reshape(t, config.num_kv_heads, d)
    v = _proj(x, p, "wv", "bv").reshape(t, config.num_kv_heads, d)
    q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
    cache = kv_lib.write(cache, layer, slots, k, v)
    o = paged_attention(
        q, cache.k[layer], cache.v[layer], block_tables, seq_lens, query_start,
        max_q=max_q, backend=backend, max_q_rows=max_q_rows,
    )
    return _proj(o.reshape(t, -1).astype(x.dtype), p, "wo", "bo"), cache


def mlp_block(p: Params, x: Float[Array, "T E"]) -> Float[Array, "T E"]:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def forward(
    params: Params,
    cache: KVCache,
    token_ids: Int[Array, "T"],
    positions: Int[Array, "T"],
    slot_mapping: Int[Array, "T"],
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    config: ModelConfig,
    max_q: int,
    backend: str = "reference",
    all_logits: bool = False,
    max_q_rows: int | None = None,
) -> tuple[Float[Array, "S V"] | Float[Array, "T V"], KVCache]:
    """One decoder pass over a ragged batch (semantics of `paged_jax.attention`).

    Args:
      params: the model pytree (module docstring); its dtype is the compute dtype.
      cache: KV pages [L, H, N, K, D]; this step's K/V are written at `slot_mapping`.
      token_ids, positions, slot_mapping: [T] per token; padding tokens have slot < 0.
      block_tables, seq_lens, query_start: the paging of the S sequences (attention.py).
      config: static model config.
      max_q: static bound on queries per sequence (1 for decode).
      backend: paged-attention backend, "reference" or "pallas".
      all_logits: return logits for every token instead of each sequence's last one.
      max_q_rows: static; only the first max_q_rows sequences have more than one query
        (see `paged_jax.attention.paged_attention`).

    Returns:
      (logits fp32 [S, V] at token query_start[s+1] - 1, or [T, V] if all_logits; cache').
    """
    x = params["embed"][token_ids]
    inv_freq = jnp.asarray(inv_frequencies(config))
    batch = (positions, slot_mapping, block_tables, seq_lens, query_start)
    eps = config.rms_norm_eps

    def layer(carry: tuple[Array, KVCache], xs: tuple[Array, Params]) -> tuple[tuple, None]:
        h, kv = carry
        i, p = xs
        a, kv = attention_block(
            p, rms_norm(h, p["attn_norm"], eps), kv, i, batch, inv_freq, config, max_q, backend,
            max_q_rows,
        )
        h = h + a
        h = h + mlp_block(p, rms_norm(h, p["mlp_norm"], eps))
        return (h, kv), None

    idx = jnp.arange(config.num_layers)
    (x, cache), _ = jax.lax.scan(layer, (x, cache), (idx, params["layers"]))
    if not all_logits:
        x = x[jnp.clip(query_start[1:] - 1, 0)]
    x = rms_norm(x, params["final_norm"], eps)
    if "lm_head" in params:
        logits = x @ params["lm_head"]
    else:
        logits = jnp.einsum("te,ve->tv", x, params["embed"])
    return logits.astype(jnp.float32), cache


@functools.lru_cache(maxsize=64)
def make_forward(
    config: ModelConfig, max_q: int, backend: str = "reference", all_logits: bool = False
):
    """`forward` jitted for one (config, max_q, backend, all_logits), the cache donated.

    The returned function takes the positional arguments of `forward`; it compiles once per
    distinct input shape (the engine pads to a few buckets).
    """
    fn = functools.partial(
        forward, config=config, max_q=max_q, backend=backend, all_logits=all_logits
    )
    return jax.jit(fn, donate_argnums=(1,))

