"""paged_jax.study.cost_model: the roofline step time of the modeled GPU clock."""

from __future__ import annotations

import math

import pytest

from paged_jax.study.cost_model import GpuCostModel, TensorParallelRoofline


def test_decode_step_is_memory_bound_and_nearly_flat_in_batch():
    m = GpuCostModel()
    one = m.step_seconds(1, 1, 100, 10_000)
    many = m.step_seconds(1, 64, 6_400, 10_000)
    # Weights dominate: 26 GB at 1.555 TB/s is ~16.7 ms whatever the batch.
    assert math.isclose(one, (26e9 + 12e9 * 0.01) / 1.555e12)
    assert one < many < 1.5 * one


def test_full_pool_adds_its_kv_bytes_and_iterations_multiply():
    m = GpuCostModel()
    full = m.step_seconds(1, 8, 10_000, 10_000)
    assert math.isclose(full, (26e9 + 12e9) / 1.555e12)
    assert math.isclose(m.step_seconds(8, 64, 10_000, 10_000), 8 * full)
    assert m.step_seconds(1, 8, 20_000, 10_000) == full  # never more than the pool


def test_long_prefill_is_compute_bound():
    m = GpuCostModel()
    tokens = 4096
    assert math.isclose(m.step_seconds(1, tokens, tokens, 10_000),
                        tokens * 2 * 13e9 / 312e12)


def test_tensor_parallel_roofline_splits_weights_and_counts_communication():
    m = TensorParallelRoofline()
    assert 8.0e9 < m.parameters < 8.1e9  # Llama-3-8B
    assert m.weight_bytes(4) == m.weight_bytes(1) / 4
    assert m.kv_bytes_per_token(8) == m.kv_bytes_per_token(1) / 8  # 8 KV heads: one each
    assert m.kv_bytes_per_token(16) == m.kv_bytes_per_token(8)  # replicated past H
    caps = [m.capacity_tokens(n) for n in (1, 2, 4, 8)]
    assert all(b > 2 * a for a, b in zip(caps, caps[1:], strict=False))  # weights freed too
    assert m.comm_seconds(1, 1) == 0 and m.comm_seconds(8, 64) > m.comm_seconds(2, 64) > 0
    # batch 1 is bandwidth-bound: splitting the reads helps, communication takes some back
    one, two = m.decode_seconds(1, 1, 1024), m.decode_seconds(2, 1, 1024)
    assert one / 2 < two < one
    assert math.isclose(two - m.comm_seconds(2, 1),
                        (m.weight_bytes(2) + 1024 * m.kv_bytes_per_token(2)) / m.bandwidth)


def test_moe_shapes_reproduce_published_parameter_counts():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures);
    Qwen1.5-MoE-A2.7B: 14.3B and 2.7B; OLMoE-1B-7B: 6.9B and 1.3B."""
    from paged_jax.study.moe_cost import REAL

    got = {n: (round(s.total / 1e9, 1), round(s.active / 1e9, 1)) for n, s in REAL.items()}
    assert got == {"Mixtral-8x7B": (46.7, 12.9), "Qwen1.5-MoE-A2.7B": (14.3, 2.7),
                   "OLMoE-1B-7B": (6.9, 1.3)}


def test_moe_decode_reads_what_its_batch_touches():
    """Batch 1 reads the active parameters (a dense model of that size costs the same);
    a large batch touches every expert (a dense model of the total size costs the same);
    in between the MoE costs less than the dense total."""
    from paged_jax.study.moe_cost import REAL, compare

    m = REAL["Mixtral-8x7B"]
    assert m.touched(1) == pytest.approx(m.top_k) and m.touched(512) == pytest.approx(8)
    c = compare(m)["decode_s_per_token"]
    assert c["1"]["moe"] == pytest.approx(c["1"]["dense_same_active"])
    assert c["64"]["moe"] == pytest.approx(c["64"]["dense_same_total"], rel=1e-6)
    assert 0.5 < c["8"]["moe_over_dense_same_total"] < 1
