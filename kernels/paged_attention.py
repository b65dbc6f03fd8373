# ruff: noqa: F821  (jaxtyping axis strings such as "S" read as undefined names)
"""Decode paged attention (one query token per sequence), a kernel lab in Pallas (Triton).

Every variant: grid (S, H[, splits]); one program owns one sequence x one KV head and the G query
heads that share it (grouped-query attention), so each KV page is read from HBM once per KV head,
not once per query head. Pages are looked up in the block table *inside* the kernel; the whole KV
pool is passed untiled (memory_space=ANY) so no per-head copy of the pool is ever made. Softmax is
online (flash style) in fp32; the scale is applied to q once.

Triton needs power-of-2 tiles, so the G query heads of a KV head are padded to Gp = next_pow2(G)
rows (SmolLM2: G=3 -> 4, 25% waste, not 16 -> 81% waste as with a tl.dot-friendly pad).

  variant   | what                                   | trade-off
  ----------|----------------------------------------|------------------------------------------
  grouped   | Gp rows, q*k and p*v as elementwise     | no tl.dot size floor (works for block 8,
            | multiply + sum, one page per step       | Gp 1..): least padding; CUDA cores only,
            |                                         | fine while decode is HBM-bound (it is)
  dot       | rows padded to >= 16, tl.dot            | tensor cores, but G=3 pays 16 rows and
            | (needs block size >= 16)                | block 8 is refused; wins only for G >= 8
  split     | grouped + flash-decoding: pages split   | fills the GPU when S*H is small and the
            | over a 3rd grid axis, partial (o, m, l) | context is long; costs a second small
            | combined by a jnp log-sum-exp reduction | reduction and fp32 partials in HBM
  split_dot | dot + flash-decoding                    | the two above together

Every variant can gather `pages_per_step` pages per loop step (float pages): one page of 16
tokens is 2-4 KiB, too little in flight per program to approach HBM bandwidth.

Masking is exact: a key past seq_len gets score -inf (where, not a multiply) and its V row is
replaced by 0 before p @ v, so a stale or NaN block (freed, or the zero block behind padding
entries) never reaches the output: 0 * NaN would be NaN.

Run `python -m kernels.paged_attention` to validate every variant at every block size / head dim /
dtype against the jnp reference and time them (interpret mode off GPU).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

try:  # deprecated in JAX 0.11 and slated for removal: kernels/mosaic_decode.py is the successor
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a JAX without it
    plgpu = None

from kernels.pages import PagesLike
from kernels.tiles import (
    DType,
    compute_dtype,
    init_state,
    load_page,
    load_pages,
    normalize,
    online_update,
    page_operands,
    qk,
    split_refs,
)

VARIANTS = ("grouped", "dot", "split", "split_dot")
DOT_MIN = 16  # tl.dot wants every dimension >= 16
# The whole KV pool stays in HBM, untiled; kernels index pages through the block table.
ANY = getattr(pl, "ANY", None) or pl.MemorySpace.ANY


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= n (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def use_interpret() -> bool:
    """Interpret mode everywhere but on a GPU (Triton only compiles for CUDA/ROCm)."""
    return jax.default_backend() != "gpu"


TRITON = plgpu is not None  # whether this JAX still has Pallas' Triton backend
TILE_BYTES = 32 << 10  # the most bytes of one K (or V) tile a loop step gathers


def max_pages_per_step(block: int, head_dim: int, dtype) -> int:
    """Pages one loop step may gather so that its K and V tiles fit shared memory (four pages
    of float32 at D = 256 asked for 272 KiB of an H200's 227)."""
    return max(1, TILE_BYTES // (block * head_dim * jnp.dtype(dtype).itemsize))


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> Any:
    """Triton params; passing them is also what selects Triton rather than Mosaic GPU."""
    if plgpu is None:
        raise RuntimeError(f"JAX {jax.__version__} has no Pallas Triton backend; decode runs "
                           "on kernels/mosaic_decode.py (bfloat16 / float16 pages)")
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- decode kernel
def _decode_kernel(
    q_ref, k_ref, v_ref, *refs,
    scale: float, pages_per_split: int, use_dot: bool, split: bool, kv_dtype: DType,
    quantized: bool, window: int | None, pages_per_step: int = 1,
) -> None:
    ks_ref, vs_ref, (bt_ref, len_ref, *out_refs) = split_refs(refs, quantized)
    s, h, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block = k_ref.shape[2]
    dt = compute_dtype(kv_dtype, q_ref.dtype, use_dot)
    q = (q_ref[...].astype(jnp.float32) * scale).astype(dt)  # [Gp, D]
    length = len_ref[s]
    first = part * pages_per_split
    n = jnp.clip(pl.cdiv(length, block) - first, 0, pages_per_split)
    lo = 0  # first key the query sees: pages before it are skipped, not masked
    if window is not None:
        lo = jnp.maximum(length - window, 0)
    c = pages_per_step

    def body(j, state):
        i = first + j * c  # this step's first page
        kpos = i * block + jnp.arange(c * block)
        valid = (kpos < length) & (kpos >= lo)
        if c == 1:
            page = bt_ref[s, i]
            k = load_page(k_ref, h, page, valid, dt, kv_dtype, ks_ref)
            v = load_page(v_ref, h, page, valid, dt, kv_dtype, vs_ref)
        else:  # c pages in one gather: more bytes in flight per program
            pages = bt_ref[s, pl.ds(i, c)]
            k = load_pages(k_ref, h, pages, valid, dt, kv_dtype)
            v = load_pages(v_ref, h, pages, valid, dt, kv_dtype)
        scores = jnp.where(valid[None, :], qk(q, k, use_dot), -jnp.inf)
        return online_update(state, scores, v, use_dot)

    start = jnp.clip(lo // block - first, 0, n) // c
    o, m, den = jax.lax.fori_loop(start, pl.cdiv(n, c), body, init_state(*q.shape))
    if split:
        o_ref, m_ref, den_ref = out_refs
        o_ref[...], m_ref[...], den_ref[...] = o, m, den
    else:
        out_refs[0][...] = normalize(o, den).astype(out_refs[0].dtype)


def combine_splits(
    o: Float[Array, "S H X G D"], m: Float[Array, "S H X G"], den: Float[Array, "S H X G"]
) -> Float[Array, "S H G D"]:
    """Second pass of flash-decoding: log-sum-exp merge of the per-split partial results."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all))  # 0 for empty splits
    num = jnp.sum(o * w[..., None], axis=2)
    den = jnp.sum(den * w, axis=2)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _check_variant(variant: str, block: int, quantized: bool, pages_per_step: int
                   ) -> tuple[bool, bool]:
    """(uses tl.dot, splits) of a decode variant, or a ValueError naming what does not fit."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown decode variant {variant!r}; expected one of {VARIANTS}")
    use_dot = variant in ("dot", "split_dot")
    if use_dot and block < DOT_MIN:
        raise ValueError(f"variant {variant!r} needs block size >= {DOT_MIN}, got {block}")
    if pages_per_step > 1 and quantized:
        raise ValueError("pages_per_step > 1 takes float pages; int8 / fp8 pages load one "
                         "page a step")
    return use_dot, variant.startswith("split")


def _decode_outputs(nseq: int, h: int, splits: int, gp: int, d: int, dtype) -> tuple[list, list]:
    """Output specs and shapes of the decode kernel: one [gp, d] block per (sequence, head),
    or with `splits` > 0 the per-split partial output, running max and denominator (fp32)."""
    if not splits:
        return ([pl.BlockSpec((None, None, gp, d), lambda s, i, x: (s, i, 0, 0))],
                [jax.ShapeDtypeStruct((nseq, h, gp, d), dtype)])
    o_spec = pl.BlockSpec((None, None, None, gp, d), lambda s, i, x: (s, i, x, 0, 0))
    st_spec = pl.BlockSpec((None, None, None, gp), lambda s, i, x: (s, i, x, 0))
    return ([o_spec, st_spec, st_spec], [
        jax.ShapeDtypeStruct((nseq, h, splits, gp, d), jnp.float32),
        jax.ShapeDtypeStruct((nseq, h, splits, gp), jnp.float32),
        jax.ShapeDtypeStruct((nseq, h, splits, gp), jnp.float32),
    ])


@functools.partial(
    jax.jit,
    static_argnames=("variant", "scale", "num_splits", "interpret", "num_warps", "window",
                     "pages_per_step"),
)
def decode_attention(
    q: Float[Array, "S Q D"],
    k_pages: PagesLike,
    v_pages: PagesLike,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    *,
    variant: str = "grouped", scale: float | None = None, num_splits: int = 1,
    interpret: bool | None = None, num_warps: int = 4, window: int | None = None,
    pages_per_step: int = 1,
) -> Float[Array, "S Q D"]:
    """One query token per sequence attending to its first seq_lens[s] cached tokens.

    Args:
      q: [S, Q, D] the query of each sequence (its position is seq_lens[s] - 1).
      k_pages, v_pages: one layer's pages: float, or int8 / fp8 with scales (pages.py).
      block_tables: [S, P] physical block per logical block (padding -> zero block 0).
      seq_lens: [S] context lengths including the query token; 0 = padding (output 0).
      variant: "grouped" | "dot" | "split" | "split_dot" (module docstring).
      num_splits: pages partitions for the split variants (P is padded to a multiple).
      window: the query sees only its last `window` keys (None: all).
      pages_per_step: pages a loop step gathers (float pages): more bytes in flight.

    Returns: [S, Q, D] attention output in q's dtype.
    """
    nseq, nq, d = q.shape  # the pool's pages are indexed inside the kernel: ANY, untiled
    kv_ops, kv_dtype, quantized = page_operands(k_pages, v_pages)
    h, _, block, _ = kv_ops[0].shape
    g = nq // h
    use_dot, split = _check_variant(variant, block, quantized, pages_per_step)  # or raises
    gp = max(next_pow2(g), DOT_MIN) if use_dot else next_pow2(g)
    splits = num_splits if split else 1
    p = block_tables.shape[1]
    pps = -(-p // (splits * pages_per_step)) * pages_per_step
    # Padding entries read the zero block; they are masked by length anyway.
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pps * splits - p)))
    qg = jnp.pad(q.reshape(nseq, h, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    scale = d**-0.5 if scale is None else scale
    interpret = use_interpret() if interpret is None else interpret
    out_specs, out_shape = _decode_outputs(nseq, h, splits if split else 0, gp, d, q.dtype)
    kernel = functools.partial(
        _decode_kernel, scale=scale, pages_per_split=pps, use_dot=use_dot, split=split,
        kv_dtype=kv_dtype, quantized=quantized, window=window, pages_per_step=pages_per_step,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(nseq, h, splits),
        in_specs=[pl.BlockSpec((None, None, gp, d), lambda s, i, x: (s, i, 0, 0))]
        + [pl.BlockSpec(memory_space=ANY)] * (len(kv_ops) + 2),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params(num_warps=num_warps),
        name=f"paged_decode_{variant}",
    )(qg, *kv_ops, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32))
    o = combine_splits(*outs) if split else outs[0]
    return o[:, :, :g].reshape(nseq, nq, d).astype(q.dtype)  # the padded heads dropped


# ----------------------------------------------------------------------------- reference
def decode_reference(
    q: Float[Array, "S Q D"],
    k_pages: PagesLike,
    v_pages: PagesLike,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    *,
    scale: float | None = None,
) -> Float[Array, "S Q D"]:
    """The ragged reference with one query per sequence."""
    from kernels.reference import ragged_reference

    nseq, _, d = q.shape
    query_start = jnp.arange(nseq + 1, dtype=jnp.int32)
    scale = d**-0.5 if scale is None else scale
    return ragged_reference(
        q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q=1, scale=scale
    )


def random_decode_inputs(
    key: Array, nseq: int, nq: int, h: int, d: int, block: int, pages: int, dtype: DType,
    nan_free: bool = True,
) -> tuple[Array, ...]:
    """Random q/K/V, shuffled block tables, random lengths; free blocks NaN if nan_free."""
    kq, kk, kv, kp, kl = jax.random.split(key, 5)
    nblocks = nseq * pages + 1
    q = jax.random.normal(kq, (nseq, nq, d), dtype)
    k = jax.random.normal(kk, (h, nblocks, block, d), dtype)
    v = jax.random.normal(kv, (h, nblocks, block, d), dtype)
    tables = (jax.random.permutation(kp, nblocks - 1) + 1)[: nseq * pages].reshape(nseq, pages)
    lens = jax.random.randint(kl, (nseq,), 1, pages * block + 1)
    held = jnp.arange(pages)[None, :] < -(-lens[:, None] // block)
    tables = jnp.where(held, tables, 0).astype(jnp.int32)
    if nan_free:
        used = jnp.zeros(nblocks, bool).at[tables].set(True).at[0].set(True)
        slot = jnp.arange(block)
        # Stale tail of each last block too: NaN everywhere a sequence may not look.
        k, v = (jnp.where(used[None, :, None, None], x, jnp.nan).astype(dtype) for x in (k, v))
        tail = jnp.zeros((nblocks, block), bool)
        last = jnp.take_along_axis(tables, (-(-lens // block) - 1)[:, None], 1)[:, 0]
        tail = tail.at[last].set(slot[None, :] >= (lens - (-(-lens // block) - 1) * block)[:, None])
        k, v = (jnp.where(tail[None, :, :, None], jnp.nan, x).astype(dtype) for x in (k, v))
    return q, k, v, tables, lens.astype(jnp.int32)


def kv_bytes(seq_lens: Array, h: int, d: int, dtype: DType) -> int:
    """Bytes of K and V a decode step must read: 2 * sum(len) * H * D * itemsize."""
    return int(2 * int(jnp.sum(seq_lens)) * h * d * jnp.dtype(dtype).itemsize)


def time_fn(fn, *args, iters: int = 3) -> float:
    """Median seconds per call after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    """Validate every variant against the reference, then time them (bytes of KV / time)."""
    on_gpu = not use_interpret()
    key = jax.random.PRNGKey(0)
    print(f"backend={jax.default_backend()} interpret={not on_gpu}")
    print(f"{'variant':8} {'dtype':9} {'K':>3} {'D':>4} {'heads':>6} {'max_err':>9} "
          f"{'ms':>9} {'GB/s':>8}")
    nseq, pages = (64, 128) if on_gpu else (4, 8)
    for dtype in (jnp.float32, jnp.bfloat16):
        for d, (nq, h) in ((64, (9, 3)), (128, (32, 8))):
            for block in (8, 16, 32):
                args = random_decode_inputs(key, nseq, nq, h, d, block, pages, dtype)
                ref = decode_reference(*args)
                for variant in VARIANTS:
                    if variant in ("dot", "split_dot") and block < DOT_MIN:
                        continue
                    fn = functools.partial(decode_attention, variant=variant, num_splits=4)
                    out = fn(*args)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                    tol = 1e-4 if dtype == jnp.float32 else 3e-2
                    assert bool(jnp.all(jnp.isfinite(out))), (variant, dtype, block, d)
                    assert err < tol, (variant, dtype, block, d, err)
                    sec = time_fn(fn, *args)
                    gbs = kv_bytes(args[4], h, d, dtype) / sec / 1e9
                    print(f"{variant:8} {jnp.dtype(dtype).name:9} {block:3d} {d:4d} "
                          f"{nq:2d}/{h:<3d} {err:9.2e} {sec * 1e3:9.3f} {gbs:8.3f}")
    print("all decode variants match the reference")


if __name__ == "__main__":
    main()
