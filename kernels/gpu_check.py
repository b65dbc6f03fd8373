"""GPU check for the Pallas kernels: compile, validate, time decode attention (`make gpu-check`).

    PYTHONPATH=. python3 -m kernels.gpu_check [--out DIR] [--budget-s 240] [--dry-run]

1. measures the device's copy bandwidth (read + write of a large buffer);
2. compiles every decode / ragged variant and checks it against the jnp reference
   (kernels/gpu_validate.py: SmolLM2 and Llama-like heads, fp32 / bf16 / int8 / fp8 pages,
   Gemma 3's shape with a sliding window);
3. times decode attention, block 16, bf16, Llama-like heads, for a batch x context grid:
   ours (dispatch's choice, "grouped", "split") vs (a) dense attention on a contiguous
   [B, T, H, D] cache (XLA) and (b) jax.experimental.pallas.ops.gpu.paged_attention (same
   [H, N, K, D] pool; q [B, Q, D]; needs pages % k_splits == 0 and block_h % 16 == 0);
4. times ragged prefill+decode attention on the same grid (a quarter of the rows bring a
   128-token prefill chunk, the rest one token) vs dense causal attention on a contiguous
   cache (JAX ships no GPU ragged paged kernel to compare with). Its GB/s is *effective*
   (each row's K/V counted once): prefill rows are compute-bound, so % of copy bandwidth is
   a yardstick there, not a limit.
Every timed call runs after a write of 256 MiB (more than any GPU's L2), so small grid points
read HBM, not cache. Reports ms, GB/s of K/V read and % of the copy bandwidth; writes
gpu_check.json + .txt to $OUT (else results/). Shapes whose K/V would exceed --max-kv-gib are
skipped; the grid stops when the time budget is spent. Without a GPU it prints the plan and
exits with status 2. `run_kernels` is the part experiments/gpu_bench.py reuses.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768)
BLOCK = 16
BENCH_HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3-8B-like)
DEFAULT_MAX_KV_GIB = 8.0
PREFILL_CHUNK = 128  # query tokens of the prefill rows of a ragged step
_flush_buffer = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing after this")
    ap.add_argument("--max-kv-gib", type=float, default=DEFAULT_MAX_KV_GIB,
                    help="skip larger K/V sizes")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="print the grid, touch no device")
    return ap.parse_args(argv)


def kv_gib(batch: int, ctx: int, h: int = BENCH_HEADS[1], d: int = BENCH_HEADS[2]) -> float:
    """GiB of bf16 K and V for batch x ctx tokens."""
    return 2 * batch * ctx * h * d * 2 / 2**30


def grid(max_kv_gib: float) -> list[tuple[int, int]]:
    """(batch, context) pairs, small first, within the memory guard."""
    pairs = [(b, c) for c in CONTEXTS for b in BATCHES if kv_gib(b, c) <= max_kv_gib]
    return sorted(pairs, key=lambda bc: bc[0] * bc[1])


def has_gpu() -> bool:
    """Whether JAX is installed and sees a GPU."""
    try:
        import jax

        return bool(jax.devices("gpu"))
    except (ImportError, RuntimeError):
        return False


def flush_l2() -> None:
    """Writes 256 MiB on the device (H100/H200 L2: 50 MB), so the next call reads HBM."""
    import jax
    import jax.numpy as jnp

    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = jnp.zeros((64 << 20,), jnp.float32)
    _flush_buffer = jax.block_until_ready(_bump()(_flush_buffer))


@functools.cache
def _bump():
    import jax

    return jax.jit(lambda a: a + 1.0, donate_argnums=0)


def timeit(fn, *args, iters: int, flush: bool = True) -> float:
    """Median seconds per call after a warm-up (compile) call; L2 flushed before each."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        if flush:
            flush_l2()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def copy_bandwidth(iters: int) -> float:
    """GB/s of a device copy of 2 GiB (bytes read + bytes written)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((2**29,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / timeit(f, x, iters=iters, flush=False) / 1e9


def bench_inputs(batch: int, ctx: int):
    """Paged pool with shuffled pages, its contiguous copy, queries and lengths (bf16)."""
    import jax
    import jax.numpy as jnp

    nq, h, d = BENCH_HEADS
    pages = ctx // BLOCK
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(1), 4)
    n = batch * pages + 1
    k_pages = jax.random.normal(kk, (h, n, BLOCK, d), jnp.bfloat16)
    v_pages = jax.random.normal(kv, (h, n, BLOCK, d), jnp.bfloat16)
    tables = (jax.random.permutation(kp, n - 1) + 1).reshape(batch, pages).astype(jnp.int32)
    lens = jnp.full((batch,), ctx, jnp.int32)
    q = jax.random.normal(kq, (batch, nq, d), jnp.bfloat16)
    return q, k_pages, v_pages, tables, lens


def dense_attention(q, k, v, lens):
    """Baseline on a contiguous cache: q [B, Q, D], k/v [B, T, H, D]."""
    import jax
    import jax.numpy as jnp

    b, nq, d = q.shape
    h = k.shape[2]
    qg = q.reshape(b, h, nq // h, d)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    s = jnp.where(jnp.arange(k.shape[1])[None, None, None] < lens[:, None, None, None], s, -1e30)
    w = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhgt,bthd->bhgd", w, v).reshape(b, nq, d)


def bench_one(batch: int, ctx: int, iters: int) -> list[dict]:
    """Times every contender for one shape; returns one row each."""
    import jax

    from kernels import dispatch
    from kernels.paged_attention import decode_attention

    q, kp, vp, tables, lens = bench_inputs(batch, ctx)
    nq, h, d = BENCH_HEADS
    pages = ctx // BLOCK
    variant, splits = dispatch.decode_plan(batch, nq, h, BLOCK, pages)
    ours = functools.partial(decode_attention, variant=variant, num_splits=splits)
    grouped = functools.partial(decode_attention, variant="grouped")
    split = functools.partial(decode_attention, variant="split", num_splits=max(2, splits))
    contenders = {f"ours:auto({variant} x{splits})": ours, "ours:grouped": grouped,
                  f"ours:split x{max(2, splits)}": split, "jax_pallas_paged": _jax_paged(pages)}
    nbytes = 2 * batch * ctx * h * d * 2
    rows = []
    for name, fn in contenders.items():
        rows.append(_timed(name, jax.jit(fn), (q, kp, vp, tables, lens), batch, ctx, nbytes, iters))
    k = kp[:, tables].reshape(h, batch, ctx, d).transpose(1, 2, 0, 3)
    v = vp[:, tables].reshape(h, batch, ctx, d).transpose(1, 2, 0, 3)
    del kp, vp
    rows.append(_timed("dense_xla", jax.jit(dense_attention), (q, k, v, lens), batch, ctx,
                       nbytes, iters))
    return rows


def _jax_paged(pages: int):
    """JAX's own Pallas GPU paged_attention (q [B, Q, D], same pool), or a function raising
    the import error (its row then records it)."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except ImportError as e:
        def missing(*_, err=e):
            raise err
        return missing
    jsplits = max(1, min(16, pages // 8))
    return functools.partial(jax_paged.paged_attention, k_splits=jsplits,
                             pages_per_compute_block=min(8, pages // jsplits))


def _timed(name, fn, args, batch, ctx, nbytes, iters) -> dict:
    try:
        sec = timeit(fn, *args, iters=iters)
        return dict(name=name, batch=batch, ctx=ctx, ms=sec * 1e3, gbps=nbytes / sec / 1e9)
    except Exception as e:  # one failing contender must not lose the whole table
        return dict(name=name, batch=batch, ctx=ctx, error=f"{type(e).__name__}: {e}"[:300])


def bench_ragged(batch: int, ctx: int, iters: int) -> list[dict]:
    """Ragged prefill+decode: the first batch // 4 rows (at least 1) bring PREFILL_CHUNK new
    tokens, the others one; every row's context is ctx. Ours vs dense causal attention."""
    import jax
    import jax.numpy as jnp

    from kernels import dispatch

    _, kp, vp, tables, lens = bench_inputs(batch, ctx)
    nq, h, d = BENCH_HEADS
    n_pre = max(1, batch // 4)
    num_q = jnp.where(jnp.arange(batch) < n_pre, PREFILL_CHUNK, 1)
    qs = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_q)]).astype(jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(2), (int(qs[-1]), nq, d), jnp.bfloat16)
    ours = functools.partial(dispatch.paged_attention, max_q=PREFILL_CHUNK, scale=d**-0.5)
    nbytes = 2 * batch * ctx * h * d * 2
    rows = [_timed("ours:ragged", jax.jit(ours), (q, kp, vp, tables, lens, qs), batch, ctx,
                   nbytes, iters)]
    scores_gib = n_pre * nq * PREFILL_CHUNK * ctx * 4 / 2**30
    if scores_gib > 16:  # the dense baseline materializes its scores
        return rows + [dict(name="dense_xla:ragged", batch=batch, ctx=ctx,
                            error=f"skipped: {scores_gib:.0f} GiB of scores")]
    k = kp[:, tables].reshape(h, batch, ctx, d).transpose(1, 2, 0, 3)
    v = vp[:, tables].reshape(h, batch, ctx, d).transpose(1, 2, 0, 3)
    del kp, vp
    dense = functools.partial(dense_ragged, n_pre=n_pre, chunk=PREFILL_CHUNK)
    rows.append(_timed("dense_xla:ragged", jax.jit(dense), (q, k, v, lens), batch, ctx,
                       nbytes, iters))
    return rows


def dense_ragged(q, k, v, lens, *, n_pre: int, chunk: int):
    """Baseline on a contiguous cache [B, T, H, D]: the first n_pre rows' `chunk` queries
    (causal, at the end of their context), then one query for each other row."""
    import jax
    import jax.numpy as jnp

    _, t_ctx, h, d = k.shape
    nq = q.shape[1]
    qp = q[: n_pre * chunk].reshape(n_pre, chunk, h, nq // h, d)
    s = jnp.einsum("bqhgd,bthd->bhgqt", qp, k[:n_pre],
                   preferred_element_type=jnp.float32) * d**-0.5
    qpos = lens[:n_pre, None] - chunk + jnp.arange(chunk)[None, :]
    see = jnp.arange(t_ctx)[None, None, :] <= qpos[:, :, None]
    w = jax.nn.softmax(jnp.where(see[:, None, None], s, -1e30), axis=-1).astype(v.dtype)
    o_pre = jnp.einsum("bhgqt,bthd->bqhgd", w, v[:n_pre]).reshape(n_pre * chunk, nq, d)
    o_dec = dense_attention(q[n_pre * chunk:], k[n_pre:], v[n_pre:], lens[n_pre:])
    return jnp.concatenate([o_pre, o_dec])


def run_kernels(budget_s: float, max_kv_gib: float = DEFAULT_MAX_KV_GIB,
                iters: int = 5) -> dict:
    """Copy bandwidth, correctness checks, then decode and ragged timings until the budget
    is spent: dict(copy_gbps, checks, rows)."""
    import jax

    t0 = time.perf_counter()
    copy_gbps = copy_bandwidth(iters)
    print(f"device {jax.devices()[0].device_kind}: copy bandwidth {copy_gbps:.0f} GB/s")
    from kernels.gpu_validate import validate

    checks, rows = validate(), []
    for batch, ctx in grid(max_kv_gib):
        if time.perf_counter() - t0 > budget_s:
            print(f"time budget spent; skipped shapes from ({batch}, {ctx}) on")
            break
        new = bench_one(batch, ctx, iters) + bench_ragged(batch, ctx, iters)
        rows += new
        print(table(new, copy_gbps).split("\n", 1)[1], flush=True)
    return dict(copy_gbps=copy_gbps, checks=checks, rows=rows)


def table(rows: list[dict], copy_gbps: float) -> str:
    lines = [f"{'batch':>5} {'ctx':>6} {'kernel':22} {'ms':>9} {'GB/s':>8} {'%copy':>6}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['batch']:5d} {r['ctx']:6d} {r['name']:22} ERROR {r['error'][:60]}")
            continue
        pct = 100 * r["gbps"] / copy_gbps
        lines.append(f"{r['batch']:5d} {r['ctx']:6d} {r['name']:22} {r['ms']:9.3f} "
                     f"{r['gbps']:8.1f} {pct:6.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = grid(args.max_kv_gib)
    print(f"decode grid (batch, ctx), block {BLOCK}, heads {BENCH_HEADS}: {shapes}")
    if args.dry_run:
        return 0
    if not has_gpu():
        print("gpu_check: no GPU visible to JAX (jax.devices('gpu') is empty); nothing to check. "
              "Run on a CUDA machine with jax[cuda12].", file=sys.stderr)
        return 2
    import jax

    res = run_kernels(args.budget_s, args.max_kv_gib, args.iters)
    checks, rows, copy_gbps = res["checks"], res["rows"], res["copy_gbps"]
    report = table(rows, copy_gbps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  copy_gbps=copy_gbps, checks=checks, decode=rows)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.txt").write_text(report + "\n")
    print(report)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
