"""jnp references for paged attention: the oracle every kernel is tested against, and the
library's portable backend ("reference" in paged_jax/models/attention.py).

Semantics (shared by every kernel in this folder): a step's queries are a ragged batch, a flat
run of T tokens in which sequence s owns ``q[query_start[s]:query_start[s+1]]``, the *last*
``num_q[s]`` tokens of its context of ``seq_lens[s]`` tokens (their K/V are already in the
cache). Query i of sequence s sits at position ``seq_lens[s] - num_q[s] + i`` and attends
causally to keys 0..that position. Tokens past ``query_start[S]`` are padding: zeros.

    ragged_reference        dense: every row padded to max_q, every row's P pages gathered
    tiled_reference         rows cut into tiles of QUERY_TILE queries (prefill chunks)
    flat_decode_reference   single-query rows over one flat list of their live pages
    split_reference         the two above on a batch sorted long rows first (the library's)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.pages import PagesLike, as_pages

Pages = PagesLike  # float pages, a (quantized values, scales) pair, or kernels.pages.Pages


def _shape(pages: Pages) -> tuple[int, ...]:
    return as_pages(pages).shape


def _take(pages: Pages, idx) -> Array:
    """pages[:, idx] in float32 ([H, *idx.shape, K, D]), dequantized if need be."""
    return as_pages(pages).take(idx)


def _cdiv(a, b):
    return -(-a // b)


# Long rows are cut into tiles of this many queries: padding a row costs at most one tile,
# where padding every prefill row to max_q cost up to (rows x max_q) queries.
QUERY_TILE = 16


def split_reference(q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q: int,
                    scale: float, max_q_rows: int | None, decode_pages: int | None,
                    window: int | None = None):
    """Reference on two row groups: long rows in query tiles, single-query rows on a flat
    list of their pages."""
    s, p = block_tables.shape
    rows = 0 if max_q == 1 else s if max_q_rows is None else min(max_q_rows, s)
    pages = (s - rows) * p if decode_pages is None else decode_pages
    out = None
    if rows:
        out = tiled_reference(q, k_pages, v_pages, block_tables[:rows], seq_lens[:rows],
                              query_start[: rows + 1], max_q=max_q, scale=scale,
                              window=window)
    if rows < s:
        tail = flat_decode_reference(q, k_pages, v_pages, block_tables[rows:], seq_lens[rows:],
                                     query_start[rows:], num_pages=pages, scale=scale,
                                     window=window)
        # Each output token belongs to exactly one group; the other group leaves it zero.
        out = tail if out is None else out + tail
    return out


def flat_decode_reference(
    q: Float[Array, "T Q D"],
    k_pages: Pages,
    v_pages: Pages,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    num_pages: int,
    scale: float,
    window: int | None = None,
) -> Float[Array, "T Q D"]:
    """Attention of rows with at most one query each, over one flat list of their live pages.

    Padding every row to the longest context makes a batch pay for its longest sequence S
    times; here the pages of all rows are laid end to end (row r owns ceil(seq_lens[r] / K)
    of them), gathered once, and the softmax is taken per row with segment reductions:

        flat page j:   0 1 2 | 3 4 | 5 6 7 8 | pad ...      (num_pages, a static bucket)
        row:           0 0 0 | 1 1 | 2 2 2 2 | S
        scores [j, H, G, K] -> row max (segment_max) -> exp -> row sums (segment_sum)

    Pages beyond `num_pages` would be silently dropped: the caller's bucket must cover the
    sum of every row's pages (the engine computes it from the live lengths).
    """
    t, nq, d = q.shape
    h, _, kb, _ = _shape(k_pages)
    s, p = block_tables.shape
    start = query_start[:-1]
    has_q = query_start[1:] > start
    lens = jnp.where(has_q, seq_lens, 0)
    held = _cdiv(lens, kb)
    ends = jnp.cumsum(held)
    j = jnp.arange(num_pages)
    row = jnp.searchsorted(ends, j, side="right")  # [NP]; S marks a padding page
    r = jnp.minimum(row, s - 1)
    idx = j - (ends - held)[r]
    page = jnp.where(row < s, block_tables[r, jnp.clip(idx, 0, p - 1)], 0)
    kpos = idx[:, None] * kb + jnp.arange(kb)
    valid = (row < s)[:, None] & (kpos < lens[r][:, None])
    if window is not None:  # the query sits at lens - 1 and sees its last `window` keys
        valid &= kpos >= lens[r][:, None] - window
    qr = q[jnp.clip(start, 0, t - 1)].reshape(s, h, nq // h, d)
    keys = _take(k_pages, page)  # [H, NP, K, D]
    scores = jnp.einsum("phgd,hpkd->phgk", qr[r].astype(jnp.float32), keys) * scale
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    mx = jax.ops.segment_max(scores.max(-1), row, num_segments=s + 1)  # [S + 1, H, G]
    w = jnp.where(valid[:, None, None, :], jnp.exp(scores - mx[row][..., None]), 0.0)
    total = jax.ops.segment_sum(w.sum(-1), row, num_segments=s + 1)[:s]
    # 0 * NaN is NaN: key positions past a row's end (stale or freed blocks) are zeroed, not
    # weighted.
    vals = jnp.where(valid[None, :, :, None], _take(v_pages, page), 0.0)
    out = jax.ops.segment_sum(jnp.einsum("phgk,hpkd->phgd", w, vals), row, num_segments=s + 1)
    out = (out[:s] / jnp.maximum(total, 1e-30)[..., None]).reshape(s, nq, d)
    dest = jnp.where(has_q, start, t)
    return jnp.zeros((t, nq, d), q.dtype).at[dest].set(out.astype(q.dtype), mode="drop")


def tiled_reference(
    q: Float[Array, "T Q D"],
    k_pages: Pages,
    v_pages: Pages,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    scale: float,
    window: int | None = None,
) -> Float[Array, "T Q D"]:
    """`ragged_reference` computed over tiles of QUERY_TILE queries, each inside one row.

    Row s needs ceil(num_q[s] / tile) tiles; a static number of tiles covers any batch: one per
    tile of the T tokens plus one partial tile per row, and never more than S x max_q needs.
    """
    t = q.shape[0]
    s = block_tables.shape[0]
    tile = min(max_q, QUERY_TILE)
    num_tiles = min(s * _cdiv(max_q, tile), _cdiv(t, tile) + s)
    num_q = query_start[1:] - query_start[:-1]
    per_row = (num_q + tile - 1) // tile
    ends = jnp.cumsum(per_row)
    j = jnp.arange(num_tiles)
    row = jnp.minimum(jnp.searchsorted(ends, j, side="right"), s - 1)  # [NT] row of each tile
    qi = (j - (ends - per_row)[row])[:, None] * tile + jnp.arange(tile)[None, :]  # [NT, tile]
    valid = (j < ends[-1])[:, None] & (qi < num_q[row][:, None])
    return _attend(q, k_pages, v_pages, block_tables[row], seq_lens[row],
                   tok=query_start[row][:, None] + qi,
                   qpos=(seq_lens - num_q)[row][:, None] + qi, valid=valid, scale=scale,
                   window=window)


def ragged_reference(
    q: Float[Array, "T Q D"],
    k_pages: Pages,
    v_pages: Pages,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    scale: float,
    window: int | None = None,
) -> Float[Array, "T Q D"]:
    """Dense jnp reference: gather each sequence's pages, mask exactly, softmax in fp32.

    `window`: sliding-window attention: a query at position i sees keys i - window + 1 .. i
    (Hugging Face's and llama.cpp's convention); None = every earlier key."""
    num_q = query_start[1:] - query_start[:-1]
    i = jnp.arange(max_q)[None, :]
    return _attend(q, k_pages, v_pages, block_tables, seq_lens,
                   tok=query_start[:-1, None] + i, qpos=(seq_lens - num_q)[:, None] + i,
                   valid=i < num_q[:, None], scale=scale, window=window)


def _attend(
    q: Float[Array, "T Q D"],
    k_pages: Pages,
    v_pages: Pages,
    tables: Int[Array, "R P"],
    kv_lens: Int[Array, "R"],
    *,
    tok: Int[Array, "R M"],
    qpos: Int[Array, "R M"],
    valid: Bool[Array, "R M"],
    scale: float,
    window: int | None = None,
) -> Float[Array, "T Q D"]:
    """Attention of query groups: group r holds the M queries at flat token indices tok[r]
    (positions qpos[r]) and attends to the first kv_lens[r] keys of the pages tables[r]."""
    t, nq, d = q.shape
    h = _shape(k_pages)[0]
    r, m = tok.shape
    qg = q[jnp.clip(tok, 0, t - 1)].reshape(r, m, h, nq // h, d)

    def gather(pages: Pages) -> Float[Array, "R X H D"]:
        x = _take(pages, tables)  # [H, R, P, K, D]
        return jnp.moveaxis(x.reshape(h, r, -1, d), 0, 2)

    keys, vals = gather(k_pages), gather(v_pages)
    scores = jnp.einsum(
        "rqhgd,rkhd->rhgqk", qg.astype(jnp.float32), keys.astype(jnp.float32)
    ) * scale
    kpos = jnp.arange(keys.shape[1])
    causal = kpos[None, None, :] <= qpos[:, :, None]
    mask = causal & (kpos[None, None, :] < kv_lens[:, None, None]) & valid[:, :, None]
    if window is not None:
        mask &= kpos[None, None, :] > qpos[:, :, None] - window
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
