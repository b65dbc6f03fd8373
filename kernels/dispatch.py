# ruff: noqa: F821  (jaxtyping axis strings such as "S" read as undefined names)
"""The one door from the engine into kernels/: picks a kernel variant from static shapes.

    max_q == 1  -> decode kernel (kernels.paged_attention):
                   "split" (flash-decoding) when S * H programs cannot fill the GPU and the
                   context is long, else "dot" for wide groups (G >= 8), else "grouped"
    max_q  > 1  -> ragged kernel (kernels.ragged_paged_attention):
                   "dot" (tensor cores, prefill is compute-bound) when the block size allows,
                   else "grouped"

Interpret mode is chosen automatically off GPU (by the kernels themselves).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.paged_attention import DOT_MIN, decode_attention
from kernels.pages import PagesLike, as_pages
from kernels.ragged_paged_attention import ragged_paged_attention

TARGET_PROGRAMS = 256  # ~2 programs per SM on an H100/H200 (132 SMs)
MIN_PAGES_PER_SPLIT = 8


def decode_plan(nseq: int, nq: int, h: int, block: int, pages: int) -> tuple[str, int]:
    """(variant, num_splits) for a decode step; all arguments are static shapes."""
    programs = nseq * h
    splits = 1
    while programs * splits * 2 <= TARGET_PROGRAMS and pages // (splits * 2) >= MIN_PAGES_PER_SPLIT:
        splits *= 2
    if splits > 1:
        return "split", splits
    if nq // h >= 8 and block >= DOT_MIN:
        return "dot", 1
    return "grouped", 1


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
) -> Float[Array, "T Q D"]:
    """Same contract as `paged_jax.models.attention.paged_attention` (backend "pallas")."""
    if max_q > 1:
        return ragged_paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, query_start,
            max_q=max_q, variant=ragged_variant(as_pages(k_pages).shape[2]), scale=scale,
            window=window,
        )
    t, nq, _ = q.shape
    nseq, pages = block_tables.shape
    h, _, block, _ = as_pages(k_pages).shape
    variant, splits = decode_plan(nseq, nq, h, block, pages)
    start = query_start[:-1]
    has_q = query_start[1:] > start
    out = decode_attention(
        q[jnp.clip(start, 0, t - 1)], k_pages, v_pages, block_tables, seq_lens,
        variant=variant, num_splits=splits, scale=scale, window=window,
    )
    # Sequences with no query this step (padding rows) write nothing.
    dest = jnp.where(has_q, start, t)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
