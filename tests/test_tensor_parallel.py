"""Tensor parallelism on fake CPU devices (conftest: --xla_force_host_platform_device_count=4):
greedy tokens equal one device's, with preemption, prefix caching and n > 1; each device holds
its share of the KV pool; no recompiles after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax.engine.programs import PROGRAMS
from paged_jax.models import parallel
from paged_jax.models.testing import tiny_config
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import BASE, GREEDY, all_free, engine, model, prompts, run, tokens

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")

SHARED = "a system prompt that every request shares, long enough for blocks. "
SAMPLED = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)


def workload() -> list[tuple]:
    """Greedy requests, some sharing a prefix (prefix-cache hits), and a seeded n = 2 one."""
    reqs = [(str(i), (SHARED if i % 2 else "") + p, GREEDY) for i, p in enumerate(prompts(10))]
    return reqs + [("n2", SHARED + "two samples", SAMPLED)]


@pytest.fixture(scope="module")
def one_device():
    return run(engine(), workload(), check=True)


@pytest.mark.parametrize("n", [2, 4])
def test_tokens_match_one_device(one_device, n):
    eng = engine(tensor_parallel_size=n)
    outs = run(eng, workload(), check=True)
    for rid in one_device:
        assert tokens(outs, rid) == tokens(one_device, rid), rid
    assert sum(o.num_cached_tokens or 0 for o in outs.values()) > 0  # prefix hits happened
    assert all_free(eng)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_match_one_device(quantization):
    """Each device packs its own shard (its panels, its scale groups: parallel.pack_shards);
    TP = 2 gives one device's greedy tokens with the same quantization."""
    reqs = workload()
    one = run(engine(quantization=quantization), reqs)
    eng = engine(tensor_parallel_size=2, quantization=quantization)
    qkv = eng.params["layers"][0]["w_qkv"]
    assert qkv.scales is not None and len(qkv.panels.sharding.device_set) == 2
    outs = run(eng, reqs, check=True)
    for rid in one:
        assert tokens(outs, rid) == tokens(one, rid), rid


def test_preemption_under_tensor_parallelism(one_device):
    eng = engine(tensor_parallel_size=2, num_kv_blocks=30)
    outs = run(eng, workload(), check=True)
    assert eng.scheduler.num_preempted > 0, "the small pool should force preemption"
    for rid in one_device:
        assert tokens(outs, rid) == tokens(one_device, rid), rid
    assert all_free(eng)


@pytest.mark.parametrize("n, heads_each", [(2, 1), (4, 1)])
def test_each_device_holds_its_share_of_the_pool(n, heads_each):
    """Tiny model: 2 KV heads. n = 2: one each, half the pool; n = 4: each head on two
    devices (replicated), so a device holds 1 / 2 of the unreplicated pool, not 1 / 4."""
    eng = engine(tensor_parallel_size=n)
    one = engine().state.cache
    for arr, ref in zip(eng.state.cache.k + eng.state.cache.v, one.k + one.v, strict=True):
        shards = arr.addressable_shards
        assert len(shards) == n and {s.data.shape[0] for s in shards} == {heads_each}
        assert all(s.data.nbytes == arr.nbytes // n for s in shards)
        assert sum(s.data.nbytes for s in shards) == ref.nbytes * max(n, 2) // 2
    pool = eng.state.pool.refcount
    assert pool.sharding.is_fully_replicated and len(pool.sharding.device_set) == n


def test_layout_rules():
    cfg = tiny_config()  # 4 query heads, 2 KV heads, MLP 128, vocabulary 257
    lay = parallel.layout(cfg, 4)
    assert (lay.num_heads, lay.num_kv_heads, lay.kv_heads_total, lay.kv_replicas,
            lay.vocab) == (1, 1, 4, 2, 260)
    assert parallel.layout(cfg, 2).kv_replicas == 1
    with pytest.raises(ValueError, match="must divide the query heads"):
        parallel.layout(cfg, 3)
    with pytest.raises(ValueError, match="8 devices are needed"):
        parallel.make_mesh(8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        engine(tensor_parallel_size=0)


def test_no_recompilation_after_warmup():
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(8))]
    run(engine(tensor_parallel_size=2), reqs)
    built = PROGRAMS.built
    outs = run(engine(tensor_parallel_size=2), [(f"b{i}", p, sp) for i, p, sp in reqs])
    assert len(outs) == len(reqs)
    assert PROGRAMS.built == built


def test_sharded_params_rebuild_the_unsharded_weights():
    """Device i's slice of the fused q|k|v outputs (rows: runtime weights are [out, in]) is
    its query heads, then its KV head."""
    cfg = tiny_config()
    eng = engine(tensor_parallel_size=2, matmul_backend="xla")  # plain [out, in] weights
    one = engine(matmul_backend="xla").params
    d, q = cfg.head_dim, cfg.num_heads * cfg.head_dim
    w = one["layers"][0]["w_qkv"]
    shards = sorted(eng.params["layers"][0]["w_qkv"].addressable_shards,
                    key=lambda s: s.index[0].start)
    for i, s in enumerate(shards):
        mine = np.asarray(s.data)
        np.testing.assert_array_equal(mine[:2 * d], w[i * 2 * d:(i + 1) * 2 * d])
        np.testing.assert_array_equal(mine[2 * d:3 * d], w[q + i * d:q + (i + 1) * d])


def test_two_replicas_give_one_engines_tokens():
    """data_parallel_size = 2, a device each (the fast tier's check; TP x DP below): the
    requests alternate between the replicas by load, each replica's pool is on its own
    device, every output is one engine's, and every replica's load and blocks come back."""
    from paged_jax import LLM

    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(4))]
    one = run(engine(), reqs)
    llm = LLM(model_parts=model(), data_parallel_size=2, **BASE)
    outs = llm.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs], use_tqdm=False)
    for (rid, _, _), out in zip(reqs, outs, strict=True):
        assert [c.token_ids for c in out.outputs] == tokens(one, rid), rid
    for i, replica in enumerate(llm.replicas):
        assert sum(s.num_tokens for s in replica.stats) > 0, f"replica {i} served nothing"
        assert {d.id for d in replica.state.cache.k[0].sharding.device_set} == {i}
        assert all_free(replica)
    assert llm.balancer.outstanding == [0, 0]


def test_data_parallel_replicas_share_the_work(one_device):
    """Two replicas of TP = 2 on four devices, each with its own pool; requests go to the
    least loaded; every output is what one device gives."""
    from paged_jax import LLM

    llm = LLM(model_parts=model(), data_parallel_size=2, tensor_parallel_size=2,
              **BASE)
    reqs = workload()
    outs = llm.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs], use_tqdm=False)
    for (rid, _, _), out in zip(reqs, outs, strict=True):
        assert [c.token_ids for c in out.outputs] == tokens(one_device, rid), rid
    a, b = llm.replicas
    assert a.stats and b.stats  # both served
    assert {d.id for d in b.state.cache.k[0].sharding.device_set} == {2, 3}
    assert llm.balancer.outstanding == [0, 0] and all_free(a) and all_free(b)


@pytest.mark.slow
def test_smollm2_tp3_matches_one_device():
    """SmolLM2-135M (9 query / 3 KV heads): TP = 3 gives one device's greedy tokens, in
    bfloat16. Not under LLM()'s int8 default for this file: its activations' int8 codes turn
    the all-reduce's float reassociation into code flips, which move a logprob by hundredths
    and swap a near-tie (CI: a 0.0015 top-two margin at the sixth token of "The capital of
    France is"); test_quantized_weights_match_one_device holds int8 and int4 to it on the
    tiny model's clear margins."""
    from paged_jax import LLM

    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
              kv_cache_memory=8 << 20, static_shapes=True, dtype="bfloat16")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ps = ["The capital of France is", "def fib(n):", "Once upon a time", "2 + 2 ="]
    one = [o.outputs[0].token_ids for o in LLM(**kw).generate(ps, sp, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=3, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)] == one
    k = llm.llm_engine.state.cache.k[0]
    assert [s.data.shape[0] for s in k.addressable_shards] == [1, 1, 1]  # a KV head each
