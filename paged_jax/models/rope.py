"""Rotary position embeddings (RoPE) of the decoder: inverse frequencies with the configured
scaling, the per-forward (cos, sin) tables, and the rotation (Hugging Face's rotate-half
pairing, dims i and i + D/2). D2 in annotations is D / 2."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.models.config import ModelConfig
from paged_jax.types import Array, Float, Int


def inv_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """[D/2] RoPE inverse frequencies in fp32, with the configured scaling; `local`: those of
    sliding-window layers (config.rope_local_theta, never scaled)."""
    d = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    inv = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    rs = {} if local else config.rope_scaling_dict
    if rs.get("rope_type") == "linear":
        return (inv / np.float32(rs["factor"])).astype(np.float32)
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


def rope_tables(
    positions: Int[Array, "T"], inv_freq: Float[Array, "D2"]
) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """(cos, sin) of position * inv_freq, each half repeated (HF rotate_half layout), fp32.

    Computed once per forward and shared by every layer."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.cos(ang)] * 2, -1), jnp.concatenate([jnp.sin(ang)] * 2, -1)


def rope(
    x: Float[Array, "T X D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"]
) -> Float[Array, "T X D"]:
    """Rotates pairs (i, i + D/2) by the angles of `rope_tables`, in fp32."""
    with jax.named_scope("rope"):
        x32 = x.astype(jnp.float32)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
        return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)
