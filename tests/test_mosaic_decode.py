"""The Mosaic GPU decode kernel (kernels/mosaic_decode.py) on CPU: its interpret mode against
the jnp reference (TMA copies, barriers, the pipeline over page slots, masking, splits; the
wgmma products run as jnp dots there), and its CUDA lowering, which runs Mosaic GPU's own
layout and shared-memory rules.

Mosaic GPU's interpreter runs JAX operations inside its callbacks: anything dispatched while
an interpreted kernel runs queues behind it on the CPU device and never runs (a deadlock
seen in the full suite). So each test computes its reference first and waits for the
kernel's result (`run`) before dispatching anything else."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import dispatch
from kernels.mosaic_decode import mosaic_decode_attention, smem_bytes, supported
from kernels.paged_attention import decode_reference
from kernels.reference import ragged_reference
from tests.test_kernels import S, assert_close, decode_args, layouts, make_batch

BF16_TOL = 3e-2


def run(fn, *args, **kw):
    """`fn` on its own: nothing else queued while the interpreter runs (module docstring)."""
    return jax.block_until_ready(fn(*args, **kw))


def bf16_decode_batch(lay, nq=8, h=2, d=64):
    return decode_args(make_batch(lay, nq, h, d, 16, 1, jnp.bfloat16))


@pytest.mark.parametrize("splits,per_step", [(1, 4), (2, 4)])
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_matches_reference(splits, per_step, data):
    """Random lengths (0 = padding row), shuffled pools, NaN in every slot no sequence sees:
    the tails of last pages included, which the kernel zeroes in shared memory."""
    args = jax.block_until_ready(bf16_decode_batch(data.draw(layouts(16, 1))))
    ref = jax.block_until_ready(decode_reference(*args))
    out = run(mosaic_decode_attention, *args, num_splits=splits, pages_per_step=per_step)
    assert_close(out, ref, BF16_TOL)


def test_window_and_free_blocks():
    """A sliding window skips whole steps and masks inside one; the data in slots nobody
    sees (NaN, 0 or large) cannot change a bit of the output."""
    lay = dict(lens=np.array([64, 37, 0]), num_q=np.array([1, 1, 0]),
               perm=np.arange(1, S * 4 + 4), share=False, seed=3)
    outs = []
    for fill in (np.nan, 0.0, 1e4):
        args = decode_args(make_batch(lay, 8, 2, 64, 16, 1, jnp.bfloat16, fill=fill))
        starts = jnp.arange(S + 1, dtype=jnp.int32)
        ref = jax.block_until_ready(
            ragged_reference(*args, starts, max_q=1, scale=64**-0.5, window=20))
        out = run(mosaic_decode_attention, *args, pages_per_step=4, window=20)
        assert_close(out, ref, BF16_TOL)
        outs.append(np.asarray(out.astype(jnp.float32)))
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0], other)
    assert not outs[0][2].any()  # the padding row's output is zeros


def test_dispatch_runs_it_when_asked():
    lay = dict(lens=np.array([50, 64, 3]), num_q=np.array([1, 1, 1]),
               perm=np.arange(1, S * 4 + 4), share=True, seed=5)
    batch = jax.block_until_ready(make_batch(lay, 8, 2, 64, 16, 1, jnp.bfloat16))
    ref = jax.block_until_ready(ragged_reference(*batch, max_q=1, scale=0.125))
    out = run(dispatch.paged_attention, *batch, max_q=1, scale=0.125, decode_kernel="mosaic")
    assert_close(out, ref, BF16_TOL)


def test_refuses_what_it_cannot_take():
    assert supported(jnp.bfloat16, 128, 16, 4, 8) is None
    assert "float32" in supported(jnp.float32, 128, 16, 4, 8)
    assert "head_dim 96" in supported(jnp.bfloat16, 96, 16, 4, 8)
    assert "multiple of 64" in supported(jnp.bfloat16, 128, 16, 4, 3)
    assert "shared memory" in supported(jnp.bfloat16, 256, 16, 4, 8)
    assert smem_bytes(128, 128, 2) < 232448
    z = jnp.zeros
    with pytest.raises(ValueError, match="float32"):
        mosaic_decode_attention(z((1, 8, 64)), z((2, 5, 16, 64)), z((2, 5, 16, 64)),
                                z((1, 4), jnp.int32), z((1,), jnp.int32))


@pytest.mark.parametrize("nq,h,d,splits,per_step,stages,window", [
    (32, 8, 128, 1, 8, 2, None), (32, 8, 64, 4, 8, 2, None), (9, 3, 64, 1, 4, 3, None),
    (32, 8, 128, 2, 4, 3, 512), (16, 1, 64, 1, 8, 2, None)])
def test_lowers_for_cuda(nq, h, d, splits, per_step, stages, window):
    """Lowering for CUDA on CPU runs Mosaic GPU's rules: wgmma operand layouts, TMA
    tiling and swizzle, the shared-memory budget."""
    spec = jax.ShapeDtypeStruct
    pool = spec((h, 300, 16, d), jnp.bfloat16)
    fn = functools.partial(mosaic_decode_attention, num_splits=splits, pages_per_step=per_step,
                           stages=stages, window=window, interpret=False)
    text = jax.jit(fn).trace(spec((4, nq, d), jnp.bfloat16), pool, pool,
                             spec((4, 64), jnp.int32), spec((4,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
