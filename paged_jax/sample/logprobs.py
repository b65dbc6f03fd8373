"""Logprobs of sampled tokens: each row's log_softmax at its token, its rank, and the top J.

    gather         every row of [S, V] at once (what a GPU runs)
    gather_active  on CPU, the rows sampled this step one at a time: a step with prefill holds
                   all max_num_seqs rows, few of them sampled, and XLA:CPU's passes over a
                   vocabulary cost per row
    top_k_blocks   jax.lax.top_k in two small top-k's (blocks' maxima, then their entries)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.types import Array, Bool, Float, Int


def gather(
    raw: Float[Array, "S V"], tokens: Int[Array, "S"], num_top: int
) -> tuple[Float[Array, "S"], Int[Array, "S"], Int[Array, "S J"], Float[Array, "S J"]]:
    """Each row's logprob at its token (log_softmax of the raw logits), the token's rank,
    and the top `num_top` ids and logprobs."""
    raw = raw.astype(jnp.float32)
    # log_softmax(raw)[token], rounded as log_softmax rounds, without an [S, V] result.
    mx = jax.lax.stop_gradient(raw.max(axis=1, keepdims=True))
    log_norm = jnp.log(jnp.exp(raw - mx).sum(axis=1, keepdims=True))
    picked = jnp.take_along_axis(raw, tokens[:, None], axis=1)
    chosen = ((picked - mx) - log_norm)[:, 0]
    ranks = (raw > picked).sum(axis=1).astype(jnp.int32) + 1
    if not num_top:
        s = raw.shape[0]
        return chosen, ranks, jnp.zeros((s, 0), jnp.int32), jnp.zeros((s, 0), jnp.float32)
    top_raw, top_ids = top_k_blocks(raw, num_top)
    return chosen, ranks, top_ids.astype(jnp.int32), (top_raw - mx) - log_norm


def top_k_blocks(x: Float[Array, "S V"], k: int, block: int = 128
                 ) -> tuple[Float[Array, "S K"], Int[Array, "S K"]]:
    """jax.lax.top_k(x, k) (ties to the lower index) in two small top-k's: the k blocks of
    `block` entries with the largest maxima hold the k largest entries, so the second runs on
    k * block candidates. Inside the engine's step on XLA:CPU, one row a loop trip
    (`gather_active`), a top-k over a whole row of Qwen's 152k vocabulary made a 0.5B request
    asking 20 logprobs 1.75x slower than one asking none; in blocks, 1.07x."""
    s, v = x.shape
    nb = -(-v // block)
    if nb <= k:
        return tuple(jax.lax.top_k(x, k))
    blocks = jnp.pad(x, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf).reshape(
        s, nb, block)
    _, chosen = jax.lax.top_k(blocks.max(axis=2), k)
    chosen = jnp.sort(chosen, axis=1)  # candidates in index order: ties keep the lower index
    cand = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(s, k * block)
    ids = (chosen[:, :, None] * block + jnp.arange(block)).reshape(s, k * block)
    vals, at = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(ids, at, axis=1)


def gather_active(
    logits: Float[Array, "S V"], tokens: Int[Array, "S"], num_top: int, active: Bool[Array, "S"]
) -> tuple[Float[Array, "S"], Int[Array, "S"], Int[Array, "S J"], Float[Array, "S J"]]:
    """`gather` of the active rows, one row a loop trip. A step with prefill holds
    all max_num_seqs rows, few of them sampled, and on XLA:CPU the vocabulary's passes cost
    per row (64 rows of a 152k vocabulary: 16 ms, 24 with the top 20; one row 0.3 / 0.5).
    bfloat16 rows are sliced as their bits: sliced as bfloat16, XLA:CPU converted the whole
    [S, V] array first (12 ms whatever the rows)."""
    s = logits.shape[0]
    bf16 = logits.dtype == jnp.bfloat16
    src = jax.lax.bitcast_convert_type(logits, jnp.uint16) if bf16 else logits
    rows = jnp.nonzero(active, size=s, fill_value=0)[0]
    init = (jnp.zeros((s,), jnp.float32), jnp.zeros((s,), jnp.int32),
            jnp.zeros((s, num_top), jnp.int32), jnp.zeros((s, num_top), jnp.float32))

    def one(i, acc):
        r = rows[i]
        row = jax.lax.dynamic_slice_in_dim(src, r, 1)
        row = jax.lax.bitcast_convert_type(row, jnp.bfloat16) if bf16 else row
        got = gather(row, tokens[r][None], num_top)
        return tuple(a.at[r].set(g[0]) for a, g in zip(acc, got, strict=True))

    return jax.lax.fori_loop(0, active.sum(), one, init)
