"""The decoder on a dummy model (no torch): pallas vs reference attention, bf16 vs fp32,
ragged prefill vs token-by-token decode, and the jitted wrapper's donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.models import ModelConfig, make_forward
from paged_jax.models.reference_loop import paged_loop
from paged_jax.models.testing import random_params

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
PROMPTS = [np.random.default_rng(0).integers(0, 64, n).tolist() for n in (9, 4, 6)]


def run(params, backend: str = "reference", block_size: int = 4):
    """All-token logits of a ragged prefill, then 3 decode steps' logits."""
    runner = paged_loop(CONFIG, params, 3, 16, block_size=block_size, backend=backend,
                        shuffle_seed=1)
    prefill = runner.step(PROMPTS, all_logits=True)
    decode = np.stack([runner.step([[3], [5], [7]]) for _ in range(3)])
    return prefill, decode


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=0)


@pytest.fixture(scope="module")
def reference(params):
    return run(params)


def test_pallas_backend_matches_reference(params, reference):
    for got, want in zip(run(params, "pallas"), reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_prefill_equals_decode_token_by_token(params, reference):
    runner = paged_loop(CONFIG, params, 3, 16, block_size=4)
    # Sequences that ran out of prompt get no tokens (their logits rows are garbage, skipped).
    steps = [runner.step([[p[i]] if i < len(p) else [] for p in PROMPTS]) for i in range(9)]
    by_token = [np.stack([s[j] for s in steps[: len(p)]]) for j, p in enumerate(PROMPTS)]
    np.testing.assert_allclose(np.concatenate(by_token), reference[0], rtol=1e-4, atol=1e-4)


def test_bf16_close_to_fp32(params, reference):
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    prefill, decode = run(bf16, block_size=8)
    assert prefill.dtype == np.float32
    scale = np.abs(reference[0]).max()
    assert np.abs(prefill - reference[0]).max() < 0.05 * scale
    assert np.abs(decode - reference[1]).max() < 0.05 * scale


def test_make_forward_is_cached_and_donates(params):
    fwd = make_forward(CONFIG, 1)
    assert make_forward(CONFIG, 1) is fwd
    runner = paged_loop(CONFIG, params, 3, 16, block_size=4)
    old = runner.cache
    runner.step([[1], [2], [3]])
    assert all(x.is_deleted() for x in old.k)
