"""KV-cache quantization: what an int8 / fp8 block holds, and how it is read back.

vLLM calls the choice `kv_cache_dtype`. Quantization shrinks what a block holds; paging
decides where blocks go: the two are orthogonal. A quantized value is stored with a float32
scale, x ~= q * scale, with one scale per

    group of GROUP values of a token and KV head ("group", what the cache stores): a [D] row
        has D / GROUP scales ([H, N, K, D / GROUP] beside [H, N, K, D] pages), written with
        its token (a scatter, like the values). Costs 4 bytes per 32 values (3.56x fp32).
    token and KV head ("token"): one scale per [D] row, 4 bytes per D values.
    block and KV head ("block"): a [K, D] tile; the scale must cover every token the block
        will ever hold, but tokens arrive one at a time, so a later, larger token forces the
        whole block to be re-quantized (a read-modify-write of the tile on every write).

`measure_granularity` compares them on real K/V (experiments/kv_quantization.py prints it).
Scales per token are the only ones a decode step can write without touching the rest of its
block; groups of 32 lower SmolLM2's int8 attention error further, 0.73% -> 0.66% with the
rotation (notebooks/04_kv_quantization.ipynb), for 8 more bytes per 64 values. int8 K/V are
also rotated by a Hadamard matrix before they are quantized (`rotation`, applied by the
model).

    dtype      bytes/value   range (qmax)   rounding
    int8       1             127            round to nearest, symmetric
    fp8 (e4m3) 1             448            float8 mantissa (3 bits)
    fp8_e5m2   1             57344          float8 mantissa (2 bits)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.types import Array, Float, Shaped

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
_STORAGE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8,
            "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
            "fp8_e5m2": jnp.float8_e5m2}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0,
        jnp.dtype(jnp.float8_e5m2): 57344.0}
SCALE_DTYPE = jnp.float32
GROUP = 32  # values per scale (fewer when head_dim is not a multiple: `group_size`)
# What a page array holds in memory: bfloat16 / fp8 pages as their bits, because XLA:CPU
# scatters into those dtypes by converting the whole array (kernels/pages.py says more).
_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
         jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
         jnp.dtype(jnp.float8_e5m2): jnp.dtype(jnp.uint8)}


def storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype K/V pages are stored in ("auto": the model's).

    Raises:
      ValueError: an unknown name, with the accepted ones.
    """
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in _STORAGE:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; expected one "
                         f"of {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(_STORAGE[kv_cache_dtype])


def bits_dtype(dtype) -> jnp.dtype:
    """The dtype pages of `dtype` are stored in: their bits for bfloat16 / fp8 on CPU; on an
    accelerator themselves (its scatters have no such cost, and a kernel that takes the pages
    through TMA, kernels/mosaic_decode.py, would need a bitcast copy of the pool)."""
    if jax.default_backend() != "cpu":
        return jnp.dtype(dtype)
    return _BITS.get(jnp.dtype(dtype), jnp.dtype(dtype))


def to_bits(x: Array, dtype) -> Array:
    """x cast to `dtype`, as stored (`bits_dtype`)."""
    x = x.astype(dtype)
    bits = bits_dtype(dtype)
    return x if bits == x.dtype else jax.lax.bitcast_convert_type(x, bits)


def rotation(dtype, head_dim: int) -> np.ndarray | None:
    """The orthonormal Hadamard matrix [D, D] int8 K/V (and q, and back the output) are
    rotated by, or None (fp8, float caches, a head_dim that is not a power of two).

    Why: a few key channels carry most of the magnitude, and a per-token int8 scale sized
    for them leaves the rest few levels. The rotation spreads every channel over all D,
    (q H) . (k H) = q . k, and the attention output sum_t w_t (v_t H) is rotated back by H^T.
    Measured on SmolLM2's K/V (notebooks/04_kv_quantization.ipynb): int8 attention error
    1.04% -> 0.72%, and 8 -> 11 of 16 prompts greedy-identical to the float32 cache
    (experiments/kv_quantization.py); fp8 (a float format, its error already relative) gets
    worse (3.4% -> 3.8%), so it is not rotated.
    """
    if jnp.dtype(dtype) != jnp.dtype(jnp.int8) or head_dim & (head_dim - 1):
        return None
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < head_dim:  # Sylvester's construction
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(head_dim, dtype=np.float32)


def is_quantized(dtype) -> bool:
    """Whether pages of `dtype` carry scales (int8, fp8)."""
    return jnp.dtype(dtype) in QMAX


def group_size(head_dim: int) -> int:
    """Values per scale in a row of head_dim: GROUP, or the largest divisor of head_dim that
    divides GROUP (head_dim 16: one scale per row)."""
    return math.gcd(head_dim, GROUP)


def num_groups(head_dim: int) -> int:
    """Scales per [head_dim] row of a quantized cache."""
    return head_dim // group_size(head_dim)


def bytes_per_token_head(dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes, its scales included."""
    dt = jnp.dtype(dtype)
    scales = num_groups(head_dim) * jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(dt) else 0
    return head_dim * dt.itemsize + scales


def quantize(
    x: Float[Array, "... D"], dtype, group: int | None = None
) -> tuple[Array, Float[Array, "... Z"]]:
    """(q, scale) with x ~= dequantize(q, scale): one scale per `group` consecutive values of
    the last axis (default `group_size(D)`; D for one scale per row), G = D / group scales.

    All-zero groups get scale 1 (q = 0), so padding and the zero block stay exact. A scale is
    never below float32's smallest normal: XLA:CPU flushes subnormals to zero, and a group of
    tiny values (amax < qmax * 1.2e-38) would otherwise divide by a zero scale (NaN).
    """
    dt = jnp.dtype(dtype)
    qmax = QMAX[dt]
    d = x.shape[-1]
    group = group_size(d) if group is None else group
    x = x.astype(jnp.float32).reshape(*x.shape[:-1], d // group, group)
    amax = jnp.max(jnp.abs(x), axis=-1)
    tiny = np.finfo(np.float32).tiny
    scale = jnp.where(amax > 0, jnp.maximum(amax / qmax, tiny), 1.0)
    y = jnp.clip(x / scale[..., None], -qmax, qmax)  # fp8 casts overflow to NaN, not to max
    if dt == jnp.dtype(jnp.int8):
        y = jnp.round(y)
    return y.astype(dt).reshape(*y.shape[:-2], d), scale.astype(SCALE_DTYPE)


def dequantize(q: Shaped[Array, "... D"], scale: Float[Array, "... Z"]) -> Float[Array, "... D"]:
    """float32 values of quantized rows, each group of D / Z values times its scale."""
    shape, g = q.shape, scale.shape[-1]
    x = q.astype(jnp.float32).reshape(*shape[:-1], g, shape[-1] // g)
    return (x * scale[..., None].astype(jnp.float32)).reshape(shape)


def roundtrip(x: Float[Array, "... D"], dtype, granularity: str = "group") -> Array:
    """x quantized and read back, with one scale per GROUP values of a row ("group", the
    cache's), per row ("token") or per [K, D] tile of a [..., K, D] array ("block")."""
    if granularity in ("group", "token"):
        return dequantize(*quantize(x, dtype, None if granularity == "group" else x.shape[-1]))
    if granularity != "block":
        raise ValueError(f"granularity must be 'group', 'token' or 'block', got {granularity!r}")
    shape = x.shape
    flat = x.reshape(*shape[:-2], shape[-2] * shape[-1])  # one row per tile
    return dequantize(*quantize(flat, dtype, flat.shape[-1])).reshape(shape)


def measure_granularity(
    k: np.ndarray, v: np.ndarray, q: np.ndarray, block_size: int, dtypes=("int8", "fp8")
) -> list[dict]:
    """Scales per group, per token and per block on real K/V of one sequence and layer.

    Args:
      k, v: [T, H, D] a sequence's keys and values; q: [T, Q, D] its queries (Q = H * G).

    Returns:
      rows of dtype, granularity, and the mean relative error of K, of V and of causal
      attention outputs against the float32 cache.
    """
    t, h, d = k.shape
    pad = -t % block_size
    rows = []
    for name in dtypes:
        dt = storage_dtype(name, jnp.float32)
        for gran in ("group", "token", "block"):
            def rt(x, gran=gran, dt=dt):
                tiles = np.pad(x, ((0, pad), (0, 0), (0, 0)))
                tiles = tiles.reshape(-1, block_size, h, d).transpose(0, 2, 1, 3)
                out = np.asarray(roundtrip(jnp.asarray(tiles), dt, gran))
                return out.transpose(0, 2, 1, 3).reshape(-1, h, d)[:t]

            kq, vq = rt(k), rt(v)
            exact = _attention(q, k, v)
            err = np.abs(_attention(q, kq, vq) - exact)
            rows.append(dict(dtype=name, granularity=gran,
                             k_rel_err=float(np.abs(kq - k).mean() / np.abs(k).mean()),
                             v_rel_err=float(np.abs(vq - v).mean() / np.abs(v).mean()),
                             attn_rel_err=float(err.mean() / np.abs(exact).mean())))
    return rows


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention of one sequence, grouped heads, float64 (a reference)."""
    t, nq, d = q.shape
    g = nq // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("tqd,sqd->qts", q.astype(np.float64), kk) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("qts,sqd->tqd", w, vv)
