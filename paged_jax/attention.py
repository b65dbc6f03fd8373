"""The one paged-attention entry point the model calls.

A step's queries are a ragged batch: a flat run of T tokens in which sequence s owns
``q[query_start[s]:query_start[s+1]]``, the *last* ``num_q[s]`` tokens of its context of
``seq_lens[s]`` tokens (their K/V are already written to the cache). Query i of sequence s sits
at position ``seq_lens[s] - num_q[s] + i`` and attends causally to keys 0..that position.
Tokens past ``query_start[S]`` are padding and get zeros.

    decode:         num_q = 1 for every sequence                    (max_q = 1)
    chunked prefill: num_q = chunk, seq_lens = cached + chunk      (max_q = chunk bucket)

Backends: "reference" (pure jnp, any platform) and "pallas" (kernels/, Triton on GPU,
interpret mode elsewhere). `default_backend()` picks by platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.types import Array, Bool, Float, Int

BACKENDS = ("reference", "pallas")


def default_backend() -> str:
    """"pallas" on GPU, "reference" elsewhere (interpret mode is for testing, not speed)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def paged_attention(
    q: Float[Array, "T Q D"],
    k_pages: Float[Array, "H N K D"],
    v_pages: Float[Array, "H N K D"],
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    backend: str = "reference",
    scale: float | None = None,
    max_q_rows: int | None = None,
) -> Float[Array, "T Q D"]:
    """Causal attention of a ragged batch of queries over the paged KV cache.

    Args:
      q: [T, Q, D] queries, Q = H * G (grouped-query attention: query head j uses KV head j // G).
      k_pages, v_pages: [H, N, K, D] one layer of the cache.
      block_tables: [S, P] physical block of each logical block; padding entries are 0.
      seq_lens: [S] context length per sequence including this step's tokens (0 = padding).
      query_start: [S + 1] offsets of each sequence's queries in q (cumulative, nondecreasing).
      max_q: static bound on any sequence's query count (1 for decode).
      backend: "reference" or "pallas".
      scale: softmax scale; default 1/sqrt(D).
      max_q_rows: static hint: only the first `max_q_rows` sequences may have more than one
        query (prefill chunks first, decodes after). The reference then pads only those rows
        to max_q; the Pallas kernels are ragged and ignore it. None: any row may.

    Returns:
      [T, Q, D] attention output, zeros for padding tokens.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "reference":
        return _split_reference(
            q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q, scale, max_q_rows
        )
    if backend == "pallas":
        from kernels import dispatch  # kernels import paged_jax, not the other way at import time

        return dispatch.paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q=max_q, scale=scale
        )
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


# Long rows are cut into tiles of this many queries: padding a row costs at most one tile,
# where padding every prefill row to max_q cost up to (rows x max_q) queries.
QUERY_TILE = 16


def _split_reference(q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q, scale,
                     max_q_rows):
    """Reference on two row groups: long rows in query tiles, the rest one query per row."""
    s = block_tables.shape[0]
    if max_q == 1:
        return ragged_reference(q, k_pages, v_pages, block_tables, seq_lens, query_start,
                                max_q=1, scale=scale)
    rows = s if max_q_rows is None else min(max_q_rows, s)
    out = tiled_reference(q, k_pages, v_pages, block_tables[:rows], seq_lens[:rows],
                          query_start[: rows + 1], max_q=max_q, scale=scale)
    if rows == s:
        return out
    tail = ragged_reference(q, k_pages, v_pages, block_tables[rows:], seq_lens[rows:],
                            query_start[rows:], max_q=1, scale=scale)
    # Each output token belongs to exactly one group; the other group leaves it zero.
    return out + tail


def tiled_reference(
    q: Float[Array, "T Q D"],
    k_pages: Float[Array, "H N K D"],
    v_pages: Float[Array, "H N K D"],
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    scale: float,
) -> Float[Array, "T Q D"]:
    """`ragged_reference` computed over tiles of QUERY_TILE queries, each inside one row.

    Row s needs ceil(num_q[s] / tile) tiles; a static number of tiles covers any batch: one per
    tile of the T tokens plus one partial tile per row, and never more than S x max_q needs.
    """
    t = q.shape[0]
    s = block_tables.shape[0]
    tile = min(max_q, QUERY_TILE)
    num_tiles = min(s * -(-max_q // tile), -(-t // tile) + s)
    num_q = query_start[1:] - query_start[:-1]
    per_row = (num_q + tile - 1) // tile
    ends = jnp.cumsum(per_row)
    j = jnp.arange(num_tiles)
    row = jnp.minimum(jnp.searchsorted(ends, j, side="right"), s - 1)  # [NT] row of each tile
    qi = (j - (ends - per_row)[row])[:, None] * tile + jnp.arange(tile)[None, :]  # [NT, tile]
    valid = (j < ends[-1])[:, None] & (qi < num_q[row][:, None])
    return _attend(q, k_pages, v_pages, block_tables[row], seq_lens[row],
                   tok=query_start[row][:, None] + qi,
                   qpos=(seq_lens - num_q)[row][:, None] + qi, valid=valid, scale=scale)


def ragged_reference(
    q: Float[Array, "T Q D"],
    k_pages: Float[Array, "H N K D"],
    v_pages: Float[Array, "H N K D"],
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    scale: float,
) -> Float[Array, "T Q D"]:
    """Dense jnp reference: gather each sequence's pages, mask exactly, softmax in fp32."""
    num_q = query_start[1:] - query_start[:-1]
    i = jnp.arange(max_q)[None, :]
    return _attend(q, k_pages, v_pages, block_tables, seq_lens,
                   tok=query_start[:-1, None] + i, qpos=(seq_lens - num_q)[:, None] + i,
                   valid=i < num_q[:, None], scale=scale)


def _attend(
    q: Float[Array, "T Q D"],
    k_pages: Float[Array, "H N K D"],
    v_pages: Float[Array, "H N K D"],
    tables: Int[Array, "R P"],
    kv_lens: Int[Array, "R"],
    *,
    tok: Int[Array, "R M"],
    qpos: Int[Array, "R M"],
    valid: Bool[Array, "R M"],
    scale: float,
) -> Float[Array, "T Q D"]:
    """Attention of query groups: group r holds the M queries at flat token indices tok[r]
    (positions qpos[r]) and attends to the first kv_lens[r] keys of the pages tables[r]."""
    t, nq, d = q.shape
    h = k_pages.shape[0]
    r, m = tok.shape
    qg = q[jnp.clip(tok, 0, t - 1)].reshape(r, m, h, nq // h, d)

    def gather(pages: Float[Array, "H N K D"]) -> Float[Array, "R X H D"]:
        x = pages[:, tables]  # [H, R, P, K, D]
        return jnp.moveaxis(x.reshape(h, r, -1, d), 0, 2)

    keys, vals = gather(k_pages), gather(v_pages)
    scores = jnp.einsum(
        "rqhgd,rkhd->rhgqk", qg.astype(jnp.float32), keys.astype(jnp.float32)
    ) * scale
    kpos = jnp.arange(keys.shape[1])
    causal = kpos[None, None, :] <= qpos[:, :, None]
    mask = causal & (kpos[None, None, :] < kv_lens[:, None, None]) & valid[:, :, None]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    mx = jnp.max(scores, axis=-1, keepdims=True)
    w = jnp.exp(scores - jnp.where(jnp.isfinite(mx), mx, 0.0))
    w = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)
    # 0 * NaN is NaN: values past each sequence's end (stale or freed blocks) are zeroed too.
    in_seq = kpos[None, :] < kv_lens[:, None]
    vals = jnp.where(in_seq[:, :, None, None], vals.astype(jnp.float32), 0.0)
    out = jnp.einsum("rhgqk,rkhd->rqhgd", w, vals).reshape(r, m, nq, d)
    dest = jnp.where(valid, tok, t)  # invalid queries dropped
    res = jnp.zeros((t, nq, d), jnp.float32).at[dest].set(out, mode="drop")
    return res.astype(q.dtype)
