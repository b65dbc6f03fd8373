"""Pallas kernels (interpret mode on CPU) against the jnp reference; Triton lowering checks.

Shapes are fixed (each new shape is a new compile); hypothesis draws the data: lengths, chunk
sizes, shuffled and shared block tables. Every slot no sequence may read holds NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import dispatch
from kernels.paged_attention import decode_attention, decode_reference
from kernels.ragged_paged_attention import ragged_paged_attention
from paged_jax.models.attention import ragged_reference
from tests.cuda_lowering import cuda_lowering

S, P, MAX_Q, EXTRA_BLOCKS = 3, 4, 4, 3


@st.composite
def layouts(draw, block: int, max_q: int) -> dict:
    """Lengths (0 = padding slot), chunk sizes, a shuffled pool, maybe a shared prefix block."""
    lens = draw(st.lists(st.integers(0, P * block), min_size=S, max_size=S))
    return dict(
        lens=np.array(lens),
        num_q=np.array([draw(st.integers(0, min(max_q, x))) for x in lens]),
        perm=np.array(draw(st.permutations(range(1, S * P + 1 + EXTRA_BLOCKS)))),
        share=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def make_batch(
    lay: dict, nq: int, h: int, d: int, block: int, max_q: int,
    dtype=jnp.float32, fill=np.nan,
) -> tuple:
    """The batch a layout describes; `fill` in every slot no sequence can see."""
    n = S * P + 1 + EXTRA_BLOCKS
    lens, num_q = lay["lens"], lay["num_q"]
    tables = np.zeros((S, P), np.int32)
    held = -(-lens // block)
    tables[np.arange(P)[None, :] < held[:, None]] = lay["perm"][: held.sum()]
    if lay["share"] and held[0] > 1 and held[1] > 1:
        tables[1, 0] = tables[0, 0]  # a shared (forked) full prefix block
    rng = np.random.default_rng(lay["seed"])
    k = rng.standard_normal((h, n, block, d)).astype(np.float32)
    v = rng.standard_normal((h, n, block, d)).astype(np.float32)
    visible = np.zeros((n, block), bool)
    for s in range(S):
        for pos in range(lens[s]):
            visible[tables[s, pos // block], pos % block] = True
    k[:, ~visible], v[:, ~visible] = fill, fill
    query_start = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    q = rng.standard_normal((S * max_q + 2, nq, d)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    ints = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return cast(q), cast(k), cast(v), ints(tables), ints(lens), ints(query_start)


def decode_args(batch):
    """Decode kernels take one query row per sequence (the sequence's first query token)."""
    q, k, v, tables, lens, _ = batch
    return q[:S], k, v, tables, lens


def assert_close(out, ref, tol=2e-5):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant,per_step", [
    ("grouped", 1), ("dot", 1), ("split", 1), ("dot", 2), ("split_dot", 2), ("grouped", 4)])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_decode_matches_reference(variant, per_step, data):
    """Every variant, one page a loop step or several gathered at once."""
    args = decode_args(make_batch(data.draw(layouts(16, 1)), 9, 3, 64, 16, 1))
    out = decode_attention(*args, variant=variant, num_splits=2, pages_per_step=per_step)
    assert_close(out, decode_reference(*args))


@pytest.mark.parametrize("variant", ["grouped", "dot"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_ragged_matches_reference(variant, data):
    args = make_batch(data.draw(layouts(16, MAX_Q)), 9, 3, 64, 16, MAX_Q)
    out = ragged_paged_attention(*args, max_q=MAX_Q, variant=variant)
    assert_close(out, ragged_reference(*args, max_q=MAX_Q, scale=64**-0.5))


@pytest.mark.parametrize(
    "block,d,dtype,tol",
    [(8, 64, jnp.float32, 2e-5), (32, 128, jnp.bfloat16, 3e-2), (16, 128, jnp.bfloat16, 3e-2)],
)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_block_sizes_head_dims_dtypes(block, d, dtype, tol, data):
    batch = make_batch(data.draw(layouts(block, MAX_Q)), 8, 2, d, block, MAX_Q, dtype)
    ref = ragged_reference(*batch, max_q=MAX_Q, scale=d**-0.5)
    assert_close(ragged_paged_attention(*batch, max_q=MAX_Q), ref, tol)
    args = decode_args(batch)
    ref = decode_reference(*args)
    for variant in ("grouped", "split"):
        assert_close(decode_attention(*args, variant=variant, num_splits=2), ref, tol)


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_free_blocks_cannot_change_output(data):
    """NaN or random data in freed blocks and stale tails: outputs bit-identical to zeros."""
    lay = data.draw(layouts(16, MAX_Q))
    outs = []
    for fill in (np.nan, 0.0, 1e4):
        batch = make_batch(lay, 9, 3, 64, 16, MAX_Q, fill=fill)
        outs.append([
            ragged_paged_attention(*batch, max_q=MAX_Q),
            decode_attention(*decode_args(batch), variant="split", num_splits=2),
            decode_attention(*decode_args(batch)),
            decode_attention(*decode_args(batch), variant="split_dot", num_splits=2,
                             pages_per_step=2),
        ])
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert np.all(np.isfinite(np.asarray(a)))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("max_q", [1, MAX_Q])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_dispatch_matches_reference(max_q, data):
    batch = make_batch(data.draw(layouts(16, max_q)), 9, 3, 64, 16, max_q)
    out = dispatch.paged_attention(*batch, max_q=max_q, scale=0.2)
    assert_close(out, ragged_reference(*batch, max_q=max_q, scale=0.2))


def test_decode_plan():
    plan = dispatch.decode_plan
    # Float pages of block 16 on tensor cores: Triton gathers 4 pages (64 tokens) a step,
    # splits when S * H cannot fill the GPU and each split keeps two steps; from S * H >= 128
    # programs Mosaic GPU, 8 pages a step.
    assert plan(1, 9, 3, 16, 2048) == dispatch.DecodePlan("triton", "split_dot", 64, 4)
    assert plan(64, 32, 8, 16, 256) == dispatch.DecodePlan("mosaic", "dot", 1, 8)
    assert plan(8, 32, 8, 16, 256) == dispatch.DecodePlan("triton", "split_dot", 4, 4)
    assert plan(1, 32, 8, 16, 64).num_splits == 8  # 16 steps of 4 pages, two a split
    # float32 at D = 256: at most 32 KiB a tile (2 pages), Mosaic GPU refused (float32)
    assert plan(64, 4, 1, 16, 64, jnp.float32, head_dim=256) == dispatch.DecodePlan(
        "triton", "split_dot", 4, 2)
    # int8 / fp8 pages and blocks below 16 load one page a step, elementwise.
    assert plan(1, 9, 3, 16, 2048, quantized=True) == dispatch.DecodePlan("triton", "split",
                                                                          64, 1)
    assert plan(256, 9, 3, 8, 2048) == dispatch.DecodePlan("triton", "grouped", 1, 1)
    assert plan(256, 32, 4, 8, 64).variant == "grouped"
    # Mosaic GPU when asked for (or preferred) and the shapes fit; a clear error when not.
    assert plan(8, 32, 8, 16, 256, kernel="mosaic") == dispatch.DecodePlan(
        "mosaic", "split_dot", 4, 8)
    assert plan(64, 32, 8, 16, 256, kernel="triton").kernel == "triton"
    with pytest.raises(ValueError, match="float32"):
        plan(64, 32, 8, 16, 256, jnp.float32, kernel="mosaic")
    with pytest.raises(ValueError, match="block >= 16"):
        plan(64, 32, 8, 8, 256, kernel="mosaic")
    with pytest.raises(ValueError, match="expected one of"):
        plan(64, 32, 8, 16, 256, kernel="cuda")
    assert dispatch.ragged_variant(8) == "grouped"


def test_unknown_variant_and_small_block_raise():
    z = jnp.zeros
    args = (z((1, 2, 64)), z((1, 3, 8, 64)), z((1, 3, 8, 64)), z((1, 2), jnp.int32),
            z((1,), jnp.int32))
    with pytest.raises(ValueError, match="unknown decode variant"):
        decode_attention(*args, variant="nope")
    with pytest.raises(ValueError, match="block size"):
        decode_attention(*args, variant="dot")


# Configurations the models use: SmolLM2 (9 q / 3 kv heads, D=64) and a Llama-like 32/8, D=128.
MODEL_CONFIGS = [(9, 3, 64), (32, 8, 128)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("nq,h,d", MODEL_CONFIGS)
@pytest.mark.parametrize("block", [8, 16, 32])
def test_lowers_for_triton(nq, h, d, block, dtype):
    """Lowering for CUDA on CPU runs the Pallas->Triton rules (power-of-2 tiles, ops)."""
    nseq, pages, t = 4, 8, 4 * 16 + 2
    spec = jax.ShapeDtypeStruct
    kv = spec((h, nseq * pages + 1, block, d), dtype)
    tables, lens = spec((nseq, pages), jnp.int32), spec((nseq,), jnp.int32)
    qs = spec((nseq + 1,), jnp.int32)
    dot_ok = block >= 16
    cases = [("grouped", 1), ("split", 1)] + [("dot", 1), ("dot", 8), ("split_dot", 4)] * dot_ok
    with cuda_lowering():
        for variant, per_step in cases:
            fn = functools.partial(decode_attention, variant=variant, num_splits=2,
                                   pages_per_step=per_step, interpret=False)
            text = jax.jit(fn).trace(spec((nseq, nq, d), dtype), kv, kv, tables, lens).lower(
                lowering_platforms=("cuda",)).as_text()
            assert_one_triton_kernel(text, f"paged_decode_{variant}")
        for variant in ["grouped"] + ["dot"] * dot_ok:
            for max_q in (1, 16):
                fn = functools.partial(
                    ragged_paged_attention, max_q=max_q, variant=variant, interpret=False)
                text = jax.jit(fn).trace(spec((t, nq, d), dtype), kv, kv, tables, lens,
                                         qs).lower(lowering_platforms=("cuda",)).as_text()
                assert_one_triton_kernel(text, f"ragged_paged_attention_{variant}")


def assert_one_triton_kernel(text: str, name: str) -> None:
    """The lowered program calls the kernel, compiled by Triton, once (not the interpreter,
    which would inline the kernel's ops and leave no custom call)."""
    assert text.count("stablehlo.custom_call") == 1 and "triton" in text.lower(), name
    assert f'name = "{name}' in text, name


def test_gpu_check_cpu_parts(capsys):
    """The GPU check's kernel half plans its grid (the issue's batches and contexts, the
    target shape first) and refuses without a GPU."""
    from kernels import gpu_check

    assert gpu_check.parse_args(["--out", "x"]).out == "x"
    shapes = gpu_check.grid()
    assert shapes[0] == gpu_check.TARGET_SHAPE == (64, 4096)
    assert sorted(shapes) == sorted((b, c) for b in (1, 16, 64) for c in (1024, 4096, 16384))
    assert gpu_check.kv_bytes(64, 4096) == 2 * 64 * 4096 * 8 * 128 * 2
    assert gpu_check.main(["--dry-run"]) == 0
    if jax.default_backend() != "gpu":
        assert gpu_check.main([]) == 2
        assert "no GPU" in capsys.readouterr().err
