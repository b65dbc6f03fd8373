"""The mixture-of-experts MLP's parts (models/moe.py): routing, the three expert paths against
each other on even and lopsided routings, expert load, and the router load a forward reports."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.models import moe
from paged_jax.models.llama import prepare_params
from paged_jax.models.reference_loop import paged_loop
from paged_jax.models.testing import random_params, tiny_moe_config

CFG = tiny_moe_config()


@pytest.fixture(scope="module")
def layer():
    return prepare_params(random_params(CFG, seed=1))["layers"][0]


def test_route_keeps_the_k_best_and_renormalises(layer):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)), jnp.float32)
    w, ids = moe.route(x, layer["router"], 2, normalize=True)
    probs = jax.nn.softmax(x @ layer["router"].T, -1)
    best = np.argsort(-np.asarray(probs), -1)[:, :2]
    np.testing.assert_array_equal(np.asarray(ids), best)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    raw, _ = moe.route(x, layer["router"], 2, normalize=False)
    np.testing.assert_allclose(raw, np.take_along_axis(np.asarray(probs), best, -1), rtol=1e-6)


@pytest.mark.parametrize("routing", ["spread", "one expert", "other devices"])
@pytest.mark.parametrize("tokens", [1, 16, 70])
def test_expert_paths_agree(layer, routing, tokens):
    """Grouped (tiles, a loop of data-dependent length per expert) and ragged_dot give the
    dense path's output: tokens spread over experts, all on one expert (many tiles of one),
    and ids past the experts (other devices' under expert parallelism) contributing 0."""
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.float32)
    ids = rng.integers(0, 8, (tokens, 2))
    if routing == "one expert":
        ids[:] = [3, 3]
    if routing == "other devices":
        ids[::2, 1] = 8
    w = jnp.asarray(rng.random((tokens, 2)), jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    want = moe.dense_experts(x, layer, w, ids, jax.nn.silu)
    for impl in ("grouped", "ragged_dot"):
        got = jax.jit(moe.IMPLS[impl], static_argnums=4)(x, layer, w, ids, jax.nn.silu)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=impl)
    if routing == "other devices":  # the dropped pairs really are dropped
        kept = moe.dense_experts(x, layer, w.at[::2, 1].set(0), ids % 8, jax.nn.silu)
        np.testing.assert_allclose(want, kept, rtol=2e-5, atol=2e-5)


def test_tile_rows():
    assert moe.tile_rows(32, 8) == 8 and moe.tile_rows(1024, 8) == 64
    assert moe.tile_rows(200, 8) == 16


def test_expert_load_counts_real_tokens_only():
    ids = jnp.asarray([[0, 1], [1, 2], [7, 7]], jnp.int32)
    got = moe.expert_load(ids, jnp.asarray([True, True, False]), 8)
    np.testing.assert_array_equal(got, [1, 2, 1, 0, 0, 0, 0, 0])


def test_forward_reports_each_layers_load():
    """PagedLoop's last_load: every layer sends each real token to k experts (padding
    tokens of the power-of-two step are not counted)."""
    cfg = dataclasses.replace(CFG, moe_impl="grouped")
    runner = paged_loop(cfg, random_params(cfg, seed=2), num_seqs=2, max_len=32)
    runner.step([[1, 2, 3, 4, 5], [6, 7]])  # 7 tokens in a step of 8
    assert runner.last_load.shape == (2, 8)
    np.testing.assert_array_equal(runner.last_load.sum(-1), [14, 14])


def test_config_checks():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_moe_config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="moe_impl"):
        tiny_moe_config(moe_impl="sparse")
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        tiny_moe_config(moe_intermediate_size=0)


@pytest.mark.parametrize("impl", ["grouped", "dense", "ragged_dot"])
def test_expert_paths_lower_for_cuda(layer, impl):
    """Each path lowers for CUDA on this CPU (the grouped one's data-dependent loops as
    while loops): the GPU build runs what CI tests."""
    cfg = dataclasses.replace(CFG, moe_impl=impl)
    x, valid = jnp.zeros((16, 64), jnp.float32), jnp.ones(16, bool)
    fn = jax.jit(lambda p, x: moe.moe_block(p, x, cfg, valid)[0])
    text = fn.trace(layer, x).lower(lowering_platforms=("cuda",)).as_text()
    assert ("stablehlo.while" in text) == (impl == "grouped")
