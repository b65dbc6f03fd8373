"""The engine's paths on a tiny mixture-of-experts model (8 experts, top 2, in every layer):
batched equals one at a time, preemption (recompute and swap), prefix hits and beam search give
the plain engine's tokens; the grouped expert path gives the dense one's; expert parallelism
over 2 and 4 fake devices gives one device's tokens with each device holding 1/N of the
experts; no recompiles after warm-up."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

from paged_jax.engine.programs import PROGRAMS
from paged_jax.models import parallel
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_moe_config
from tests.engine_helpers import (
    GREEDY,
    all_free,
    check_beam_search,
    check_prefix_hits,
    engine,
    prompts,
    run,
    tokens,
)

N = 10


@functools.cache
def moe_parts(impl: str = "grouped", shared: int = 0):
    cfg = tiny_moe_config(moe_impl=impl, shared_expert_intermediate_size=shared)
    return cfg, random_params(cfg, seed=4), byte_tokenizer()


def workload() -> list[tuple]:
    return [(str(i), p, GREEDY) for i, p in enumerate(prompts(N))]


@pytest.fixture(scope="module")
def batched():
    return run(engine(moe_parts()), workload(), check=True)


def test_batched_equals_one_at_a_time(batched):
    eng = engine(moe_parts())
    for i, p in enumerate(prompts(N)):
        assert tokens(run(eng, [("x", p, GREEDY)]), "x") == tokens(batched, str(i)), i
    assert all_free(eng)


def test_grouped_gives_the_dense_paths_tokens(batched):
    outs = run(engine(moe_parts("dense")), workload())
    for rid in batched:
        assert tokens(outs, rid) == tokens(batched, rid), rid


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_loses_nothing(batched, mode):
    eng = engine(moe_parts(), num_kv_blocks=20, preemption_mode=mode)
    outs = run(eng, workload())
    assert eng.scheduler.num_preempted > 0 and eng.refused_steps == 0
    for rid in batched:
        assert tokens(outs, rid) == tokens(batched, rid), rid
    assert all_free(eng)


def test_prefix_hits_give_the_same_tokens():
    check_prefix_hits(moe_parts())


def test_beam_search_matches_a_brute_force_reference():
    check_beam_search(moe_parts())


def test_no_recompilation_after_warmup():
    run(engine(moe_parts()), workload())
    built = PROGRAMS.built
    outs = run(engine(moe_parts()), [(f"b{rid}", p, sp) for rid, p, sp in workload()])
    assert len(outs) == N
    assert PROGRAMS.built == built


needs4 = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")


@needs4
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("shared", [0, 64])
def test_expert_parallel_gives_one_devices_tokens(n, shared):
    """Experts split over the mesh (and a shared expert's width), attention split by head:
    one device's greedy tokens, with preemption in the mix; each device holds X/N experts."""
    parts = moe_parts(shared=shared)
    one = run(engine(parts), workload())
    eng = engine(parts, tensor_parallel_size=n, num_kv_blocks=40)
    outs = run(eng, workload(), check=True)
    for rid in one:
        assert tokens(outs, rid) == tokens(one, rid), rid
    experts = eng.params["layers"][0]["e_gate_up"]
    shards = experts.addressable_shards
    assert len(shards) == n and {s.data.shape[0] for s in shards} == {8 // n}
    assert eng.scheduler.num_preempted > 0 and all_free(eng)


def test_expert_parallel_layout_rules():
    cfg = tiny_moe_config()
    assert parallel.layout(cfg, 4).n == 4
    with pytest.raises(ValueError, match="must divide the experts"):
        parallel.layout(dataclasses.replace(cfg, num_experts=6, num_heads=4), 4)
    olmoe = dataclasses.replace(cfg, qk_norm=True, qk_norm_span="all")
    with pytest.raises(ValueError, match="OLMoE"):
        parallel.layout(olmoe, 2)


def test_quantized_weights_leave_the_experts_in_float():
    """int8 weights pack attention and the head for the CPU kernel; the experts stay float
    arrays (the grouped path's dots), and the engine serves every request."""
    from kernels.cpu_matmul import Packed

    eng = engine(moe_parts(shared=64), quantization="int8")
    outs = run(eng, workload())
    layer = eng.params["layers"][0]
    assert isinstance(layer["w_qkv"], Packed) and isinstance(layer["s_gate_up"], Packed)
    assert not isinstance(layer["e_gate_up"], Packed) and layer["e_gate_up"].dtype == "float32"
    assert len(outs) == N and all(len(o.outputs[0].token_ids) == 24 for o in outs.values())


def test_speculation_and_pallas_attention_give_the_same_tokens(batched):
    """An MoE target verified by n-gram speculation (k + 1 query tokens per row through the
    same MLP), and the attention on the Pallas kernels (interpreted): the plain tokens."""
    from paged_jax.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3)
    eng = engine(moe_parts(), speculative=spec, async_scheduling=False)
    outs = run(eng, workload())
    assert eng.scheduler.spec.num_drafts > 0
    pallas = run(engine(moe_parts(), backend="pallas"), workload()[:3])
    for rid in batched:
        assert tokens(outs, rid) == tokens(batched, rid), rid
    for rid in pallas:
        assert tokens(pallas, rid) == tokens(batched, rid), rid
