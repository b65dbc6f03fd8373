# ruff: noqa: F821  (jaxtyping axis strings such as "S" read as undefined names)
"""Decode paged attention on Mosaic GPU (Hopper: TMA copies into shared memory, wgmma).

The Triton backend of Pallas, which kernels/paged_attention.py uses, is deprecated in JAX
0.11; Mosaic GPU is its successor on Hopper. Same contract as `decode_attention`: one query
token per sequence over the paged cache [H, N, K, D], block tables [S, P], lengths [S].

    grid (S, H, X): one program (one warpgroup, 128 threads) = one sequence x one KV head x
    one of X splits of its pages (flash-decoding when S * H cannot fill the GPU).

       q tile   [64, D]  the G query heads of the KV head, zero rows below G (wgmma's M is 64)
       step     C pages = T = C * K tokens: C TMA copies of a contiguous [K, D] page each into
                a [T, D] slot of shared memory, `stages` slots in flight
       scores   wgmma  q [64, D] @ K^T [D, T]  -> [64, T] fp32 in registers
       softmax  online, fp32, exp2 with log2(e) folded into the scores
       output   wgmma  p [64, T] (bf16, registers) @ V [T, D] -> [64, D] fp32

Only the last step of a sequence can hold key slots past its end (the tail of its last page,
which may be stale or NaN): their scores are -inf and, in that step alone, their V rows are
zeroed in shared memory before the p @ V product (0 * NaN would be NaN). Pages past the end
are read as block 0, the zero block. A split writes its unnormalized-free result as a
normalized [64, D] tile and its log-sum-exp; `combine` merges the splits.

Limits (the dispatcher falls back to the Triton kernel outside them): bfloat16 / float16
pages, head_dim a multiple of 64, C * K a multiple of 64, G <= 64. Runs in Mosaic GPU's
interpret mode off GPU (JAX >= 0.10), which is how the CPU tests check it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

ROWS = 64  # wgmma's M: the query rows of one program
SMEM_BYTES = 232448  # shared memory one block may take on an H100 / H200 (227 KiB)
LOG2E = math.log2(math.e)


def plgpu():
    """jax.experimental.pallas.mosaic_gpu, imported on first use (it is large)."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def interpret_params():
    """Mosaic GPU's interpret mode parameters (exported in JAX 0.11, private in 0.10)."""
    mg = plgpu()
    if hasattr(mg, "InterpretGPUParams"):
        return mg.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _transposed(ref):
    """ref viewed [1, 0] (JAX 0.11: ref.transpose; 0.10: plgpu.transpose_ref)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu().transpose_ref(ref, (1, 0))


def smem_bytes(head_dim: int, tokens_per_step: int, stages: int) -> int:
    """Shared memory of one program: q, `stages` K and V slots, the fp32 output tile, the
    log-sum-exp row, and a little for barriers and alignment."""
    return (ROWS * head_dim * 2 + 2 * stages * tokens_per_step * head_dim * 2
            + ROWS * head_dim * 4 + ROWS * 4 + 1024)


def supported(dtype, head_dim: int, block: int, group: int, pages_per_step: int,
              stages: int = 2) -> str | None:
    """Why these shapes cannot run on this kernel, or None when they can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"pages of {jnp.dtype(dtype).name} (wgmma here takes bfloat16 / float16)"
    if head_dim % 64:
        return f"head_dim {head_dim} (needs a multiple of 64)"
    if (pages_per_step * block) % 64:
        return f"{pages_per_step} pages of {block} tokens a step (needs a multiple of 64)"
    if group > ROWS:
        return f"{group} query heads per KV head (at most {ROWS})"
    if (need := smem_bytes(head_dim, pages_per_step * block, stages)) > SMEM_BYTES:
        return f"{need} bytes of shared memory (at most {SMEM_BYTES}: fewer pages a step)"
    return None


@dataclasses.dataclass(frozen=True)
class _Program:
    """One program's refs, scratch and scalars (sequence s, KV head h, split x); its keys
    are steps first .. end - 1 of T tokens, those before `lo` outside the window."""

    refs: tuple  # q, k, v, block tables, lengths, o, lse (GMEM)
    scratch: tuple  # q, k slots, v slots, o, lse (SMEM); q, k, v barriers
    s: Array
    h: Array
    x: Array
    length: Array
    lo: Array
    first: Array
    end: Array
    block: int
    pages_per_step: int
    stages: int
    emulate: bool

    @property
    def tokens(self) -> int:
        return self.pages_per_step * self.block

    def issue(self, step, slot) -> None:
        """TMA copies of step's C pages of K and V into `slot` (block 0 past the end)."""
        mg = plgpu()
        _, k_ref, v_ref, bt_ref, *_ = self.refs
        _, k_smem, v_smem, _, _, _, k_bar, v_bar = self.scratch
        for j in range(self.pages_per_step):
            idx = step * self.pages_per_step + j
            page = jnp.where(idx * self.block < self.length, bt_ref[self.s, idx], 0)
            rows = pl.ds(j * self.block, self.block)
            mg.copy_gmem_to_smem(k_ref.at[self.h, page], k_smem.at[slot, rows], k_bar.at[slot])
            mg.copy_gmem_to_smem(v_ref.at[self.h, page], v_smem.at[slot, rows], v_bar.at[slot])

    def step(self, step, carry):
        """One step of T keys: scores, online softmax, the tail's V rows zeroed in its last
        step, p @ V; then the slot is refilled `stages` steps ahead."""
        mg = plgpu()
        acc, m_i, l_i = carry
        q_smem, k_smem, v_smem, _, _, _, k_bar, v_bar = self.scratch
        t, d, length = self.tokens, q_smem.shape[-1], self.length
        slot = jax.lax.rem(step - self.first, self.stages)
        mg.barrier_wait(k_bar.at[slot])
        qk = _scores(q_smem, k_smem.at[slot], t, self.emulate)
        kpos = step * t + _iota((ROWS, t), 1, self.emulate)
        qk = jnp.where((kpos < length) & (kpos >= self.lo), qk * LOG2E, -jnp.inf)
        m_new = jnp.maximum(m_i, qk.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: exp2 gives 0
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(qk - jax.lax.broadcast_in_dim(m_safe, qk.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
        mg.barrier_wait(v_bar.at[slot])

        @pl.when(step * t + t > length)
        def _zero_tail():  # the last step: V rows past the end may be stale or NaN
            row = step * t + _iota((t, d), 0, self.emulate)
            v = v_smem.at[slot][...]
            v_smem.at[slot][...] = jnp.where(row < length, v, jnp.zeros_like(v))
            mg.commit_smem()

        acc = _accumulate(acc, p.astype(q_smem.dtype), v_smem.at[slot], self.emulate)

        @pl.when(step + self.stages < self.end)
        def _refill():
            self.issue(step + self.stages, slot)

        return acc, m_new, l_i

    def finish(self, acc, m_i, l_i) -> None:
        """The normalized tile and its base-2 log-sum-exp (-inf for an empty split) out."""
        mg = plgpu()
        *_, o_ref, lse_ref = self.refs
        _, _, _, o_smem, lse_smem, *_ = self.scratch
        seen = l_i > 0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
        o_smem[...] = acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])
        lse_smem[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        mg.commit_smem()
        mg.copy_smem_to_gmem(o_smem, o_ref.at[self.s, self.h, self.x])
        mg.copy_smem_to_gmem(lse_smem, lse_ref.at[self.s, self.h, self.x])
        mg.wait_smem_to_gmem(0)


def _kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, lse_ref, *scratch,
            block: int, pages_per_step: int, stages: int, steps_per_split: int,
            window: int | None, emulate_mma: bool):
    """One (sequence, KV head, split): see the module docstring."""
    mg = plgpu()
    s, h, x = (jax.lax.axis_index(a) for a in ("s", "h", "x"))
    t = pages_per_step * block
    length = len_ref[s]
    lo = jnp.int32(0) if window is None else jnp.maximum(length - window, 0)
    prog = _Program(
        (q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, lse_ref), scratch, s, h, x, length, lo,
        first=jnp.maximum(x * steps_per_split, lo // t),
        end=jnp.minimum((x + 1) * steps_per_split, pl.cdiv(length, t)),
        block=block, pages_per_step=pages_per_step, stages=stages, emulate=emulate_mma)
    q_smem, q_bar = scratch[0], scratch[5]
    mg.copy_gmem_to_smem(q_ref.at[s, h], q_smem, q_bar)
    for i in range(stages):
        @pl.when(prog.first + i < prog.end)
        def _prefetch(i=i):
            prog.issue(prog.first + i, i)

    mg.barrier_wait(q_bar)
    laid = functools.partial(_laid, emulate=emulate_mma)
    m_i = laid(jnp.full((ROWS,), -jnp.inf, jnp.float32), rows=True)
    l_i = laid(jnp.full((ROWS,), 0.0, jnp.float32), rows=True)
    acc = laid(jnp.full((ROWS, q_smem.shape[-1]), 0.0, jnp.float32))
    prog.finish(*jax.lax.fori_loop(prog.first, prog.end, prog.step, (acc, m_i, l_i)))


def _laid(x: Array, emulate: bool, rows: bool = False) -> Array:
    """x in wgmma's accumulator layout (its per-row reduction for `rows`), as the loop
    carries it; as it is in interpret mode (JAX 0.10's has no layout_cast)."""
    if emulate:
        return x
    layout = plgpu().Layout.WGMMA
    return plgpu().layout_cast(x, layout.reduce(1) if rows else layout)


def _iota(shape: tuple[int, int], dim: int, emulate: bool) -> Array:
    """int32 iota along `dim` in wgmma's layout (plain in interpret mode)."""
    if emulate:
        return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu().broadcasted_iota(jnp.int32, shape, dim, layout=plgpu().Layout.WGMMA)


def _scores(q_smem, k_slot, t: int, emulate: bool) -> Array:
    """q [64, D] @ K^T [D, T] in fp32: wgmma, or a jnp dot in interpret mode (which has no
    wgmma; the CUDA lowering in the tests checks that path)."""
    mg = plgpu()
    if emulate:
        return jax.lax.dot_general(q_smem[...], k_slot[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def run(acc_ref):
        mg.wgmma(acc_ref, q_smem, _transposed(k_slot))
        return acc_ref[...]

    return pl.run_scoped(run, mg.ACC((ROWS, t), jnp.float32))


def _accumulate(acc: Array, p: Array, v_slot, emulate: bool) -> Array:
    """acc + p [64, T] @ V [T, D] in fp32 (wgmma from registers and shared memory)."""
    mg = plgpu()
    if emulate:
        return acc + jnp.dot(p, v_slot[...], preferred_element_type=jnp.float32)

    def run(acc_ref):
        mg.wgmma(acc_ref, p, v_slot)

    return pl.run_state(run)(mg.ACC.init(acc))


def combine(o: Float[Array, "S H X R D"], lse: Float[Array, "S H X R"]
            ) -> Float[Array, "S H R D"]:
    """Merges the splits' normalized outputs by their (base-2) log-sum-exp weights."""
    top = jnp.max(lse, axis=2, keepdims=True)
    w = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))  # 0 for empty splits
    den = jnp.sum(w, axis=2)
    num = jnp.sum(o * w[..., None], axis=2)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _scratch(t: int, d: int, dtype, stages: int) -> list:
    mg = plgpu()
    swizzled = (mg.TilingTransform((8, 64)), mg.SwizzleTransform(128))
    wide = (mg.TilingTransform((8, 32)), mg.SwizzleTransform(128))
    return [
        mg.SMEM((ROWS, d), dtype, transforms=swizzled),
        mg.SMEM((stages, t, d), dtype, transforms=swizzled),
        mg.SMEM((stages, t, d), dtype, transforms=swizzled),
        mg.SMEM((ROWS, d), jnp.float32, transforms=wide),
        mg.SMEM((ROWS,), jnp.float32),
    ]


@functools.partial(jax.jit, static_argnames=(
    "scale", "num_splits", "pages_per_step", "stages", "window", "interpret"))
def mosaic_decode_attention(
    q: Float[Array, "S Q D"],
    k_pages: Float[Array, "H N K D"],
    v_pages: Float[Array, "H N K D"],
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    *,
    scale: float | None = None,
    num_splits: int = 1,
    pages_per_step: int = 8,
    stages: int = 2,
    window: int | None = None,
    interpret: bool | None = None,
) -> Float[Array, "S Q D"]:
    """As `kernels.paged_attention.decode_attention` for bfloat16 / float16 pages (`supported`
    says which shapes); `num_splits` partitions each sequence's steps (flash-decoding)."""
    mg = plgpu()
    nseq, nq, d = q.shape
    h, _, block, _ = k_pages.shape
    g = nq // h
    dtype = k_pages.dtype
    if why := supported(dtype, d, block, g, pages_per_step, stages):
        raise ValueError(f"the Mosaic GPU decode kernel does not take {why}")
    t = pages_per_step * block
    steps = -(-block_tables.shape[1] // pages_per_step)
    per_split = -(-steps // num_splits)
    pad = per_split * num_splits * pages_per_step - block_tables.shape[1]
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))
    scale = d**-0.5 if scale is None else scale
    qg = (q.astype(jnp.float32) * scale).astype(dtype).reshape(nseq, h, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kernel = mg.kernel(
        functools.partial(_kernel, block=block, pages_per_step=pages_per_step, stages=stages,
                          steps_per_split=per_split, window=window, emulate_mma=interpret),
        out_type=(jax.ShapeDtypeStruct((nseq, h, num_splits, ROWS, d), jnp.float32),
                  jax.ShapeDtypeStruct((nseq, h, num_splits, ROWS), jnp.float32)),
        scratch_types=[*_scratch(t, d, dtype, stages), mg.Barrier(),
                       mg.Barrier(num_arrivals=pages_per_step, num_barriers=stages),
                       mg.Barrier(num_arrivals=pages_per_step, num_barriers=stages)],
        grid=(nseq, h, num_splits),
        grid_names=("s", "h", "x"),
        interpret=interpret_params() if interpret else False,
    )
    o, lse = kernel(qg, k_pages, v_pages, tables, seq_lens.astype(jnp.int32))
    out = combine(o, lse) if num_splits > 1 else o[:, :, 0]
    return out[:, :, :g].reshape(nseq, nq, d).astype(q.dtype)
