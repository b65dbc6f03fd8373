# ruff: noqa: F821  (jaxtyping axis strings such as "N" read as undefined names)
"""Weight-only int8 / int4 matmul for GPUs, in Pallas (Triton): y = x @ w.T with w's codes
dequantized inside the kernel, one group of k at a time, so the weights cross HBM at a quarter
or an eighth of float32's bytes (batch-1 decode reads every weight once per token).

The GPU layout (`QuantWeight`, built on the host by `quantize`) is not the CPU kernel's panels:

    int8   q [K, N] int8,       scales [K / G, N]          w[n, k] = scales[k // G, n] * q[k, n]
    int4   q [K / 2, N] uint8,  scales, mins [K / G, N]    G = 32; in group g, row r < 16 holds
                                                           k = 32g + r in its low nibble and
                                                           k = 32g + 16 + r in its high one:
                                                           w = scale * code + min

so a group's codes are one [G, N] (int8) or [G / 2, N] (int4) tile: the kernel loads it,
converts it, scales it and runs one tl.dot per group (two for int4: the low and high nibbles
against the two halves of the group's x columns, no interleave). Scales are float32.

    grid (M / BM, N / BN); program (i, j): acc [BM, BN] float32 over the K / G groups

`reference` is the same product in jnp (dequantize, then dot): what the kernel is checked
against in interpret mode (tests/test_quant_matmul.py); the tests also lower it for CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Shaped

from kernels.paged_attention import compiler_params, use_interpret

GROUPS = {"int8": 64, "int4": 32}  # k per scale
BM, BN = 16, 64  # tile of y: tl.dot needs every dimension >= 16


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scales", "mins"],
                   meta_fields=["bits"])
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight's codes in the GPU layout (module docstring); mins for int4 only."""

    q: Shaped[Array, "Kq N"]
    scales: Float[Array, "G N"]
    mins: Float[Array, "G N"] | None
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        k = self.q.shape[0] * (2 if self.bits == 4 else 1)
        return self.q.shape[1], k


def quantize(w, weights: str) -> QuantWeight:
    """A float [N, K] weight as "int8" (symmetric, max |w| / 127 per group of 64) or "int4"
    (min / max per group of 32, 16 levels), on the host with numpy."""
    if weights not in GROUPS:
        raise ValueError(f"quantized weights are one of {tuple(GROUPS)}, got {weights!r}")
    w = np.asarray(w, np.float32).T  # [K, N]
    k, n = w.shape
    g = GROUPS[weights]
    if k % g:
        raise ValueError(f"{weights} weights need an input width that is a multiple of {g}, "
                         f"got {k}")
    groups = w.reshape(k // g, g, n)
    if weights == "int8":
        scales = np.abs(groups).max(axis=1) / 127.0
        q = np.rint(groups / np.where(scales > 0, scales, 1)[:, None])
        return QuantWeight(jnp.asarray(np.clip(q, -127, 127).astype(np.int8).reshape(k, n)),
                           jnp.asarray(scales, jnp.float32), None, 8)
    lo, hi = groups.min(axis=1), groups.max(axis=1)
    scales = (hi - lo) / 15.0
    q = np.clip(np.rint((groups - lo[:, None]) / np.where(scales > 0, scales, 1)[:, None]),
                0, 15).astype(np.uint8)  # [K / G, G, N]
    packed = (q[:, :g // 2] | (q[:, g // 2:] << 4)).reshape(k // 2, n)
    return QuantWeight(jnp.asarray(packed), jnp.asarray(scales, jnp.float32),
                       jnp.asarray(lo, jnp.float32), 4)


def dequantize(w: QuantWeight) -> Float[Array, "N K"]:
    """The float32 [N, K] weight the codes stand for."""
    if w.bits == 8:
        g = w.q.shape[0] // w.scales.shape[0]
        return (w.q.astype(jnp.float32) * jnp.repeat(w.scales, g, axis=0)).T
    half = w.q.reshape(w.scales.shape[0], -1, w.q.shape[1])  # [K / G, G / 2, N]
    codes = jnp.concatenate([half & 15, half >> 4], axis=1).astype(jnp.float32)
    return (codes * w.scales[:, None] + w.mins[:, None]).reshape(-1, w.q.shape[1]).T


def reference(x: Float[Array, "M K"], w: QuantWeight) -> Float[Array, "M N"]:
    """x @ w.T on the dequantized weight, float32 accumulation."""
    return jnp.dot(x, dequantize(w).T.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def _dot(a: Array, b: Array) -> Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _kernel(x_ref, q_ref, s_ref, *rest, bits: int, group: int, groups: int):
    o_ref = rest[-1]
    m_ref = rest[0] if bits == 4 else None

    def body(g, acc):
        s = s_ref[pl.ds(g, 1), :]  # [1, BN]
        if bits == 8:
            w = (q_ref[pl.ds(g * group, group), :].astype(jnp.float32) * s)
            return acc + _dot(x_ref[:, pl.ds(g * group, group)], w.astype(x_ref.dtype))
        half = group // 2
        codes = q_ref[pl.ds(g * half, half), :]  # [G / 2, BN] uint8
        m = m_ref[pl.ds(g, 1), :]
        lo = ((codes & 15).astype(jnp.float32) * s + m).astype(x_ref.dtype)
        hi = ((codes >> 4).astype(jnp.float32) * s + m).astype(x_ref.dtype)
        acc = acc + _dot(x_ref[:, pl.ds(g * group, half)], lo)
        return acc + _dot(x_ref[:, pl.ds(g * group + half, half)], hi)

    acc = jax.lax.fori_loop(0, groups, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def quant_matmul(x: Float[Array, "M K"], w: QuantWeight, interpret: bool | None = None,
                 num_warps: int = 4) -> Float[Array, "M N"]:
    """x @ w.T with w's codes dequantized in the kernel (M and N padded to the tile)."""
    n, k = w.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"quant_matmul: x has {x.shape[1]} features, the weight {k}")
    group = k // w.scales.shape[0]
    mp, np_ = -(-m // BM) * BM, -(-n // BN) * BN
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    pad_n = lambda a: jnp.pad(a, ((0, 0), (0, np_ - n)))  # noqa: E731
    ops = [pad_n(w.q), pad_n(w.scales)] + ([pad_n(w.mins)] if w.bits == 4 else [])
    col = lambda rows: pl.BlockSpec((rows, BN), lambda i, j: (0, j))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, bits=w.bits, group=group, groups=w.scales.shape[0]),
        grid=(mp // BM, np_ // BN),
        in_specs=[pl.BlockSpec((BM, k), lambda i, j: (i, 0))] + [col(a.shape[0]) for a in ops],
        out_specs=pl.BlockSpec((BM, BN), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        interpret=use_interpret() if interpret is None else interpret,
        compiler_params=compiler_params(num_warps=num_warps),
        name=f"quant_matmul_int{w.bits}",
    )(xp, *ops)
    return out[:m, :n]
