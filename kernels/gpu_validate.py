"""The correctness half of `make gpu-check`: every kernel variant against the jnp reference.

Both decode and ragged kernels, every variant (Triton: one page or several a step, with and
without splits; Mosaic GPU in bf16), for SmolLM2's heads (9/3, D = 64) and a Llama-like
config (32/8, D = 128) in fp32 and bf16, on int8 / fp8 pages with scales, and at Gemma 3's
shape (4/1, D = 256) with a sliding window (Mosaic: at 32/8 with a window); the weight-only
int8 / int4 matmul; the batched LoRA delta. A failure is a row with ok=False (the rest of
the report is still written). Off GPU the kernels run in interpret mode, which is how the
tests exercise this file (`quick=True`: the decode and ragged rows only).
"""

from __future__ import annotations

import functools
import os

BLOCK = 16
CHECK_CONFIGS = ((9, 3, 64), (32, 8, 128))


# (variant, pages per step, splits) of the Triton decode kernel checked in every config
DECODE_CASES = (("grouped", 1, 1), ("dot", 1, 1), ("split", 1, 4), ("dot", 4, 1),
                ("split_dot", 2, 2))


def validate(quick: bool = False) -> list[dict]:
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
            for variant, per_step, splits in DECODE_CASES:
                run = functools.partial(decode_attention, *args, variant=variant,
                                        num_splits=splits, pages_per_step=per_step)
                rows.append(_check("decode", f"{variant} c{per_step}", nq, h, d, dtype, run,
                                   ref, tol))
            if dtype == jnp.bfloat16 and not skip_mosaic():
                rows += validate_mosaic(args, ref, nq, h, d, tol)
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
    if quick:
        return rows
    return rows + validate_window(key) + validate_quant_matmul() + validate_lora()


def skip_mosaic() -> bool:
    """Set by the GPU check when its canary found Mosaic GPU hanging or failing here: the
    canary's result is the report, and the other checks still run."""
    return os.environ.get("PAGED_JAX_SKIP_MOSAIC") == "1"


def validate_mosaic(args, ref, nq: int, h: int, d: int, tol: float,
                    window: int | None = None) -> list[dict]:
    """The Mosaic GPU decode kernel (kernels/mosaic_decode.py) on bf16 pages: one split and
    two, 4 pages a step (64 tokens)."""
    import jax.numpy as jnp

    from kernels.mosaic_decode import mosaic_decode_attention

    rows = []
    for splits in (1, 2):
        run = functools.partial(mosaic_decode_attention, *args, num_splits=splits,
                                pages_per_step=4, window=window)
        name = f"mosaic x{splits}" + (f" w{window}" if window else "")
        rows.append(_check("decode", name, nq, h, d, jnp.bfloat16, run, ref, tol))
    return rows


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
    contexts up to 256 tokens: every decode and ragged variant against the reference; then
    Mosaic GPU with a window at 32/8, D = 128 (its shared memory holds D <= 128)."""
    import jax
    import jax.numpy as jnp

    from kernels.paged_attention import decode_attention, max_pages_per_step, random_decode_inputs
    from kernels.ragged_paged_attention import ragged_paged_attention, random_ragged_inputs
    from kernels.reference import ragged_reference

    nq, h, d, rows = 4, 1, 256, []
    starts = jnp.arange(nseq + 1, dtype=jnp.int32)

    def reference(args, max_q: int, dim: int):
        # jitted: run eagerly, the reference compiles op by op (slow in the interpreter)
        return jax.jit(functools.partial(ragged_reference, max_q=max_q, scale=dim**-0.5,
                                         window=window))(*args)

    args = random_decode_inputs(key, nseq, nq, h, d, BLOCK, 16, jnp.float32)
    ref = reference((*args, starts), 1, d)
    for variant, per_step, splits in DECODE_CASES:
        per_step = min(per_step, max_pages_per_step(BLOCK, d, jnp.float32))
        run = functools.partial(decode_attention, *args, variant=variant, num_splits=splits,
                                pages_per_step=per_step, window=window)
        rows.append(_check("decode", f"{variant} c{per_step}", nq, h, d, f"f32 w{window}",
                           run, ref, 2e-3))
    args = random_ragged_inputs(key, nseq, nq, h, d, BLOCK, 16, 16, jnp.float32)
    ref = reference(args, 16, d)
    for variant in ("grouped", "dot"):
        run = functools.partial(ragged_paged_attention, *args, max_q=16, variant=variant,
                                window=window)
        rows.append(_check("ragged", variant, nq, h, d, f"f32 w{window}", run, ref, 2e-3))
    if not skip_mosaic():
        args = random_decode_inputs(key, nseq, 32, 8, 128, BLOCK, 16, jnp.bfloat16)
        rows += validate_mosaic(args, reference((*args, starts), 1, 128), 32, 8, 128, 3e-2,
                                window)
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


def validate_lora() -> list[dict]:
    """The batched LoRA delta (kernels/lora_pallas.py) on SmolLM2's q|k|v projection, 16
    slots of rank 16, 64 tokens over 16 adapters and the base model, fp32 and bf16, against
    kernels/cpu_lora.reference (numpy, float64)."""
    import jax.numpy as jnp
    import numpy as np

    from kernels import lora_pallas as lp
    from kernels.cpu_lora import reference

    rows, rng = [], np.random.default_rng(0)
    a = rng.standard_normal((16, 48, 576), np.float32) / 24
    bs = tuple(rng.standard_normal((16, 16, o), np.float32) / 4 for o in (576, 192, 192))
    slots = rng.integers(-1, 16, 64).astype(np.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((64, 576), np.float32), dtype)
        ref = jnp.asarray(reference(np.asarray(x, np.float32), a, bs, slots), jnp.float32)
        args = (x, jnp.asarray(a, dtype), tuple(jnp.asarray(b, dtype) for b in bs),
                jnp.asarray(slots))
        rows.append(_check("lora", "tiles", 64, 16, 576, dtype,
                           lambda args=args: lp.delta(*args), ref,
                           1e-2 if dtype == jnp.float32 else 0.1))
    return rows


def _check(kind, variant, nq, h, d, dtype, run, ref, tol) -> dict:
    """Runs `run()` and compares with `ref`; a compile or run error is a failed check (the
    rest of the report is still written)."""
    import jax
    import jax.numpy as jnp

    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    row = dict(kind=kind, variant=variant, heads=f"{nq}/{h}", d=d, dtype=name)
    try:
        # Waited for before anything else is dispatched: Mosaic GPU's interpreter (off GPU)
        # runs JAX operations inside its callbacks, which work queued behind it would block.
        out = jax.block_until_ready(run())
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
