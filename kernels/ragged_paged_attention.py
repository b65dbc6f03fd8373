# ruff: noqa: F821  (jaxtyping axis strings such as "S" read as undefined names)
"""Ragged paged attention: chunked prefill and decode of a mixed batch in one Pallas kernel.

Sequence s brings num_q[s] = query_start[s+1] - query_start[s] new tokens, the *last* num_q[s] of
its seq_lens[s]-token context (their K/V already written). Query i sits at position
seq_lens[s] - num_q[s] + i and sees keys 0..that position (causal inside the chunk, everything
cached before it). Semantics are exactly `kernels.reference.ragged_reference`.

    grid (S, H, ceil(max_q / BQ)): one program = BQ query tokens of one sequence x the Gp padded
    query heads of one KV head, as BQ * Gp rows of one tile, so a page of K/V is loaded once for
    all G heads and all BQ tokens.

       seq s:  [ cached context ............ | chunk: q0 q1 q2 ... ]  keys walked page by page,
                                                                        stopping after the last
                                                                        key the block can see

  variant   | trade-off
  ----------|---------------------------------------------------------------------------------
  grouped   | elementwise q*k / p*v: any block size, least padding; CUDA cores, and the [R, K, D]
            | product caps a tile at R = 16 rows, so KV pages are re-read per 16/Gp tokens
  dot       | tl.dot on tensor cores: needs R = BQ*Gp >= 16 and block size >= 16; the right choice
            | for long prefill chunks where attention is compute-bound

The flat token axis is repacked to [S, H, MQ, Gp, D] around the kernel (a gather before, a
scatter after), so every program reads and writes its own tile through plain BlockSpecs: no
masked stores, no two programs writing the same row. Masking is exact as in the decode kernel:
-inf scores for invisible keys, zeroed V rows past each sequence's end.

Run `python -m kernels.ragged_paged_attention` to validate and time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from kernels.paged_attention import ANY, DOT_MIN, compiler_params, next_pow2, time_fn, use_interpret
from kernels.pages import PagesLike
from kernels.tiles import (
    DType,
    compute_dtype,
    init_state,
    load_page,
    normalize,
    online_update,
    page_operands,
    qk,
    split_refs,
)

VARIANTS = ("grouped", "dot")


def _ragged_kernel(
    q_ref, k_ref, v_ref, *refs, scale: float, use_dot: bool, kv_dtype: DType, quantized: bool,
    window: int | None,
) -> None:
    ks_ref, vs_ref, (bt_ref, len_ref, nq_ref, o_ref) = split_refs(refs, quantized)
    s, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, gp, d = q_ref.shape
    block = k_ref.shape[2]
    dt = compute_dtype(kv_dtype, q_ref.dtype, use_dot)
    q = (q_ref[...].astype(jnp.float32) * scale).reshape(bq * gp, d).astype(dt)
    length, nq = len_ref[s], nq_ref[s]
    qi = qb * bq + jnp.arange(bq * gp) // gp  # query index inside the chunk, per row
    qpos = length - nq + qi
    row_ok = qi < nq
    # Keys past the block's last visible position are never needed.
    last = length - nq + jnp.minimum(qb * bq + bq, nq)
    n = jnp.maximum(pl.cdiv(last, block), 0)
    lo = 0  # pages before the tile's first query's window are skipped
    if window is not None:
        lo = jnp.clip((length - nq + qb * bq - window + 1) // block, 0, n)

    def body(i, state):
        page = bt_ref[s, i]
        kpos = i * block + jnp.arange(block)
        k = load_page(k_ref, h, page, kpos < length, dt, kv_dtype, ks_ref)
        v = load_page(v_ref, h, page, kpos < length, dt, kv_dtype, vs_ref)
        see = (kpos[None, :] <= qpos[:, None]) & row_ok[:, None]
        if window is not None:
            see &= kpos[None, :] > qpos[:, None] - window
        scores = jnp.where(see, qk(q, k, use_dot), -jnp.inf)
        return online_update(state, scores, v, use_dot)

    o, _, den = jax.lax.fori_loop(lo, n, body, init_state(bq * gp, d))
    o_ref[...] = normalize(o, den).reshape(bq, gp, d).astype(o_ref.dtype)


def pick_block_q(max_q: int, gp: int, use_dot: bool) -> int:
    """Query tokens per program.

    grouped: at most 16 rows (BQ * Gp), its [rows, K, D] product lives in registers;
    dot: up to 16 tokens, and at least 16 rows, tl.dot's floor.
    """
    if use_dot:
        return max(min(next_pow2(max_q), 16), next_pow2(-(-DOT_MIN // gp)))
    return min(next_pow2(max_q), max(1, 16 // gp))


def _pack_queries(
    q: Float[Array, "T Q D"], query_start: Int[Array, "S1"], h: int, gp: int, mq: int
) -> tuple[Float[Array, "S H X G D"], Int[Array, "S X"], Array]:
    # S1 = S + 1: jaxtyping cannot write "S+1" before S is bound by another argument.
    """Flat ragged queries -> [S, H, MQ, Gp, D] zero-padded tiles, plus each row's token index."""
    t, nq, d = q.shape
    g = nq // h
    nseq = query_start.shape[0] - 1
    num_q = query_start[1:] - query_start[:-1]
    i = jnp.arange(mq)
    tok = query_start[:-1, None] + i[None, :]
    valid = i[None, :] < num_q[:, None]
    x = jnp.where(valid[:, :, None, None], q[jnp.clip(tok, 0, t - 1)], 0)
    x = jnp.pad(x.reshape(nseq, mq, h, g, d), ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))
    return jnp.moveaxis(x, 2, 1), tok, valid


@functools.partial(
    jax.jit, static_argnames=("max_q", "variant", "scale", "interpret", "num_warps", "window")
)
def ragged_paged_attention(
    q: Float[Array, "T Q D"],
    k_pages: PagesLike,
    v_pages: PagesLike,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    variant: str = "grouped",
    scale: float | None = None,
    interpret: bool | None = None,
    num_warps: int = 4,
    window: int | None = None,
) -> Float[Array, "T Q D"]:
    """Causal attention of a ragged batch over the paged cache (see paged_jax.models.attention).

    Args: as `paged_jax.models.attention.paged_attention` (`window` included), plus `variant`
    ("grouped" | "dot").

    Returns:
      [T, Q, D] output in q's dtype, zeros for padding tokens.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown ragged variant {variant!r}; expected one of {VARIANTS}")
    t, nq, d = q.shape
    kv_ops, kv_dtype, quantized = page_operands(k_pages, v_pages)
    h, _, block, _ = kv_ops[0].shape
    g = nq // h
    use_dot = variant == "dot"
    if use_dot and block < DOT_MIN:
        raise ValueError(f"variant 'dot' needs block size >= {DOT_MIN}, got {block}")
    gp = next_pow2(g)
    bq = pick_block_q(max_q, gp, use_dot)
    mq = -(-max_q // bq) * bq
    nseq = block_tables.shape[0]
    qp, tok, valid = _pack_queries(q, query_start, h, gp, mq)
    num_q = (query_start[1:] - query_start[:-1]).astype(jnp.int32)
    scale = d**-0.5 if scale is None else scale
    interpret = use_interpret() if interpret is None else interpret
    any_spec = pl.BlockSpec(memory_space=ANY)
    tile = pl.BlockSpec((None, None, bq, gp, d), lambda s, i, b: (s, i, b, 0, 0))
    out = pl.pallas_call(
        functools.partial(_ragged_kernel, scale=scale, use_dot=use_dot, kv_dtype=kv_dtype,
                          quantized=quantized, window=window),
        grid=(nseq, h, mq // bq),
        in_specs=[tile] + [any_spec] * (len(kv_ops) + 3),
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        interpret=interpret,
        compiler_params=compiler_params(num_warps=num_warps),
        name=f"ragged_paged_attention_{variant}",
    )(qp, *kv_ops, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), num_q)
    out = jnp.moveaxis(out, 1, 2)[:, :, :, :g].reshape(nseq, mq, nq, d)
    dest = jnp.where(valid, tok, t)  # rows of padding queries are dropped
    return jnp.zeros((t, nq, d), q.dtype).at[dest].set(out, mode="drop")


def ragged_reference(*args, max_q: int, scale: float | None = None) -> Array:
    """The jnp reference (kernels/reference.py) with the default scale."""
    from kernels.reference import ragged_reference as ref

    d = args[0].shape[-1]
    return ref(*args, max_q=max_q, scale=d**-0.5 if scale is None else scale)


def random_ragged_inputs(
    key: Array, nseq: int, nq: int, h: int, d: int, block: int, pages: int, max_q: int,
    dtype: DType, pad_tokens: int = 3,
) -> tuple[Array, ...]:
    """A mixed batch: random contexts, random chunk sizes 0..max_q, NaN in every free block."""
    from kernels.paged_attention import random_decode_inputs

    k1, k2, k3 = jax.random.split(key, 3)
    _, kc, vc, tables, lens = random_decode_inputs(k1, nseq, nq, h, d, block, pages, dtype)
    num_q = jnp.minimum(jax.random.randint(k2, (nseq,), 0, max_q + 1), lens)
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_q)]).astype(jnp.int32)
    t = nseq * max_q + pad_tokens
    q = jax.random.normal(k3, (t, nq, d), dtype)
    return q, kc, vc, tables, lens, query_start


def main() -> None:
    """Validate both variants (mixed prefill chunks + decodes) against the reference, time them."""
    from kernels.paged_attention import kv_bytes

    on_gpu = not use_interpret()
    key = jax.random.PRNGKey(0)
    print(f"backend={jax.default_backend()} interpret={not on_gpu}")
    print(f"{'variant':8} {'dtype':9} {'K':>3} {'D':>4} {'heads':>6} {'max_q':>5} "
          f"{'max_err':>9} {'ms':>9} {'GB/s':>8}")
    nseq, pages = (32, 64) if on_gpu else (4, 6)
    for dtype in (jnp.float32, jnp.bfloat16):
        for d, (nq, h) in ((64, (9, 3)), (128, (32, 8))):
            for block in (8, 16, 32):
                for max_q in (1, 16):
                    args = random_ragged_inputs(key, nseq, nq, h, d, block, pages, max_q, dtype)
                    ref = ragged_reference(*args, max_q=max_q)
                    for variant in VARIANTS:
                        if variant == "dot" and block < DOT_MIN:
                            continue
                        fn = functools.partial(
                            ragged_paged_attention, max_q=max_q, variant=variant
                        )
                        out = fn(*args)
                        err = float(jnp.max(jnp.abs(
                            out.astype(jnp.float32) - ref.astype(jnp.float32))))
                        tol = 1e-4 if dtype == jnp.float32 else 3e-2
                        assert bool(jnp.all(jnp.isfinite(out))), (variant, dtype, block, d)
                        assert err < tol, (variant, dtype, block, d, max_q, err)
                        sec = time_fn(fn, *args)
                        gbs = kv_bytes(args[4], h, d, dtype) / sec / 1e9
                        print(f"{variant:8} {jnp.dtype(dtype).name:9} {block:3d} {d:4d} "
                              f"{nq:2d}/{h:<3d} {max_q:5d} {err:9.2e} {sec * 1e3:9.3f} "
                              f"{gbs:8.3f}")
    print("all ragged variants match the reference")


if __name__ == "__main__":
    main()
