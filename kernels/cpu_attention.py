"""Paged attention on CPUs: a C++ kernel (cpu_attention.cc) called through XLA's FFI.

    variant      how                                             trade-off
    reference    jnp gathers + segment softmax (paged_jax)       any platform; XLA:CPU
                                                                 materializes every page and
                                                                 runs tiny batched dots
    cpu (here)   walks block tables in place, online softmax,    needs a C++17 compiler once;
                 one (row, KV head) per task on XLA's threads    q f32 / bf16; K/V f32 /
                                                                 bf16, or int8 / fp8 with
                                                                 group scales

Same contract as `paged_jax.models.attention.paged_attention` (ragged rows, causal, zeros for
padding tokens). The shared library is compiled on first use with the machine's g++
(kernels/cpp_build.py), for the ISA `$PAGED_JAX_CPU_ISA` names (native by default; `isa=`
picks another build). `python -m kernels.cpu_attention` builds it, checks it against the
reference, and times both.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpp_build
from kernels.pages import PagesLike, as_pages

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "paged_jax_cpu_paged_attention"
TARGET_QUANT = "paged_jax_cpu_paged_attention_quant"  # int8 / fp8 pages + f32 scales


def load(folder: str, isa: str | None = None) -> bool:
    """Builds (if needed) and registers the kernel for an ISA (cpp_build.isa: `isa`, else
    `$PAGED_JAX_CPU_ISA`, else native) with XLA; False when it cannot be built."""
    return _load(folder, cpp_build.isa(isa))


@functools.cache
def _load(folder: str, isa: str) -> bool:
    return cpp_build.load(SOURCE, Path(folder), "CPU attention kernel", "the jnp reference",
                          {TARGET: "PagedAttention", TARGET_QUANT: "PagedAttentionQuant"}, isa)


def paged_attention(q, k_pages: PagesLike, v_pages: PagesLike, block_tables, seq_lens,
                    query_start, *, scale: float, window: int | None = None,
                    isa: str | None = None):
    """The kernel on one layer, `isa`'s build (call `load` first); shapes as in
    paged_jax.models.attention. Pages are read as stored (kernels/pages.py): float32 /
    bfloat16, or int8 / fp8 with group scales, bfloat16 and fp8 possibly as their bits; never
    cast or copied here. `window`: a query sees only its last `window` keys (sliding-window
    layers); pages before every query's window are skipped. A NaN or Inf in a query gives
    NaN (or Inf) in that query's output only."""
    k_pages, v_pages = as_pages(k_pages), as_pages(v_pages)
    dtype = q.dtype if q.dtype in (jnp.float32, jnp.bfloat16) else jnp.float32
    ints = [x.astype(jnp.int32) for x in (block_tables, seq_lens, query_start)]
    out_shape = jax.ShapeDtypeStruct(q.shape, dtype)
    kv = k_pages.dtype
    if k_pages.scale is not None:
        call = jax.ffi.ffi_call(cpp_build.target(TARGET_QUANT, isa), out_shape)
        out = call(q.astype(dtype), k_pages.values, v_pages.values,
                   k_pages.scale.astype(jnp.float32), v_pages.scale.astype(jnp.float32), *ints,
                   scale=np.float32(scale), window=np.int32(window or 0),
                   e5m2=np.int32(kv == jnp.float8_e5m2))
    else:
        cast = (lambda x: x) if kv in (jnp.float32, jnp.bfloat16) else (  # noqa: E731
            lambda x: x.astype(jnp.float32))  # e.g. float16 pages: the kernel reads f32 / bf16
        out = jax.ffi.ffi_call(cpp_build.target(TARGET, isa), out_shape)(
            q.astype(dtype), cast(k_pages.values), cast(v_pages.values), *ints,
            scale=np.float32(scale), window=np.int32(window or 0))
    return out.astype(q.dtype)


def main() -> None:
    """Builds, checks against the reference on random ragged batches, and times both."""
    import time

    from kernels.reference import ragged_reference

    assert load(str(cpp_build.default_folder())), "the kernel did not build"
    rng = np.random.default_rng(0)
    h, g, d, k, n, rows = 3, 3, 64, 16, 2400, 64
    lens = rng.integers(40, 170, rows).astype(np.int32)
    pages = -(-lens // k)
    tables = np.zeros((rows, 16), np.int32)
    perm = rng.permutation(np.arange(1, n))
    for r, o in enumerate(np.cumsum(pages) - pages):
        tables[r, :pages[r]] = perm[o:o + pages[r]]
    f32 = [jnp.asarray(rng.standard_normal((rows, h * g, d)), jnp.float32),
           jnp.asarray(rng.standard_normal((h, n, k, d)), jnp.float32),
           jnp.asarray(rng.standard_normal((h, n, k, d)), jnp.float32)]
    ints = [jnp.asarray(tables), jnp.asarray(lens), jnp.arange(rows + 1, dtype=jnp.int32)]
    ours = jax.jit(functools.partial(paged_attention, scale=d ** -0.5))
    ref = jax.jit(functools.partial(ragged_reference, max_q=1, scale=d ** -0.5))
    for dtype in (jnp.float32, jnp.bfloat16):  # pages (and queries) in this dtype
        args = [x.astype(dtype) for x in f32] + ints
        err = float(jnp.abs(ours(*args).astype(jnp.float32) - ref(*args).astype(jnp.float32)).max())
        print(f"decode, {rows} rows, {lens.sum()} context tokens, {jnp.dtype(dtype).name} pages: "
              f"max |cpu - reference| = {err:.2e}")
        kv_bytes = 2 * int(lens.sum()) * h * d * jnp.dtype(dtype).itemsize
        for name, fn in (("cpu", ours), ("reference", ref)):
            fn(*args).block_until_ready()
            best = min(_timed(fn, args, time) for _ in range(20))
            rate = kv_bytes / best / 1e9
            print(f"  {name:10s} {best * 1e3:7.3f} ms  {rate:6.1f} GB/s of K/V read")


def _timed(fn, args, time) -> float:
    t = time.perf_counter()
    fn(*args).block_until_ready()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
