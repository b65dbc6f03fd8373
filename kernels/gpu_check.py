"""The kernel half of `make gpu-check` (experiments/gpu_check.py runs it, then the engine).

    PYTHONPATH=. python3 -m kernels.gpu_check [--out DIR] [--budget-s 240] [--dry-run]

1. the device's copy bandwidth (read + write of 2 GiB): the limit decode attention meets;
2. every kernel variant against the jnp reference (kernels/gpu_validate.py);
3. decode attention, block 16, bf16 K/V, Llama-like heads (32/8, D = 128), batch 1 / 16 / 64
   x context 1k / 4k / 16k: ours (dispatch's plan on Triton and on Mosaic GPU) beside JAX's
   own `jax.experimental.pallas.ops.gpu.paged_attention` on the same pool and tables (the
   peer), in paired rounds (kernels/gpu_timing.py). At TUNE_SHAPES more contenders run: one
   page a step (the kernels before this check), fewer pages a step, the peer's other split
   count, and dense attention on a contiguous cache (XLA);
4. ragged prefill + decode at one shape (a quarter of the rows bring a 128-token chunk) beside
   dense causal attention (JAX ships no GPU ragged paged kernel).
Reports ms, GB/s of K/V read and % of the copy bandwidth. Without a GPU it prints the plan and
exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

BATCHES = (1, 16, 64)
CONTEXTS = (1024, 4096, 16384)
TUNE_SHAPES = ((64, 4096), (1, 16384))
TARGET_SHAPE = (64, 4096)  # the target: >= 70% of copy bandwidth, >= 1.2x the peer
RAGGED_SHAPE = (16, 4096)
BLOCK = 16
BENCH_HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3-8B-like)
PREFILL_CHUNK = 128  # query tokens of the prefill rows of a ragged step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing after this")
    ap.add_argument("--dry-run", action="store_true", help="print the grid, touch no device")
    return ap.parse_args(argv)


def kv_bytes(batch: int, ctx: int, h: int = BENCH_HEADS[1], d: int = BENCH_HEADS[2]) -> int:
    """Bytes of bf16 K and V a decode step reads for batch x ctx tokens."""
    return 2 * batch * ctx * h * d * 2


def grid() -> list[tuple[int, int]]:
    """(batch, context) pairs, the target shape first, then small to large."""
    pairs = sorted(((b, c) for c in CONTEXTS for b in BATCHES), key=lambda bc: bc[0] * bc[1])
    return [TARGET_SHAPE] + [p for p in pairs if p != TARGET_SHAPE]


def has_gpu() -> bool:
    """Whether JAX is installed and sees a GPU."""
    try:
        import jax

        return bool(jax.devices("gpu"))
    except (ImportError, RuntimeError):
        return False


def bench_inputs(batch: int, ctx: int, seed: int = 1):
    """Paged pool with shuffled pages, queries and lengths (bf16)."""
    import jax
    import jax.numpy as jnp

    nq, h, d = BENCH_HEADS
    pages = ctx // BLOCK
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    n = batch * pages + 1
    k_pages = jax.random.normal(kk, (h, n, BLOCK, d), jnp.bfloat16)
    v_pages = jax.random.normal(kv, (h, n, BLOCK, d), jnp.bfloat16)
    tables = (jax.random.permutation(kp, n - 1) + 1).reshape(batch, pages).astype(jnp.int32)
    lens = jnp.full((batch,), ctx, jnp.int32)
    q = jax.random.normal(kq, (batch, nq, d), jnp.bfloat16)
    return q, k_pages, v_pages, tables, lens


def contiguous(k_pages, tables):
    """[B, T, H, D] copy of the paged K (or V): the dense baseline's cache."""
    h, _, _, d = k_pages.shape
    b, p = tables.shape
    return k_pages[:, tables].reshape(h, b, p * BLOCK, d).transpose(1, 2, 0, 3)


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


def decode_contenders(batch: int, ctx: int, tune: bool) -> dict:
    """{name: jitted fn of (q, k_pages, v_pages, tables, lens)} for one shape; the plan's
    parameters are in the names."""
    import jax

    from kernels import dispatch, mosaic_decode
    from kernels.paged_attention import decode_attention

    nq, h, d = BENCH_HEADS
    pages = ctx // BLOCK
    out = {}
    skip = os.environ.get("PAGED_JAX_SKIP_MOSAIC") == "1"  # the GPU check's canary failed
    for kernel in ("triton",) if skip else ("triton", "mosaic"):
        try:
            plan = dispatch.decode_plan(batch, nq, h, BLOCK, pages, kernel=kernel)
        except ValueError as e:
            out[kernel] = _raiser(e)
            continue
        name = f"{kernel} x{plan.num_splits} c{plan.pages_per_step}"
        out[name] = jax.jit(functools.partial(dispatch.decode, scale=d**-0.5, kernel=kernel))
    out[f"jax_pallas k{_peer_splits(pages)}"] = _jax_paged(pages)
    if tune:
        splits = dispatch.decode_plan(batch, nq, h, BLOCK, pages).num_splits
        one = "split" if splits > 1 else ("dot" if nq // h >= 8 else "grouped")
        out[f"triton:{one} x{splits} c1"] = jax.jit(functools.partial(
            decode_attention, variant=one, num_splits=splits, pages_per_step=1))
        var = "split_dot" if splits > 1 else "dot"
        out[f"triton:{var} x{splits} c4"] = jax.jit(functools.partial(
            decode_attention, variant=var, num_splits=splits, pages_per_step=4))
        if not skip:
            out[f"mosaic x{splits} c4 s3"] = jax.jit(functools.partial(
                mosaic_decode.mosaic_decode_attention, num_splits=splits, pages_per_step=4,
                stages=3))
        alt = 4 if _peer_splits(pages) != 4 else 8
        out[f"jax_pallas k{alt}"] = _jax_paged(pages, alt)
    return out


def _raiser(err: Exception):
    def fail(*_):
        raise err
    return fail


def _peer_splits(pages: int) -> int:
    """JAX's kernel's default k_splits (16) where the pages divide, else the largest that
    does."""
    return next(k for k in (16, 8, 4, 2, 1) if pages % k == 0)


def _jax_paged(pages: int, k_splits: int | None = None):
    """JAX's own Pallas GPU paged_attention (q [B, Q, D], same pool) at its defaults
    (block_h 16, 8 pages a compute block, 8 warps), or a function raising the import error."""
    import jax

    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except ImportError as e:
        return _raiser(e)
    k = k_splits or _peer_splits(pages)
    fn = functools.partial(jax_paged.paged_attention, k_splits=k,
                           pages_per_compute_block=min(8, pages // k))
    return jax.jit(fn)


def bench_decode(batch: int, ctx: int, copy_gbps: float, tune: bool) -> list[dict]:
    """Every contender for one shape in paired rounds; one row each."""
    from kernels.gpu_timing import paired

    q, kp, vp, tables, lens = bench_inputs(batch, ctx)
    fns = decode_contenders(batch, ctx, tune)
    args = {name: (q, kp, vp, tables, lens) for name in fns}
    if tune:
        fns["dense_xla"] = _dense_jit()
        k, v = contiguous(kp, tables), contiguous(vp, tables)
        args["dense_xla"] = (q, k, v, lens)
    nbytes = kv_bytes(batch, ctx)
    res = paired(fns, args, nbytes)
    return [_row("decode", name, batch, ctx, nbytes, r, copy_gbps) for name, r in res.items()]


@functools.cache
def _dense_jit():
    import jax

    return jax.jit(dense_attention)


def _row(kind: str, name: str, batch: int, ctx: int, nbytes: int, r: dict,
         copy_gbps: float) -> dict:
    row = dict(kind=kind, name=name, batch=batch, ctx=ctx, **r)
    if "ms" in r:
        row["gbps"] = nbytes / (r["ms"] / 1e3) / 1e9
        row["pct_copy"] = 100 * row["gbps"] / copy_gbps
    return row


def bench_ragged(batch: int, ctx: int, copy_gbps: float) -> list[dict]:
    """Ragged prefill+decode: the first batch // 4 rows bring PREFILL_CHUNK new tokens, the
    others one; every row's context is ctx. Ours vs dense causal attention. GB/s is
    *effective* (each row's K/V counted once): prefill rows are compute-bound."""
    import jax
    import jax.numpy as jnp

    from kernels import dispatch
    from kernels.gpu_timing import paired

    _, kp, vp, tables, lens = bench_inputs(batch, ctx)
    nq, h, d = BENCH_HEADS
    n_pre = max(1, batch // 4)
    num_q = jnp.where(jnp.arange(batch) < n_pre, PREFILL_CHUNK, 1)
    qs = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_q)]).astype(jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(2), (int(qs[-1]), nq, d), jnp.bfloat16)
    ours = jax.jit(functools.partial(dispatch.paged_attention, max_q=PREFILL_CHUNK,
                                     scale=d**-0.5))
    dense = jax.jit(functools.partial(dense_ragged, n_pre=n_pre, chunk=PREFILL_CHUNK))
    k, v = contiguous(kp, tables), contiguous(vp, tables)
    nbytes = kv_bytes(batch, ctx)
    res = paired({"ours:ragged": ours, "dense_xla:ragged": dense},
                 {"ours:ragged": (q, kp, vp, tables, lens, qs),
                  "dense_xla:ragged": (q, k, v, lens)}, nbytes)
    return [_row("ragged", name, batch, ctx, nbytes, r, copy_gbps) for name, r in res.items()]


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


def run_kernels(budget_s: float, log=print, on_rows=None) -> dict:
    """Copy bandwidth, correctness checks, then decode and ragged timings until the budget
    is spent: dict(copy, checks, rows, skipped). `on_rows(result)` is called after each
    shape (the caller saves partial results)."""
    from kernels.gpu_timing import copy_bandwidth
    from kernels.gpu_validate import validate

    t0 = time.perf_counter()
    copy = copy_bandwidth()
    log(f"copy bandwidth {copy['gbps']:.0f} GB/s (read + write)")
    res = dict(copy=copy, checks=validate(), rows=[], skipped=[])
    res["checks_s"] = time.perf_counter() - t0
    if on_rows:
        on_rows(res)
    for batch, ctx in grid():
        if time.perf_counter() - t0 > budget_s:
            res["skipped"].append([batch, ctx])
            continue
        new = bench_decode(batch, ctx, copy["gbps"], (batch, ctx) in TUNE_SHAPES)
        res["rows"] += new
        log(table(new))
        if on_rows:
            on_rows(res)
    if time.perf_counter() - t0 < budget_s:
        new = bench_ragged(*RAGGED_SHAPE, copy["gbps"])
        res["rows"] += new
        log(table(new))
    res["kernels_s"] = time.perf_counter() - t0
    return res


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        head = f"{r['kind']:6} {r['batch']:4d} {r['ctx']:6d} {r['name']:26}"
        if "error" in r:
            lines.append(f"{head} ERROR {r['error'][:90]}")
        else:
            lines.append(f"{head} {r['ms']:8.3f} ms {r['gbps']:7.0f} GB/s "
                         f"{r['pct_copy']:5.1f}% +-{100 * r['spread']:.0f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"decode grid (batch, ctx), block {BLOCK}, heads {BENCH_HEADS}: {grid()}")
    if args.dry_run:
        return 0
    if not has_gpu():
        print("gpu_check: no GPU visible to JAX (jax.devices('gpu') is empty); nothing to "
              "check. Run on a CUDA machine.", file=sys.stderr)
        return 2
    import jax

    res = run_kernels(args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
    (out / "gpu_kernels.json").write_text(json.dumps(res, indent=1))
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
