"""paged_jax.cost_model: the roofline step time of the modeled GPU clock."""

from __future__ import annotations

import math

from paged_jax.cost_model import GpuCostModel


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
