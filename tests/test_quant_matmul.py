"""kernels/quant_matmul: the GPU weight-only int8 / int4 matmul (Pallas, Triton) against its
jnp reference in interpret mode, its codes against the weights, and its CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import quant_matmul as qm


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("m, k, n", [(1, 64, 16), (5, 128, 70), (17, 192, 64)])
def test_kernel_matches_the_reference(weights, m, k, n):
    """Rows and columns that are not multiples of the tile (16 x 64) are padded and cut."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = qm.quantize(rng.standard_normal((n, k), np.float32), weights)
    got = np.asarray(qm.quant_matmul(x, w, interpret=True))
    want = np.asarray(qm.reference(x, w))
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_kernel_in_bfloat16():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 128), np.float32), jnp.bfloat16)
    w = qm.quantize(rng.standard_normal((64, 128), np.float32), "int4")
    got = np.asarray(qm.quant_matmul(x, w, interpret=True), np.float32)
    want = np.asarray(qm.reference(x, w), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=0.1)


@pytest.mark.parametrize("weights, levels", [("int8", 254), ("int4", 15)])
def test_codes_stand_for_the_weights(weights, levels):
    """Every weight within half a step of its group's grid (range / levels)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 128), np.float32) * np.linspace(0.1, 3, 128, dtype=np.float32)
    deq = np.asarray(qm.dequantize(qm.quantize(w, weights)))
    g = qm.GROUPS[weights]
    span = w.reshape(40, -1, g).max(-1) - w.reshape(40, -1, g).min(-1)
    if weights == "int8":
        span = 2 * np.abs(w.reshape(40, -1, g)).max(-1)
    step = np.repeat(span / levels, g, axis=1)
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-6)


def test_bad_widths_and_names_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        qm.quantize(np.ones((16, 48), np.float32), "int4")
    with pytest.raises(ValueError, match="one of"):
        qm.quantize(np.ones((16, 64), np.float32), "int2")


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_for_triton(weights, dtype):
    """The kernel passes Triton's lowering rules (what a GPU would compile)."""
    w = qm.quantize(np.ones((128, 256), np.float32), weights)
    x = jax.ShapeDtypeStruct((8, 256), dtype)

    def fn(x, q, scales, mins):  # the weight built inside: trace's stand-ins fail its types
        return qm.quant_matmul(x, qm.QuantWeight(q, scales, mins, w.bits), interpret=False)

    from tests.cuda_lowering import cuda_lowering

    with cuda_lowering():  # w (eager) was built above, outside
        text = jax.jit(fn).trace(x, w.q, w.scales, w.mins).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_quantized_params_run_the_forward():
    """quantize_params (the GPU engine's int4 form; the kernel in interpret mode here): the
    tiny model's logits equal those of its dequantized weights on XLA's dot."""
    from paged_jax.models.llama import quantize_params
    from paged_jax.models.testing import random_params, tiny_config
    from tests.forward_helpers import prefill_logits

    config = tiny_config(tie_word_embeddings=True)
    params = quantize_params(random_params(config), "int4")
    assert isinstance(params["lm_head"], qm.QuantWeight)
    is_q = lambda x: isinstance(x, qm.QuantWeight)  # noqa: E731
    deq = jax.tree.map(lambda x: qm.dequantize(x) if is_q(x) else x, params, is_leaf=is_q)
    logits = prefill_logits(config)
    np.testing.assert_allclose(logits(params), logits(deq), rtol=1e-4, atol=1e-4)
