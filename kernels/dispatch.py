# ruff: noqa: F821  (jaxtyping axis strings such as "S" read as undefined names)
"""The one door from the engine into kernels/: picks a kernel and its variant from static shapes.

    max_q == 1  -> decode: `decode_plan`
                   kernel   "mosaic" (kernels/mosaic_decode.py, Hopper) where it takes the shapes
                            and is preferred (S * H >= MOSAIC_MIN_PROGRAMS, or the Triton
                            backend is gone from this JAX), else "triton" (paged_attention.py)
                   splits   flash-decoding when S * H programs cannot fill the GPU
                   pages    gathered per loop step, for float pages: MOSAIC_TOKENS / TRITON_TOKENS
                            tokens (Triton: at most TILE_BYTES a tile)
                   variant  (Triton) "dot" / "split_dot" on tensor cores for float pages of
                            block >= 16; else "grouped" / "split" (elementwise), or "dot" for
                            wide groups (G >= 8)
    max_q  > 1  -> ragged kernel (kernels.ragged_paged_attention):
                   "dot" (tensor cores, prefill is compute-bound) when the block size allows,
                   else "grouped"

`decode_kernel="triton" | "mosaic"` forces decode's kernel (the attention backends
"pallas-triton" / "pallas-mosaic"; gpu_check runs the engine on each). Interpret mode is chosen
automatically off GPU (by the kernels themselves).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import mosaic_decode
from kernels.paged_attention import DOT_MIN, TRITON, decode_attention, max_pages_per_step
from kernels.pages import PagesLike, as_pages, view
from kernels.ragged_paged_attention import ragged_paged_attention

TARGET_PROGRAMS = 264  # two programs per SM on an H100 / H200 (132 SMs)
# Measured on an H200 (results/gpu_check.json, first run of 2026-12-04): Mosaic GPU's decode
# was faster than Triton's at every grid shape with batch >= 16 (8 KV heads: S * H >= 128),
# e.g. 0.337 vs 0.440 ms at batch 64, context 4k and 1.19 vs 1.62 ms at 64 x 16k; at batch 1
# the two were within the noise of a launch. Triton gathered 4 pages of 16 a step faster
# than 8 there (0.397 ms); Mosaic GPU 8 (128 tokens) faster than 4 with 3 stages (0.365).
MOSAIC_MIN_PROGRAMS = 128
MOSAIC_TOKENS = 128
TRITON_TOKENS = 64
DECODE_KERNELS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How a decode step runs: kernel ("triton" | "mosaic"), Triton variant, splits of each
    sequence's pages, pages per loop step."""

    kernel: str
    variant: str
    num_splits: int
    pages_per_step: int


def decode_kernel(dtype, head_dim: int, block: int, group: int, pages_per_step: int,
                  asked: str = "auto", programs: int = 0) -> str:
    """"mosaic" or "triton" for these shapes (module docstring); `asked` forces one."""
    if asked not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {asked!r}; expected one of {DECODE_KERNELS}")
    why = mosaic_decode.supported(dtype, head_dim, block, group, pages_per_step)
    prefer = programs >= MOSAIC_MIN_PROGRAMS
    if asked == "mosaic" or (asked == "auto" and (prefer or not TRITON)):
        if why is None:
            return "mosaic"
        if not TRITON or asked == "mosaic":
            raise ValueError(f"the Mosaic GPU decode kernel does not take {why}"
                             + ("" if TRITON else ", and this JAX has no Triton backend"))
    return "triton"


def _splits(programs: int, steps: int) -> int:
    """Flash-decoding splits: double while the grid is under TARGET_PROGRAMS and every split
    keeps at least two loop steps."""
    splits = 1
    while programs * splits * 2 <= TARGET_PROGRAMS and steps // (splits * 2) >= 2:
        splits *= 2
    return splits


def decode_plan(nseq: int, nq: int, h: int, block: int, pages: int, dtype=jnp.bfloat16,
                quantized: bool = False, head_dim: int = 128, kernel: str = "auto"
                ) -> DecodePlan:
    """The decode plan for these static shapes (module docstring); `kernel` forces one."""
    wide = not quantized and block >= DOT_MIN
    if wide:
        mosaic_step = max(1, MOSAIC_TOKENS // block)
        kernel = decode_kernel(dtype, head_dim, block, nq // h, mosaic_step, kernel, nseq * h)
        per_step = mosaic_step if kernel == "mosaic" else min(
            max(1, TRITON_TOKENS // block), max_pages_per_step(block, head_dim, dtype))
        splits = _splits(nseq * h, -(-pages // per_step))
        return DecodePlan(kernel, "split_dot" if splits > 1 else "dot", splits, per_step)
    splits = _splits(nseq * h, pages)
    if kernel == "mosaic":
        raise ValueError("the Mosaic GPU decode kernel takes float pages of block >= "
                         f"{DOT_MIN} (got block {block}{', int8 / fp8' if quantized else ''})")
    if splits > 1:
        return DecodePlan("triton", "split", splits, 1)
    return DecodePlan("triton", "dot" if nq // h >= 8 and block >= DOT_MIN else "grouped", 1, 1)


def decode(q: Float[Array, "S Q D"], k_pages: PagesLike, v_pages: PagesLike,
           block_tables: Int[Array, "S P"], seq_lens: Int[Array, "S"], *, scale: float,
           window: int | None = None, kernel: str = "auto") -> Float[Array, "S Q D"]:
    """Decode attention by `decode_plan` (`kernel` forces Triton or Mosaic GPU)."""
    k, v = as_pages(k_pages), as_pages(v_pages)
    nseq, nq, d = q.shape
    h, _, block, _ = k.shape
    plan = decode_plan(nseq, nq, h, block, block_tables.shape[1], k.dtype,
                       k.scale is not None, d, kernel)
    if plan.kernel == "mosaic":  # pages stored as bits (on CPU) are viewed, a copy
        return mosaic_decode.mosaic_decode_attention(
            q, view(k.values, k.dtype), view(v.values, v.dtype), block_tables, seq_lens,
            scale=scale, window=window,
            num_splits=plan.num_splits, pages_per_step=plan.pages_per_step)
    return decode_attention(q, k_pages, v_pages, block_tables, seq_lens, variant=plan.variant,
                            num_splits=plan.num_splits, pages_per_step=plan.pages_per_step,
                            scale=scale, window=window)


def ragged_variant(block: int) -> str:
    """tl.dot needs block size >= 16."""
    return "dot" if block >= DOT_MIN else "grouped"


def paged_attention(
    q: Float[Array, "T Q D"],
    k_pages: PagesLike,
    v_pages: PagesLike,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    scale: float,
    window: int | None = None,
    decode_kernel: str = "auto",
) -> Float[Array, "T Q D"]:
    """Same contract as `paged_jax.models.attention.paged_attention` (backend "pallas");
    `decode_kernel` forces decode's kernel ("triton" | "mosaic")."""
    if max_q > 1:
        return ragged_paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, query_start,
            max_q=max_q, variant=ragged_variant(as_pages(k_pages).shape[2]), scale=scale,
            window=window,
        )
    t = q.shape[0]
    start = query_start[:-1]
    has_q = query_start[1:] > start
    out = decode(q[jnp.clip(start, 0, t - 1)], k_pages, v_pages, block_tables, seq_lens,
                 scale=scale, window=window, kernel=decode_kernel)
    # Sequences with no query this step (padding rows) write nothing.
    dest = jnp.where(has_q, start, t)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
