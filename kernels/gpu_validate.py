"""The correctness half of `make gpu-check`: every kernel variant against the jnp reference.

Both decode and ragged kernels, every variant, for SmolLM2's heads (9/3, D = 64) and a
Llama-like config (32/8, D = 128) in fp32 and bf16, on int8 / fp8 pages with scales, and at
Gemma 3's shape (4/1, D = 256) with a sliding window; the weight-only int8 / int4 matmul. A
failure is a row with ok=False (the
rest of the report is still written). Off GPU the kernels run in interpret mode, which is how
the tests exercise this file.
"""

from __future__ import annotations

import functools

BLOCK = 16
CHECK_CONFIGS = ((9, 3, 64), (32, 8, 128))


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
                run = functools.partial(decode_attention, *args, variant=variant, num_splits=4)
                rows.append(_check("decode", variant, nq, h, d, dtype, run, ref, tol))
            args = random_ragged_inputs(key, 8, nq, h, d, BLOCK, 16, 16, dtype)
            ref = ragged_reference(*args, max_q=16)
            for variant in ("grouped", "dot"):
                run = functools.partial(ragged_paged_attention, *args, max_q=16, variant=variant)
                rows.append(_check("ragged", variant, nq, h, d, dtype, run, ref, tol))
        for kind in ("int8", "fp8"):  # stored pages with group scales, f32 queries
            q, k, v, *rest = random_decode_inputs(key, 8, nq, h, d, BLOCK, 16, jnp.float32)
            args = (q, stored_pages(k, kind), stored_pages(v, kind), *rest)
            ref = decode_reference(*args)
            for variant in ("grouped", "dot", "split"):
                run = functools.partial(decode_attention, *args, variant=variant, num_splits=4)
                rows.append(_check("decode", variant, nq, h, d, kind, run, ref, 2e-3))
    return rows + validate_window(key) + validate_quant_matmul()


def validate_quant_matmul() -> list[dict]:
    """The weight-only int8 / int4 matmul (kernels/quant_matmul.py) at batch 1, 16 and 64
    on a Qwen2.5-1.5B-sized projection (1536 -> 8960), fp32 and bf16, vs its reference."""
    import jax.numpy as jnp
    import numpy as np

    from kernels import quant_matmul as qm

    rows, rng = [], np.random.default_rng(0)
    w = rng.standard_normal((8960, 1536), np.float32) / 40
    for weights in ("int8", "int4"):
        qw = qm.quantize(w, weights)
        for m in (1, 16, 64):
            for dtype in (jnp.float32, jnp.bfloat16):
                x = jnp.asarray(rng.standard_normal((m, 1536), np.float32), dtype)
                tol = 2e-3 if dtype == jnp.float32 else 6e-2
                rows.append(_check("matmul", weights, m, 1, 1536, dtype,
                                   lambda x=x, qw=qw: qm.quant_matmul(x, qw),
                                   qm.reference(x, qw), tol))
    return rows


def validate_window(key, nseq: int = 8, window: int = 40) -> list[dict]:
    """Gemma 3's local layers (4 query heads, 1 KV head, D = 256) with a sliding window over
    contexts up to 256 tokens: every decode and ragged variant against the reference."""
    import jax
    import jax.numpy as jnp

    from kernels.paged_attention import decode_attention, random_decode_inputs
    from kernels.ragged_paged_attention import ragged_paged_attention, random_ragged_inputs
    from kernels.reference import ragged_reference

    nq, h, d, rows = 4, 1, 256, []
    scale = d ** -0.5
    args = random_decode_inputs(key, nseq, nq, h, d, BLOCK, 16, jnp.float32)
    starts = jnp.arange(nseq + 1, dtype=jnp.int32)
    # jitted: run eagerly, the reference compiles op by op (slow in the interpreter's tests)
    ref = jax.jit(functools.partial(ragged_reference, max_q=1, scale=scale, window=window))(
        *args, starts)
    for variant in ("grouped", "dot", "split"):
        run = functools.partial(decode_attention, *args, variant=variant, num_splits=4,
                                window=window)
        rows.append(_check("decode", variant, nq, h, d, f"f32 w{window}", run, ref, 2e-3))
    args = random_ragged_inputs(key, nseq, nq, h, d, BLOCK, 16, 16, jnp.float32)
    ref = jax.jit(functools.partial(ragged_reference, max_q=16, scale=scale,
                                    window=window))(*args)
    for variant in ("grouped", "dot"):
        run = functools.partial(ragged_paged_attention, *args, max_q=16, variant=variant,
                                window=window)
        rows.append(_check("ragged", variant, nq, h, d, f"f32 w{window}", run, ref, 2e-3))
    return rows


def stored_pages(x, kind: str, groups: int = 2):
    """Float pages (NaN in free slots) as int8 values or fp8 bits with `groups` scales per
    token (1/32, 1/64, ...: each group of D / groups values its own), NaN scales where the
    values were NaN: what an int8 / fp8 cache holds (kernels/pages.py)."""
    import jax
    import jax.numpy as jnp

    from kernels.pages import Pages

    free = jnp.isnan(x).any(-1)[..., None]
    per_group = 1 / (32 * 2.0 ** jnp.arange(groups))
    scale = jnp.where(free, jnp.nan, per_group)  # [H, N, K, Z]
    spread = jnp.repeat(per_group, x.shape[-1] // groups)
    y = jnp.nan_to_num(x) / spread
    if kind == "int8":
        return Pages(jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale,
                     jnp.dtype(jnp.int8))
    bits = jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)
    return Pages(bits, scale, jnp.dtype(jnp.float8_e4m3fn))


def _check(kind, variant, nq, h, d, dtype, run, ref, tol) -> dict:
    """Runs `run()` and compares with `ref`; a compile or run error is a failed check (the
    rest of the report is still written)."""
    import jax.numpy as jnp

    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    row = dict(kind=kind, variant=variant, heads=f"{nq}/{h}", d=d, dtype=name)
    try:
        out = run()
    except Exception as e:
        row.update(ok=False, max_err=None, error=f"{type(e).__name__}: {e}"[:300])
        print(f"check {kind:6} {variant:8} {nq:2d}/{h} D={d:3d} FAIL {row['error']}", flush=True)
        return row
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    ok = bool(jnp.all(jnp.isfinite(out))) and err < tol
    row.update(max_err=err, ok=ok)
    print(f"check {kind:6} {variant:8} {nq:2d}/{h} D={d:3d} {row['dtype']:8} "
          f"err={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return row
