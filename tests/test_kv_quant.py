"""KV quantization primitives: dtype names, error bounds of int8 / fp8 rows, bytes per block."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from paged_jax.cache import kv_quant as kq
from tests.attention_helpers import jitted


def test_dtype_names():
    assert kq.storage_dtype("auto", jnp.bfloat16) == jnp.dtype(jnp.bfloat16)
    assert kq.storage_dtype("fp8", jnp.float32) == jnp.dtype(jnp.float8_e4m3fn)
    assert kq.is_quantized(kq.storage_dtype("int8", jnp.float32))
    assert not kq.is_quantized(kq.storage_dtype("bfloat16", jnp.float32))
    with pytest.raises(ValueError, match="kv_cache_dtype='int3' is not supported; expected"):
        kq.storage_dtype("int3", jnp.float32)


def test_quantized_blocks_hold_over_3_5x_an_fp32_block():
    fp32 = kq.bytes_per_token_head(jnp.float32, 64)
    for name in ("int8", "fp8", "fp8_e5m2"):
        assert fp32 / kq.bytes_per_token_head(kq.storage_dtype(name, jnp.float32), 64) >= 3.5
    assert fp32 / kq.bytes_per_token_head(jnp.bfloat16, 64) == 2


rows = arrays(np.float32, st.tuples(st.integers(1, 6), st.sampled_from([1, 8, 12, 40, 64, 96])),
              elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=60, deadline=None)
@given(x=rows, name=st.sampled_from(["int8", "fp8", "fp8_e5m2"]))
def test_roundtrip_error_is_bounded_per_group(x, name):
    dt = kq.storage_dtype(name, jnp.float32)
    q, scale = jitted(kq.quantize, dtype=dt)(jnp.asarray(x))
    group = kq.group_size(x.shape[-1])
    assert scale.shape == (x.shape[0], x.shape[1] // group) and group <= kq.GROUP
    back = np.asarray(jitted(kq.dequantize)(q, scale))
    # each group's own range: a loud group does not coarsen its quiet neighbours
    amax = np.repeat(np.abs(x).reshape(x.shape[0], -1, group).max(-1), group, axis=-1)
    assert np.all(np.isfinite(back))
    # int8: half a step of amax / 127; fp8: the mantissa's relative step, or the subnormal
    # step below the smallest normal, of amax / qmax.
    mant = {"int8": None, "fp8": 2.0**-4, "fp8_e5m2": 2.0**-3}[name]
    bound = (amax / 127 / 2 if mant is None
             else np.abs(x) * mant + amax / kq.QMAX[jnp.dtype(dt)] * 2.0**-6)
    assert np.all(np.abs(back - x) <= bound * 1.001 + 1e-6)
    zero = np.asarray(kq.dequantize(*kq.quantize(jnp.zeros((2, 8)), dt)))
    assert not zero.any()


def test_per_token_scales_beat_per_block_scales_on_uneven_tokens():
    rng = np.random.default_rng(0)
    t, h, d = 64, 2, 64
    mags = np.exp(rng.normal(0, 1.0, (t, 1, 1)))  # token norms vary, as real K/V do
    k = (rng.standard_normal((t, h, d)) * mags).astype(np.float32)
    v = (rng.standard_normal((t, h, d)) * mags).astype(np.float32)
    rows = {(r["dtype"], r["granularity"]): r
            for r in kq.measure_granularity(k, v, np.repeat(k, 2, axis=1), 16)}
    for name in ("int8", "fp8"):
        grp, tok, blk = (rows[(name, g)] for g in ("group", "token", "block"))
        assert tok["k_rel_err"] < blk["k_rel_err"] and tok["attn_rel_err"] <= blk["attn_rel_err"]
        assert grp["k_rel_err"] <= tok["k_rel_err"]


@pytest.mark.slow
def test_granularity_and_claim_on_smollm2():
    from experiments import kv_quantization as kq_exp
    from paged_jax.models import load_model

    rows = kq_exp.granularity(load_model(), tokens=64)
    assert {(r["dtype"], r["granularity"]) for r in rows} == {
        (d, g) for d in ("int8", "fp8") for g in ("group", "token", "block")}
    by = {(r["dtype"], r["granularity"]): r for r in rows}
    assert 0 < by[("int8", "token")]["attn_rel_err"] < 0.05
    assert by[("int8", "token")]["k_rel_err"] < by[("int8", "block")]["k_rel_err"]
    assert by[("int8", "group")]["k_rel_err"] < by[("int8", "token")]["k_rel_err"]
    mem = [dict(dtype=d, bytes_per_block=b) for d, b in (("bfloat16", 136), ("int8", 68))]
    agree = [dict(dtype="int8", identical=15, prompts=16)]
    quality = [dict(dtype="float32", perplexity=10.0), dict(dtype="int8", perplexity=10.05)]
    assert kq_exp.claim(mem, agree, quality)["holds"]
    quality[1]["perplexity"] = 10.5  # 5% worse: the claim must fail
    assert not kq_exp.claim(mem, agree, quality)["holds"]


def test_int8_rotation_is_orthonormal_and_helps_outlier_channels():
    h = kq.rotation(jnp.int8, 64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    assert kq.rotation(kq.storage_dtype("fp8", jnp.float32), 64) is None
    assert kq.rotation(jnp.int8, 48) is None and kq.rotation(jnp.float32, 64) is None
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, :2] *= 30  # two loud channels, as keys have
    plain = np.abs(np.asarray(kq.roundtrip(jnp.asarray(x), jnp.int8)) - x).mean()
    spun = np.abs(np.asarray(kq.roundtrip(jnp.asarray(x @ h), jnp.int8)) @ h.T - x).mean()
    assert spun < 0.5 * plain


def test_rows_of_tiny_values_stay_finite():
    """Found by hypothesis: amax / qmax below float32's smallest normal flushed to a zero
    scale on XLA:CPU, and 0 / 0 gave NaN."""
    x = jnp.asarray([[4.9026885e-34, 0.0], [1e-40, -3e-39]], jnp.float32)
    for name in ("int8", "fp8", "fp8_e5m2"):
        back = np.asarray(kq.dequantize(*kq.quantize(x, kq.storage_dtype(name, jnp.float32))))
        assert np.all(np.isfinite(back)) and np.abs(back - np.asarray(x)).max() < 1e-30, name
