"""Scheduler: exact plans on hand-made sequences, over a KV manager's host facts (no model,
no device: the scheduler reads only the host mirror)."""

import dataclasses

import numpy as np

from paged_jax.cache.config import CacheConfig
from paged_jax.engine.kv_manager import KVManager
from paged_jax.engine.scheduler import Scheduler, SchedulerConfig
from paged_jax.engine.sequence import Request, Sequence, Status
from paged_jax.sampling_params import SamplingParams
from paged_jax.sizes import cdiv

K = 4  # block size


def kv_manager(num_blocks: int = 9, slots: int = 4, prefix: bool = False) -> KVManager:
    cc = CacheConfig(num_blocks=num_blocks, block_size=K, max_seqs=slots, max_blocks_per_seq=8)
    return KVManager(cc, block_bytes=64, prefix_caching=prefix)


@dataclasses.dataclass
class DeviceSaid:
    """The parts of a call's output the KV manager reads (nothing computed)."""

    num_free: int
    full_blocks: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), int))
    refcount: np.ndarray | None = None


def request(rid: str, prompt_len: int, n: int = 1) -> Request:
    ids = list(range(1, prompt_len + 1))
    req = Request(rid, None, ids, SamplingParams(n=n, max_tokens=8), 0.0, order=-1)
    req.seqs = [Sequence(i, list(ids), prompt_len, owner=req) for i in range(n)]
    return req


def run_until(sch: Scheduler, req: Request, computed: int, extra_tokens: int = 0) -> None:
    """Admits `req` and makes it hold K/V for `computed` tokens on the device, as if steps
    had run (plus `extra_tokens` sampled tokens appended)."""
    sch.add(req)
    sch.waiting.remove(req)
    kv = sch.kv
    kv.allocate(req.seqs)
    seq = req.seqs[0]
    seq.status, req.order = Status.RUNNING, next(sch._orders)
    sch.running.append(req)
    kv.slot_live[seq.slot] = True
    kv.num_free -= cdiv(computed, K)
    seq.num_computed = computed
    seq.tokens += [7] * extra_tokens


def plan_of(plan) -> list[tuple[str, int]]:
    return [(s.owner.request_id, n) for s, n in plan.chunks]


def test_decodes_first_then_prefill_chunks_then_admission_fcfs():
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=K),
                    kv_manager())
    old, prefilling = request("old", 5), request("pre", 10)
    run_until(sch, old, 5, extra_tokens=1)  # one token to decode
    run_until(sch, prefilling, 4)  # 6 prompt tokens still to compute
    sch.add(request("new", 3))
    plan = sch.schedule()
    # decode first, then the prefill's chunk, then what budget is left for the newcomer
    assert plan_of(plan) == [("old", 1), ("pre", 6), ("new", 1)]
    assert [r.request_id for r in plan.admitted] == ["new"] and not plan.window


def test_a_long_prefill_takes_at_most_the_threshold_per_step():
    """Fair prefill: with long_prefill_token_threshold, a prompt's chunk is capped both when
    admitted and while it prefills, so the decodes' step stays short; decodes are never
    capped (one token each)."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=K,
                          long_prefill_token_threshold=3)
    sch = Scheduler(cfg, kv_manager(num_blocks=20))
    old, prefilling = request("old", 5), request("pre", 12)
    run_until(sch, old, 5, extra_tokens=1)
    run_until(sch, prefilling, 4)  # 8 prompt tokens to go
    sch.add(request("new", 10))
    plan = sch.schedule()
    assert plan_of(plan) == [("old", 1), ("pre", 3), ("new", 3)]
    uncapped = Scheduler(dataclasses.replace(cfg, long_prefill_token_threshold=0),
                         kv_manager(num_blocks=20))
    old, prefilling = request("old", 5), request("pre", 12)
    run_until(uncapped, old, 5, extra_tokens=1)
    run_until(uncapped, prefilling, 4)
    uncapped.add(request("new", 10))
    assert plan_of(uncapped.schedule()) == [("old", 1), ("pre", 8), ("new", 7)]


def test_a_one_token_prefill_chunk_never_runs_as_a_decode_window():
    """With a cap of 1 every prefill chunk is one token, like a decode; a window over it
    would sample from a half-read prompt."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=K,
                          decode_window=8, long_prefill_token_threshold=1)
    sch = Scheduler(cfg, kv_manager(num_blocks=20))
    old, pre = request("old", 5), request("pre", 12)
    run_until(sch, old, 5, extra_tokens=1)
    run_until(sch, pre, 4)
    plan = sch.schedule()
    assert plan_of(plan) == [("old", 1), ("pre", 1)] and not plan.window


def test_admission_stops_at_the_first_request_that_does_not_fit():
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=K),
                    kv_manager(num_blocks=5))  # 4 usable blocks
    big, small = request("big", 20), request("small", 2)  # big needs 5 blocks
    sch.add(big)
    sch.add(small)
    plan = sch.schedule()
    assert plan.chunks == [] and [r.request_id for r in sch.waiting] == ["big", "small"]


def test_the_newest_request_is_preempted_and_requeued_first():
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=K),
                    kv_manager(num_blocks=5))
    a, b = request("a", 8), request("b", 8)
    run_until(sch, a, 8, extra_tokens=1)  # 2 blocks each, both full: a decode needs a third
    run_until(sch, b, 8, extra_tokens=1)
    sch.add(request("c", 2))
    assert sch.kv.free_total() == 0
    plan = sch.schedule()
    # b's blocks come back with the call that releases them: a waits one step (rule 4)
    assert plan_of(plan) == [] and plan.deferred == 1
    assert plan.ops["release"].tolist() == [i == b.seqs[0].slot for i in range(4)]
    assert sch.num_preempted == 1 and [r.request_id for r in sch.waiting] == ["b", "c"]
    assert b.seqs[0].num_computed == 0 and b.seqs[0].status is Status.WAITING
    assert b.seqs[0].slot >= 0, "a preempted request keeps its slot"
    assert sch.kv.free_total() == 0, "not freed until the device says so"
    sch.kv.update_from_output([], DeviceSaid(num_free=2), plan.sent)
    assert sch.kv.free_total() == 2  # b's two blocks came back
    assert plan_of(sch.schedule()) == [("a", 1)] and sch.num_preempted == 1


def test_decodes_run_as_a_window_only_when_nothing_can_join():
    sch = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=K,
                                    decode_window=8), kv_manager(slots=2))
    a = request("a", 3)
    run_until(sch, a, 3, extra_tokens=1)
    assert sch.schedule().window
    sch.add(request("b", 2))
    plan = sch.schedule()  # b joins: one ragged step
    assert not plan.window and plan_of(plan) == [("a", 1), ("b", 2)]
    sch.add(request("c", 2))
    plan = sch.schedule()  # b's slot is not live on the device yet
    assert not plan.window and plan_of(plan) == [("a", 1), ("b", 2)]
    b = sch.running[1].seqs[0]
    sch.kv.slot_live[b.slot] = True  # as the engine's step would leave it
    b.num_computed = 2
    b.tokens.append(7)
    plan = sch.schedule()  # no slot for c: nothing can join, so the decodes run as a window
    assert plan.window and plan_of(plan) == [("a", 1), ("b", 1)]
