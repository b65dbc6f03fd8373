"""kernels/lora_pallas.py: the GPU's batched LoRA delta (Pallas, Triton) against
models/lora_ops' reference in interpret mode, its tiling of any adapter mix, and its lowering
for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import lora_pallas as lp
from kernels.paged_attention import TRITON
from paged_jax.models.lora_ops import lora_delta_reference


def test_tiles_hold_every_token_once_each_tile_one_slot():
    rng = np.random.default_rng(0)
    for t in (1, 5, 16, 33, 70):
        slots = rng.integers(-1, 4, t).astype(np.int32)
        rows, tile_slot = (np.asarray(v) for v in lp.tiles(jnp.asarray(slots), 4, bm=8))
        assert rows.shape == (-(-t // 8) + 4, 8) and tile_slot.shape == (rows.shape[0],)
        held = rows[rows >= 0]
        assert sorted(held.tolist()) == [i for i in range(t) if slots[i] >= 0]
        for k in range(rows.shape[0]):
            mine = rows[k][rows[k] >= 0]
            assert (slots[mine] == tile_slot[k]).all()
            assert tile_slot[k] >= 0 or mine.size == 0


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 0.1)])
def test_kernel_matches_the_reference_for_any_mix(dtype, tol):
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((5, 24, 72)) / 8, dtype)  # rank 8, three targets
    bs = tuple(jnp.asarray(rng.standard_normal((5, 8, o)) / 4, dtype) for o in (72, 24, 40))
    for t in (1, 9, 37):
        x = jnp.asarray(rng.standard_normal((t, 72)), dtype)
        for slots in (rng.integers(-1, 5, t), np.full(t, -1), np.full(t, 2)):
            s = jnp.asarray(slots, jnp.int32)
            got = lp.delta(x, a, bs, s, interpret=True)
            assert got.dtype == dtype and got.shape == (t, 136)
            want = lora_delta_reference(x.astype(jnp.float32), a, bs, s)
            np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not TRITON, reason="this JAX has no Pallas Triton backend")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_for_triton(dtype):
    """The kernel passes Triton's lowering rules (what a GPU would compile)."""
    from tests.cuda_lowering import cuda_lowering

    args = (jax.ShapeDtypeStruct((8, 16, 128), dtype), jax.ShapeDtypeStruct((8,), jnp.int32),
            jax.ShapeDtypeStruct((4, 16, 128), dtype), jax.ShapeDtypeStruct((4, 16, 192), dtype))
    with cuda_lowering():
        text = jax.jit(lambda *v: lp.expand_tiles(*v, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
