"""Every kernel on quantized and bit-stored pages (kernels/pages.py) against the jnp reference.

Pallas runs in interpret mode here; its Triton lowering is checked for CUDA on the CPU.
Free blocks hold NaN values (float pages) or NaN scales (int8 / fp8 pages), so a kernel that
reads a slot no sequence may see fails.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_attention
from kernels.paged_attention import decode_attention, decode_reference
from kernels.pages import Pages
from kernels.ragged_paged_attention import ragged_paged_attention
from paged_jax import compile_cache
from paged_jax.cache import kv_quant
from paged_jax.models.attention import ragged_reference
from tests.cuda_lowering import cuda_lowering
from tests.test_kernels import MAX_Q, assert_close, decode_args, layouts, make_batch

NAMES = ["bfloat16", "int8", "fp8", "fp8_e5m2"]


def tol(variant: str, name: str) -> float:
    """tl.dot multiplies bfloat16 pages in bfloat16 (q rounded too); the rest is in float32."""
    return 3e-2 if variant == "dot" and name == "bfloat16" else 1e-5


def stored(x: jnp.ndarray, name: str, bits: bool = True) -> Pages:
    """Float pages (NaN where nothing may be read) as a cache of `name` stores them."""
    dt = kv_quant.storage_dtype(name, jnp.float32)
    conv = (lambda y: kv_quant.to_bits(y, dt)) if bits else (lambda y: y.astype(dt))  # noqa: E731
    if not kv_quant.is_quantized(dt):
        return Pages(conv(x), None, dt)
    # Two scales per row (groups of D / 2), so the kernels' group spreading is exercised.
    vals, scale = kv_quant.quantize(jnp.nan_to_num(x), dt, group=x.shape[-1] // 2)
    return Pages(conv(vals), jnp.where(jnp.isnan(x).any(-1)[..., None], jnp.nan, scale), dt)


def quant_batch(lay, name, bits=True, nq=6, h=2, d=16, block=8, max_q=1):
    q, k, v, *rest = make_batch(lay, nq, h, d, block, max_q)
    return (q, stored(k, name, bits), stored(v, name, bits), *rest)


@pytest.mark.parametrize("variant", ["grouped", "dot", "split"])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_pallas_decode_reads_stored_pages(variant, name, data):
    block = 16 if variant == "dot" else 8
    args = decode_args(quant_batch(data.draw(layouts(block, 1)), name, block=block))
    out = decode_attention(*args, variant=variant, num_splits=2, scale=0.25)
    assert_close(out, decode_reference(*args, scale=0.25), tol=tol(variant, name))


@pytest.mark.parametrize("variant", ["grouped", "dot"])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_pallas_ragged_reads_stored_pages(variant, name, data):
    block = 16 if variant == "dot" else 8
    batch = quant_batch(data.draw(layouts(block, MAX_Q)), name, block=block, max_q=MAX_Q)
    ref = ragged_reference(*batch, max_q=MAX_Q, scale=0.25)
    out = ragged_paged_attention(*batch, max_q=MAX_Q, variant=variant, scale=0.25)
    assert_close(out, ref, tol=tol(variant, name))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_cpu_kernel_reads_bits_as_their_dtype(name, data):
    """Pages kept as uint16 / uint8 bits give exactly what the typed pages give."""
    assert cpu_attention.load(str(compile_cache.kernel_folder()))
    lay = data.draw(layouts(8, MAX_Q))
    typed = quant_batch(lay, name, bits=False, max_q=MAX_Q)
    as_bits = quant_batch(lay, name, bits=True, max_q=MAX_Q)
    assert as_bits[1].values.dtype != typed[1].values.dtype or name == "int8"
    run = functools.partial(cpu_attention.paged_attention, scale=0.25)
    got = np.asarray(run(*as_bits))
    np.testing.assert_array_equal(got, np.asarray(run(*typed)))
    assert_close(got, ragged_reference(*typed, max_q=MAX_Q, scale=0.25), tol=1e-5)


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_cpu_kernel_decodes_every_fp8_code_exactly(name):
    """One visible token: the output is that token's V row, so every finite fp8 code must come
    back as jnp decodes it (the kernel decodes fp8 with integer arithmetic, not a table)."""
    assert cpu_attention.load(str(compile_cache.kernel_folder()))
    dt = kv_quant.storage_dtype(name, jnp.float32)
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(codes), dt),
                                    np.float32))
    row = np.where(finite, codes, 0).astype(np.uint8)  # [D = 256]
    vals = np.zeros((1, 2, 4, 256), np.uint8)
    vals[0, 1, 0] = row
    pages = Pages(jnp.asarray(vals), jnp.full((1, 2, 4, 1), 0.5, jnp.float32), dt)
    q = jnp.zeros((1, 1, 256), jnp.float32)
    ints = [jnp.asarray(x, jnp.int32) for x in ([[1]], [1], [0, 1])]
    out = np.asarray(cpu_attention.paged_attention(q, pages, pages, *ints, scale=1.0))
    want = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(row), dt), np.float32) * 0.5
    np.testing.assert_array_equal(out[0, 0], want)


@pytest.mark.parametrize("name", NAMES)
def test_quantized_kernels_lower_for_triton(name):
    """Bits viewed and scales applied inside the kernels pass Triton's lowering rules."""
    nseq, pages, nq, h, d, block = 4, 8, 9, 3, 64, 16
    spec = jax.ShapeDtypeStruct
    dt = kv_quant.storage_dtype(name, jnp.float32)
    shape = (h, nseq * pages + 1, block, d)
    vals = spec(shape, kv_quant.bits_dtype(dt))
    groups = kv_quant.num_groups(d)  # 2 at SmolLM2's head_dim
    scale = spec((*shape[:-1], groups), jnp.float32) if kv_quant.is_quantized(dt) else None
    ints = [spec((nseq, pages), jnp.int32), spec((nseq,), jnp.int32)]

    def lower(fn, q, *rest) -> str:
        def call(q, vals, scale, *rest):
            kv = Pages(vals, scale, dt)
            return fn(q, kv, kv, *rest)
        with cuda_lowering():
            return jax.jit(call).trace(q, vals, scale, *rest).lower(
                lowering_platforms=("cuda",)).as_text()

    for q_dtype in (jnp.float32, jnp.bfloat16):
        for variant in ("grouped", "split", "dot"):
            fn = functools.partial(decode_attention, variant=variant, num_splits=2,
                                   interpret=False)
            assert "triton" in lower(fn, spec((nseq, nq, d), q_dtype), *ints).lower()
        for variant in ("grouped", "dot"):
            fn = functools.partial(ragged_paged_attention, max_q=16, variant=variant,
                                   interpret=False)
            text = lower(fn, spec((66, nq, d), q_dtype), *ints, spec((nseq + 1,), jnp.int32))
            assert "triton" in text.lower()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_gpu_check_quantized_inputs(kind):
    """`make gpu-check` validates the kernels on int8 / fp8 pages built by `stored_pages`."""
    from kernels.gpu_validate import stored_pages
    from kernels.paged_attention import random_decode_inputs

    q, k, v, *rest = random_decode_inputs(jax.random.PRNGKey(0), 3, 6, 2, 16, 8, 4, jnp.float32)
    pages = stored_pages(k, kind)
    assert pages.values.dtype == (jnp.int8 if kind == "int8" else jnp.uint8)
    args = (q, pages, stored_pages(v, kind), *rest)
    assert_close(decode_attention(*args, variant="split", num_splits=2), decode_reference(*args),
                 tol=1e-5)
