"""paged_jax.models.attention: the jnp reference against a naive per-token numpy loop; backends."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference
from paged_jax.models.attention import default_backend, paged_attention, ragged_reference
from tests.attention_helpers import naive

S, P, K, H, G, D, MAX_Q = 3, 3, 4, 2, 2, 8, 3


@st.composite
def batches(draw):
    lens = np.array(draw(st.lists(st.integers(0, P * K), min_size=S, max_size=S)))
    num_q = np.array([draw(st.integers(0, min(MAX_Q, x))) for x in lens])
    n = S * P + 1
    perm = np.array(draw(st.permutations(range(1, n))))
    tables = np.zeros((S, P), np.int32)
    held = -(-lens // K)
    tables[np.arange(P)[None, :] < held[:, None]] = perm[: held.sum()]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    k = rng.standard_normal((H, n, K, D))
    v = rng.standard_normal((H, n, K, D))
    k[:, 0] = v[:, 0] = 0.0  # the zero block
    used = np.zeros(n, bool)
    used[tables[tables > 0]] = True
    k[:, ~used & (np.arange(n) > 0)] = np.nan  # freed blocks may hold anything
    v[:, ~used & (np.arange(n) > 0)] = np.nan
    query_start = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    q = rng.standard_normal((S * MAX_Q + 1, H * G, D))
    return q, k, v, tables, lens.astype(np.int32), query_start


@settings(max_examples=25, deadline=None)
@given(batch=batches())
def test_reference_matches_naive(batch):
    scale = 0.3
    got = ragged_reference(*(jnp.asarray(x) for x in batch), max_q=MAX_Q, scale=scale)
    want = naive(*batch, scale)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=12, deadline=None)
@given(batch=batches(), tile=st.integers(1, MAX_Q), rows=st.sampled_from([None, 1, 2, S]))
def test_query_tiles_match_naive(batch, tile, rows):
    """Long rows cut into query tiles (smaller than a row, here) give the same attention,
    whichever rows the max_q_rows hint sends down the tiled path."""
    q, k, v, tables, lens, qs = batch
    if rows is not None:  # the hint's contract: rows past it hold at most one query
        lens, qs = lens.copy(), qs.copy()
        n = np.diff(qs)
        n[rows:] = np.minimum(n[rows:], 1)
        qs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    old = reference.QUERY_TILE
    reference.QUERY_TILE = tile
    try:
        # one jitted program per example (eager ops would compile dozens of small ones)
        got = jax.jit(functools.partial(paged_attention, max_q=MAX_Q, scale=0.3,
                                        max_q_rows=rows))(*(jnp.asarray(x) for x in
                                                            (q, k, v, tables, lens, qs)))
    finally:
        reference.QUERY_TILE = old
    np.testing.assert_allclose(np.asarray(got), naive(q, k, v, tables, lens, qs, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_default_scale_is_inverse_sqrt_head_dim():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 2, 4, 16)), jnp.float32)
    args = (q, kv, kv, jnp.array([[1]]), jnp.array([3]), jnp.array([0, 1]))
    np.testing.assert_allclose(
        paged_attention(*args, max_q=1), ragged_reference(*args, max_q=1, scale=0.25), rtol=1e-6
    )


def test_unknown_backend_raises():
    z = jnp.zeros
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(z((1, 2, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8)), z((1, 1), jnp.int32),
                        z((1,), jnp.int32), z((2,), jnp.int32), max_q=1, backend="cuda")


def test_default_backend_on_cpu_is_not_pallas():
    """Pallas runs in interpret mode off GPU: a test tool, never the default."""
    assert default_backend() in ("cpu", "reference")


@pytest.mark.parametrize("max_q", [1, MAX_Q])
def test_pallas_backend_matches_reference(max_q):
    """A live sequence, a padding slot, a short one; NaN in the free blocks 6.."""
    rng = np.random.default_rng(1)
    lens = np.array([9, 0, 5], np.int32)
    num_q = np.minimum([max_q, 0, 1], lens)
    query_start = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    tables = np.array([[1, 2, 3], [0, 0, 0], [4, 5, 0]], np.int32)
    k, v = (rng.standard_normal((H, S * P + 1, K, D)).astype(np.float32) for _ in range(2))
    k[:, 0] = v[:, 0] = 0.0
    k[:, 6:] = v[:, 6:] = np.nan
    q = rng.standard_normal((S * MAX_Q + 1, H * G, D)).astype(np.float32)
    args = tuple(jnp.asarray(x) for x in (q, k, v, tables, lens, query_start))
    ref = paged_attention(*args, max_q=max_q, backend="reference")
    out = paged_attention(*args, max_q=max_q, backend="pallas")
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_model_logits_pallas_equal_reference():
    """A tiny random GQA model (6 query / 2 KV heads): prefill chunks, then decode steps."""
    from paged_jax.models.config import ModelConfig
    from paged_jax.models.params import build_params, expected_shapes
    from paged_jax.models.reference_loop import greedy, paged_loop

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    shapes, rng = expected_shapes(config), np.random.default_rng(0)

    def get(name: str):
        base = name.split(".")[-1]
        if base in ("bq", "bk", "bv", "bo", "lm_head"):
            return None
        x = rng.standard_normal(shapes[base]) * 0.3
        return x + 1.0 if "norm" in base else x

    params = build_params(config, get)
    prompts = [rng.integers(0, 64, n).tolist() for n in (7, 3, 10)]
    runs = {}
    for backend in ("reference", "pallas"):
        runner = paged_loop(config, params, num_seqs=3, max_len=16, block_size=4,
                            backend=backend, shuffle_seed=5)
        runs[backend] = greedy(runner, prompts, max_tokens=4)
    assert runs["pallas"][0] == runs["reference"][0]
    for ours, ref in zip(runs["pallas"][1], runs["reference"][1], strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
