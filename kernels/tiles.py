"""Shared math of the Pallas attention kernels (decode and ragged): the online softmax over
tiles of keys, and loading pages as stored (float, bits, int8 / fp8 with scales) into tiles.

Masking is exact: a key a query may not see gets score -inf (where, not a multiply) and its V
row is replaced by 0 before p @ v, so a stale or NaN block never reaches the output.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kernels.pages import PagesLike, as_pages, view

Ref = Any  # a Pallas ref inside a kernel (not an Array)
DType = Any  # jnp.float32 is a class, jnp.dtype("float32") an instance: both accepted


def init_state(rows: int, d: int) -> tuple[Array, Array, Array]:
    """Online-softmax state: unnormalized output, running max, running denominator."""
    o = jnp.zeros((rows, d), jnp.float32)
    m = jnp.full((rows,), -jnp.inf, jnp.float32)
    return o, m, jnp.zeros((rows,), jnp.float32)


def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """tl.dot, fp32 accumulation; fp32 inputs in IEEE fp32 (not TF32) to match the reference."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=jnp.float32
    )


def qk(q: Array, k: Array, use_dot: bool) -> Array:
    """[R, D] x [K, D] -> [R, K] scores in fp32."""
    if use_dot:
        return _dot(q, k, (1, 1))
    return jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)


def pv(p: Array, v: Array, use_dot: bool) -> Array:
    """[R, K] x [K, D] -> [R, D] in fp32."""
    if use_dot:
        return _dot(p, v, (1, 0))
    return jnp.sum(p[:, :, None] * v[None, :, :], axis=1)


def online_update(
    state: tuple[Array, Array, Array], s: Array, v: Array, use_dot: bool
) -> tuple[Array, Array, Array]:
    """Folds one tile of masked scores s [R, K] (-inf = masked) and values v [K, D] in."""
    o, m, den = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row with nothing visible yet keeps max -inf; shift by 0 then so exp gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    corr = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    o = o * corr[:, None] + pv(p.astype(v.dtype) if use_dot else p, v, use_dot)
    return o, m_new, den * corr + jnp.sum(p, axis=-1)


def normalize(o: Array, den: Array) -> Array:
    """o / den, and 0 for rows that saw no key (padding sequences)."""
    return jnp.where(den[:, None] > 0, o / jnp.where(den > 0, den, 1.0)[:, None], 0.0)


def load_page(
    ref: Ref, h: Array, page: Array, valid: Array, dtype: DType, kv_dtype: DType,
    scale_ref: Ref | None = None,
) -> Array:
    """One [K, D] page of KV head h in `dtype`, rows past the sequence end replaced by 0 (they
    may be NaN). Pages stored as bits are viewed as `kv_dtype` after the load, and int8 / fp8
    ones multiplied by their scales (kernels/pages.py): Z per token, each over D / Z
    consecutive values, spread over the row with one load and a select per group (Triton has
    no reshape of a loaded block)."""
    x = view(ref[h, page, :, :], kv_dtype)
    if scale_ref is not None:
        x = x.astype(jnp.float32)
        groups, d = scale_ref.shape[-1], x.shape[-1]
        col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) // (d // groups)
        full = scale_ref[h, page, :, 0][:, None] * jnp.ones_like(x)
        for g in range(1, groups):
            full = jnp.where(col == g, scale_ref[h, page, :, g][:, None], full)
        x = x * full
    x = x.astype(dtype)
    return jnp.where(valid[:, None], x, jnp.zeros_like(x))


def page_operands(k_pages: PagesLike, v_pages: PagesLike) -> tuple[list[Array], Any, bool]:
    """The kernels' K/V operands (values, then scales when quantized), the values' dtype, and
    whether they carry scales."""
    k, v = as_pages(k_pages), as_pages(v_pages)
    scales = [k.scale, v.scale] if k.scale is not None else []
    return [k.values, v.values, *scales], k.dtype, bool(scales)


def compute_dtype(kv_dtype: DType, q_dtype: DType, use_dot: bool) -> DType:
    """What pages are multiplied in: f32 for the elementwise variants; for tl.dot the pages'
    own float dtype, or q's when they are int8 / fp8 (dequantized on load)."""
    if not use_dot:
        return jnp.float32
    kv = jnp.dtype(kv_dtype)
    return kv if kv in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.dtype(q_dtype)


def split_refs(refs: tuple, quantized: bool) -> tuple[Ref | None, Ref | None, tuple]:
    """(k scale ref, v scale ref, the rest) of a kernel's refs after K and V."""
    return (refs[0], refs[1], refs[2:]) if quantized else (None, None, refs)


def load_pages(ref: Ref, h: Array, pages: Array, valid: Array, dtype: DType,
               kv_dtype: DType) -> Array:
    """C pages of KV head h gathered as one [C * K, D] tile (float pages only), rows that
    are not `valid` replaced by 0."""
    x = view(ref[h, pages, :, :], kv_dtype)  # [C, K, D]
    x = x.reshape(x.shape[0] * x.shape[1], x.shape[2]).astype(dtype)
    return jnp.where(valid[:, None], x, jnp.zeros_like(x))
