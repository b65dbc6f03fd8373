# ruff: noqa: F821  (jaxtyping axis strings such as "T" read as undefined names)
"""The batched LoRA delta for GPUs, in Pallas (Triton): Punica's segmented shrink and expand.

The tokens are grouped by adapter slot into tiles of BM rows, each tile one slot's (a slot's
last tile partly padding), in XLA around the kernel (`tiles`: a sort of T slot ids). One
program per (tile, block of BN outputs) computes its rows' delta for one target:

    h = x_tile [BM, I] @ a[slot].T [I, R]      the shrink, over I in chunks of BK
    y = h [BM, R] @ b[slot] [R, BN]            the expand

reading its slot's weights by index (`a_ref[slot]`): the work is the tokens times the rank
(plus at most one padded tile per adapter in the batch), whatever the mix of adapters, and
the tiles' count is a static bound (T / BM + N), so a new mix compiles nothing. A tile of no
slot (past the batch's tiles) writes zeros. Shapes are padded in the wrapper to what tl.dot
takes: R to at least 16, I to a multiple of BK, O to a multiple of BN.

    delta   the fused projection's delta (models/lora_ops.lora_delta's contract): the k
            targets' expands side by side, in x's dtype

`python -m kernels.lora_pallas` checks it against models/lora_ops' contract on random mixes
(interpret mode off a GPU); tests/test_lora_pallas.py does so and lowers it for CUDA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from kernels.paged_attention import ANY, compiler_params, use_interpret

BM, BK, BN = 16, 64, 64  # rows of a tile, inputs per shrink chunk, outputs per program


def _pad_to(n: int, m: int) -> int:
    return -(-n // m) * m


def tiles(slots: Int[Array, "T"], num_slots: int, bm: int = BM
          ) -> tuple[Int[Array, "NT BM"], Int[Array, "NT"]]:
    """Tokens grouped by slot into tiles of `bm` rows: each tile's token rows (-1: padding)
    and its slot (-1: an unused tile). NT = ceil(T / bm) + num_slots bounds the tiles of any
    mix (each slot's last tile may be partial)."""
    t = slots.shape[0]
    group = jnp.where(slots >= 0, slots, num_slots)
    order = jnp.argsort(group, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(group, length=num_slots + 1)[:num_slots]
    starts = jnp.cumsum(sizes) - sizes
    count = (sizes + bm - 1) // bm
    ends = jnp.cumsum(count)
    k = jnp.arange(-(-t // bm) + num_slots)
    j = jnp.searchsorted(ends, k, side="right")  # the slot whose tiles hold tile k
    used = j < num_slots
    jc = jnp.minimum(j, num_slots - 1)
    i = k - (ends[jc] - count[jc])  # tile k is slot j's i-th
    r = jnp.arange(bm)
    at = i[:, None] * bm + r[None, :]
    valid = used[:, None] & (at < sizes[jc][:, None])
    rows = jnp.where(valid, order[jnp.clip(starts[jc][:, None] + at, 0, t - 1)], -1)
    return rows.astype(jnp.int32), jnp.where(used, j, -1).astype(jnp.int32)


def _dot(a: Array, b: Array) -> Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _kernel(slot_ref, x_ref, a_ref, b_ref, o_ref, *, chunks: int):
    slot = slot_ref[pl.program_id(0)]
    j = jnp.maximum(slot, 0)  # an unused tile reads slot 0 and writes zeros
    cols = pl.ds(pl.program_id(1) * BN, BN)

    def shrink(c, h):
        xs = x_ref[:, pl.ds(c * BK, BK)]  # [BM, BK]
        aa = a_ref[j, :, pl.ds(c * BK, BK)]  # [R, BK]
        return h + _dot(xs, aa.T.astype(xs.dtype))

    h = jax.lax.fori_loop(0, chunks, shrink, jnp.zeros((BM, a_ref.shape[1]), jnp.float32))
    y = _dot(h.astype(b_ref.dtype), b_ref[j, :, cols])  # [BM, BN]
    o_ref[...] = jnp.where(slot >= 0, y, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def expand_tiles(x_tiles: Float[Array, "NT BM Ip"], tile_slot: Int[Array, "NT"],
                 a: Float[Array, "N Rp Ip"], b: Float[Array, "N Rp Op"],
                 interpret: bool | None = None, num_warps: int = 4
                 ) -> Float[Array, "NT BM Op"]:
    """Each tile's delta for one target (padded shapes: module docstring)."""
    nt, _, ip = x_tiles.shape
    op = b.shape[2]
    return pl.pallas_call(
        functools.partial(_kernel, chunks=ip // BK),
        grid=(nt, op // BN),
        in_specs=[pl.BlockSpec(memory_space=ANY),  # slot ids and weights: read by index
                  pl.BlockSpec((None, BM, ip), lambda k, c: (k, 0, 0)),
                  pl.BlockSpec(memory_space=ANY), pl.BlockSpec(memory_space=ANY)],
        out_specs=pl.BlockSpec((None, BM, BN), lambda k, c: (k, 0, c)),
        out_shape=jax.ShapeDtypeStruct((nt, BM, op), jnp.float32),
        interpret=use_interpret() if interpret is None else interpret,
        compiler_params=compiler_params(num_warps=num_warps),
        name="lora_expand_tiles",
    )(tile_slot, x_tiles, a, b)


def delta(x: Float[Array, "T I"], a: Float[Array, "N kR I"], bs: tuple[Array, ...],
          slots: Int[Array, "T"], interpret: bool | None = None) -> Float[Array, "T O"]:
    """The fused projection's delta (lora_ops.lora_delta's contract: b_i [N, R, O_i]), in
    x's dtype, each target's on the kernel."""
    t, i_dim = x.shape
    n, r = a.shape[0], bs[0].shape[1]
    rows, tile_slot = tiles(slots, n)
    ip, rp = _pad_to(i_dim, BK), max(16, 1 << (r - 1).bit_length())
    xp = jnp.pad(x, ((0, 0), (0, ip - i_dim)))
    x_tiles = jnp.where((rows >= 0)[..., None], xp[jnp.clip(rows, 0)], 0).astype(x.dtype)
    back = jnp.where(rows >= 0, rows, t).reshape(-1)  # padding rows land past the batch
    outs = []
    for k, b in enumerate(bs):
        o = b.shape[2]
        ak = jnp.pad(a[:, k * r:(k + 1) * r], ((0, 0), (0, rp - r), (0, ip - i_dim)))
        bk = jnp.pad(b, ((0, 0), (0, rp - r), (0, _pad_to(o, BN) - o)))
        y = expand_tiles(x_tiles, tile_slot, ak.astype(x.dtype), bk.astype(x.dtype),
                         interpret=interpret)
        flat = y.reshape(-1, y.shape[-1])[:, :o]
        outs.append(jnp.zeros((t + 1, o), jnp.float32).at[back].set(flat)[:t])
    return jnp.concatenate(outs, axis=1).astype(x.dtype)


def main() -> None:
    """Checks the kernel (interpret mode off a GPU) against a numpy reference on random
    mixes (kernels/cpu_lora.reference)."""
    from kernels.cpu_lora import reference

    rng = np.random.default_rng(0)
    n, r, i_dim, outs = 5, 8, 96, (80, 16)
    a = rng.standard_normal((n, len(outs) * r, i_dim)).astype(np.float32)
    bs = tuple(rng.standard_normal((n, r, o)).astype(np.float32) for o in outs)
    for t in (1, 17, 40):
        x = rng.standard_normal((t, i_dim)).astype(np.float32)
        s = rng.integers(-1, n, t).astype(np.int32)
        got = np.asarray(delta(jnp.asarray(x), jnp.asarray(a), tuple(map(jnp.asarray, bs)),
                               jnp.asarray(s)))
        want = reference(x, a, bs, s)
        print(f"{t:3d} tokens: max |kernel - reference| = {np.abs(got - want).max():.2e}")


if __name__ == "__main__":
    main()
