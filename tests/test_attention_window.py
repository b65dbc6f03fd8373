"""Sliding-window attention (Gemma 3's local layers) on every backend against the naive oracle.

A query at position i sees keys i - window + 1 .. i. Freed blocks hold NaN, and keys before
a window are real data that must get zero weight, so a kernel that reads past either fails.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import dispatch
from paged_jax.models.attention import cpu_kernel_available, paged_attention
from tests.attention_helpers import jitted, naive
from tests.test_attention import MAX_Q, K, P, batches

SCALE = 0.3
windows = st.integers(1, P * K + 1)


def _decode_only(batch):
    """The batch with at most one query per row (the decode kernels' contract)."""
    q, k, v, tables, lens, qs = batch
    n = np.minimum(np.diff(qs), 1)
    return q, k, v, tables, lens, np.concatenate([[0], np.cumsum(n)]).astype(np.int32)


def _check(got, batch, window, tol=1e-5):
    want = naive(*batch, SCALE, window=window)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(batch=batches(), window=windows, rows=st.sampled_from([None, 1, 2]))
def test_reference_window(batch, window, rows):
    """Both reference paths: query tiles (prefill rows) and the flat decode list."""
    if rows is not None:
        batch = _decode_only(batch)
    got = jitted(paged_attention, max_q=MAX_Q, scale=SCALE, max_q_rows=rows, window=window)(
        *(jnp.asarray(x) for x in batch))
    _check(got, batch, window)


@pytest.mark.skipif(not cpu_kernel_available(), reason="C++ kernel did not build")
@settings(max_examples=30, deadline=None)
@given(batch=batches(), window=windows)
def test_cpu_kernel_window(batch, window):
    got = paged_attention(*(jnp.asarray(x, jnp.float32) if i < 3 else jnp.asarray(x)
                            for i, x in enumerate(batch)),
                          max_q=MAX_Q, backend="cpu", scale=SCALE, window=window)
    _check(got, batch, window, tol=2e-5)


@settings(max_examples=8, deadline=None)
@given(batch=batches(), window=windows, decode=st.booleans())
def test_pallas_window(batch, window, decode):
    """The ragged kernel (max_q > 1) and the decode kernel (max_q = 1), interpret mode."""
    if decode:
        batch = _decode_only(batch)
    args = [jnp.asarray(x, jnp.float32) if i < 3 else jnp.asarray(x)
            for i, x in enumerate(batch)]
    got = dispatch.paged_attention(*args, max_q=1 if decode else MAX_Q, scale=SCALE,
                                   window=window)
    _check(got, batch, window, tol=2e-5)


def test_window_changes_the_output():
    """The oracle itself: a window shorter than the context must matter."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8))
    k = rng.standard_normal((1, 3, 4, 8))
    v = rng.standard_normal((1, 3, 4, 8))
    tables, lens, qs = np.array([[1, 2]]), np.array([8]), np.array([0, 1])
    full = naive(q, k, v, tables, lens, qs, SCALE)
    assert np.abs(naive(q, k, v, tables, lens, qs, SCALE, window=3) - full).max() > 1e-3
    np.testing.assert_allclose(naive(q, k, v, tables, lens, qs, SCALE, window=8), full)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_kernels_lower_for_triton(dtype):
    """Gemma 3's shape (4 query heads, 1 KV head, D = 256) with a window, lowered for CUDA on
    the CPU: the Pallas->Triton rules hold for the dynamic loop start and the window mask."""
    import functools

    import jax

    from kernels.paged_attention import decode_attention
    from kernels.ragged_paged_attention import ragged_paged_attention

    nq, h, d, block, nseq, pages = 4, 1, 256, 16, 4, 8
    spec = jax.ShapeDtypeStruct
    kv = spec((h, nseq * pages + 1, block, d), dtype)
    tables, lens = spec((nseq, pages), jnp.int32), spec((nseq,), jnp.int32)
    from tests.cuda_lowering import cuda_lowering
    from tests.test_kernels import assert_one_triton_kernel

    with cuda_lowering():
        for variant in ("grouped", "split", "dot"):
            fn = functools.partial(decode_attention, variant=variant, num_splits=2, window=40,
                                   interpret=False)
            text = jax.jit(fn).trace(spec((nseq, nq, d), dtype), kv, kv, tables, lens).lower(
                lowering_platforms=("cuda",)).as_text()
            assert_one_triton_kernel(text, f"paged_decode_{variant}")
        for variant in ("grouped", "dot"):
            fn = functools.partial(ragged_paged_attention, max_q=16, variant=variant, window=40,
                                   interpret=False)
            text = jax.jit(fn).trace(spec((nseq * 16, nq, d), dtype), kv, kv, tables, lens,
                                     spec((nseq + 1,), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
            assert_one_triton_kernel(text, f"ragged_paged_attention_{variant}")


def test_gpu_check_validates_windows():
    """`make gpu-check`'s window rows run (here in interpret mode) and pass."""
    import jax

    from kernels.gpu_validate import validate_window

    rows = validate_window(jax.random.PRNGKey(1), nseq=2)
    # five Triton decode cases, two ragged variants, Mosaic GPU with one split and two
    assert len(rows) == 9 and all(r["ok"] for r in rows), rows
    assert {r["variant"] for r in rows if r["kind"] == "decode"} >= {"dot c2", "mosaic x2 w40"}
