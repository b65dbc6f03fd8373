"""GPU check for the Pallas kernels: compile, validate, time decode attention (`make gpu-check`).

    PYTHONPATH=. python3 -m kernels.gpu_check [--out DIR] [--budget-s 240] [--dry-run]

1. measures the device's copy bandwidth (read + write of a large buffer);
2. compiles every decode / ragged variant for SmolLM2 (9/3 heads, D=64) and a Llama-like
   (32/8, D=128) config in fp32 and bf16 and checks it against the jnp reference;
3. times decode attention, block 16, bf16, Llama-like heads, for a batch x context grid:
   ours (dispatch's choice, "grouped", "split") vs (a) dense attention on a contiguous
   [B, T, H, D] cache (XLA) and (b) jax.experimental.pallas.ops.gpu.paged_attention (same
   [H, N, K, D] pool; q [B, Q, D]; needs pages % k_splits == 0 and block_h % 16 == 0).
Reports ms, GB/s of K/V read and % of the copy bandwidth; writes gpu_check.json + .txt to $OUT
(else results/). Shapes whose K/V would exceed --max-kv-gib are skipped; the grid stops when the
time budget is spent. Without a GPU it prints the plan and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768)
BLOCK = 16
BENCH_HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3-8B-like)
CHECK_CONFIGS = ((9, 3, 64), (32, 8, 128))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing after this")
    ap.add_argument("--max-kv-gib", type=float, default=8.0, help="skip larger K/V sizes")
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
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def timeit(fn, *args, iters: int) -> float:
    """Median seconds per call after a warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
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
    return 2 * x.nbytes / timeit(f, x, iters=iters) / 1e9


def validate() -> list[dict]:
    """Every variant, both model configs, fp32 and bf16, decode and ragged, vs the reference."""
    import jax
    import jax.numpy as jnp

    from kernels.paged_attention import decode_attention, decode_reference, random_decode_inputs
    from kernels.ragged_paged_attention import (
        ragged_paged_attention,
        ragged_reference,
        random_ragged_inputs,
    )

    rows, key = [], jax.random.PRNGKey(0)
    for nq, h, d in CHECK_CONFIGS:
        for dtype in (jnp.float32, jnp.bfloat16):
            tol = 2e-3 if dtype == jnp.float32 else 3e-2  # tf32 dots on GPU
            args = random_decode_inputs(key, 8, nq, h, d, BLOCK, 16, dtype)
            ref = decode_reference(*args)
            for variant in ("grouped", "dot", "split"):
                out = decode_attention(*args, variant=variant, num_splits=4)
                rows.append(_check("decode", variant, nq, h, d, dtype, out, ref, tol))
            args = random_ragged_inputs(key, 8, nq, h, d, BLOCK, 16, 16, dtype)
            ref = ragged_reference(*args, max_q=16)
            for variant in ("grouped", "dot"):
                out = ragged_paged_attention(*args, max_q=16, variant=variant)
                rows.append(_check("ragged", variant, nq, h, d, dtype, out, ref, tol))
    return rows


def _check(kind, variant, nq, h, d, dtype, out, ref, tol) -> dict:
    import jax.numpy as jnp

    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    ok = bool(jnp.all(jnp.isfinite(out))) and err < tol
    row = dict(kind=kind, variant=variant, heads=f"{nq}/{h}", d=d,
               dtype=jnp.dtype(dtype).name, max_err=err, ok=ok)
    print(f"check {kind:6} {variant:8} {nq:2d}/{h} D={d:3d} {row['dtype']:8} "
          f"err={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return row


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
    import functools

    import jax
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    from kernels import dispatch
    from kernels.paged_attention import decode_attention

    q, kp, vp, tables, lens = bench_inputs(batch, ctx)
    nq, h, d = BENCH_HEADS
    pages = ctx // BLOCK
    variant, splits = dispatch.decode_plan(batch, nq, h, BLOCK, pages)
    ours = functools.partial(decode_attention, variant=variant, num_splits=splits)
    grouped = functools.partial(decode_attention, variant="grouped")
    split = functools.partial(decode_attention, variant="split", num_splits=max(2, splits))
    jsplits = max(1, min(16, pages // 8))
    theirs = functools.partial(jax_paged.paged_attention, k_splits=jsplits,
                               pages_per_compute_block=min(8, pages // jsplits))
    contenders = {f"ours:auto({variant} x{splits})": ours, "ours:grouped": grouped,
                  f"ours:split x{max(2, splits)}": split, "jax_pallas_paged": theirs}
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


def _timed(name, fn, args, batch, ctx, nbytes, iters) -> dict:
    try:
        sec = timeit(fn, *args, iters=iters)
        return dict(name=name, batch=batch, ctx=ctx, ms=sec * 1e3, gbps=nbytes / sec / 1e9)
    except Exception as e:  # one failing contender must not lose the whole table
        return dict(name=name, batch=batch, ctx=ctx, error=f"{type(e).__name__}: {e}"[:300])


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

    t0 = time.perf_counter()
    copy_gbps = copy_bandwidth(args.iters)
    print(f"device {jax.devices()[0].device_kind}: copy bandwidth {copy_gbps:.0f} GB/s")
    checks = validate()
    rows = []
    for batch, ctx in shapes:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"time budget spent; skipped shapes from ({batch}, {ctx}) on")
            break
        rows += bench_one(batch, ctx, args.iters)
        print(table(rows[-5:], copy_gbps).split("\n", 1)[1], flush=True)
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
