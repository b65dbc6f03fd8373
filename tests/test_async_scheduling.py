"""Async scheduling (EngineConfig.async_scheduling): the host plans step n+1 while the device
runs step n and reads each step one step late. The same tokens as synchronous scheduling, every
step delivered as read, nothing held after aborts, preemption or stop strings."""

import asyncio
import threading
import time

import pytest

from paged_jax.engine.programs import PROGRAMS
from paged_jax.sampling_params import SamplingParams
from paged_jax.serve.async_engine import AsyncEngine
from tests.engine_helpers import GREEDY, all_free, engine, prompts, run


def both(reqs, **overrides) -> tuple[dict, dict, object]:
    """Runs `reqs` synchronously and asynchronously on fresh engines: (sync, async outputs,
    the async engine)."""
    sync = run(engine(**overrides), reqs)
    eng = engine(async_scheduling=True, **overrides)
    return sync, run(eng, reqs), eng


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids, y.text, y.finish_reason, y.stop_reason), rid


def test_greedy_tokens_equal_and_every_step_delivers_one_token():
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(24))]
    sync = run(engine(), reqs)
    eng = engine(async_scheduling=True)
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    seen, done = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            n = len(out.outputs[0].token_ids)
            assert n - seen.get(out.request_id, 0) <= 1, "more than one token per step"
            seen[out.request_id] = n
            if out.finished:
                done[out.request_id] = out
    same(sync, done)
    assert all_free(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_tokens(mode):
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(20))]
    sync, got, eng = both(reqs, num_kv_blocks=20, preemption_mode=mode)
    same(sync, got)
    assert eng.scheduler.num_preempted > 0 and eng.scheduler.refused_steps == 0
    assert all_free(eng)


def test_sampling_forks_stop_strings_and_max_tokens_give_the_same_outputs():
    """Seeded sampling with n > 1 and penalties; stop strings taken from the greedy text so
    they hit mid-run (the async engine has already planned the next token then); max_tokens
    landing at different steps."""
    ps = prompts(12)
    greedy = run(engine(), [(str(i), p, GREEDY) for i, p in enumerate(ps)])
    reqs = []
    for i, p in enumerate(ps):
        stop = [greedy[str(i)].outputs[0].text[6:8]] if i % 3 == 0 else None
        sp = SamplingParams(temperature=0.0 if stop else 0.9, seed=i, n=2 if i % 3 == 1 else 1,
                            max_tokens=5 + 3 * (i % 5), stop=stop, presence_penalty=0.3,
                            ignore_eos=i % 2 == 0)
        reqs.append((str(i), p, sp))
    sync, got, eng = both(reqs)
    same(sync, got)
    assert any(o.outputs[0].finish_reason == "stop" for o in got.values())
    assert all_free(eng)


def test_prefix_hits_give_the_same_tokens():
    system = "a long shared system prompt that fills several blocks of the cache. "
    reqs = [(str(i), system + f"q{i}", GREEDY) for i in range(12)]
    sync, got, eng = both(reqs)
    same(sync, got)
    assert eng.prefix.hit_rate > 0 and all_free(eng)


def test_an_abort_between_plan_and_result_frees_everything():
    reqs = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
            for i, p in enumerate(prompts(6))]
    sync = run(engine(), reqs)
    eng = engine(async_scheduling=True)
    for r in reqs:
        eng.add_request(*r)
    done = {}
    for _ in range(4):
        for out in eng.step():
            assert out.request_id != "2" or not out.finished
    assert eng._in_flight is not None, "a step is in flight when the abort lands"
    eng.abort("2")
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id != "2", "an aborted request reports nothing more"
            if out.finished:
                done[out.request_id] = out
    same({k: v for k, v in sync.items() if k != "2"}, done)
    eng.kv.check()
    assert all_free(eng)


def test_no_recompilation_after_warmup():
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(10))]
    run(engine(async_scheduling=True), reqs)
    built = PROGRAMS.built
    run(engine(async_scheduling=True), [(f"b{i}", p, sp) for i, p, sp in reqs])
    assert PROGRAMS.built == built


def test_beam_search_runs_on_an_async_engine():
    from paged_jax import LLM
    from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
    from paged_jax.sampling_params import BeamSearchParams

    c = tiny_config()
    parts = (c, random_params(c), byte_tokenizer())
    kw = dict(model_parts=parts, num_kv_blocks=160, block_size=8, max_model_len=128,
              static_shapes=True, max_num_seqs=8, max_num_batched_tokens=64, max_logprobs=4)
    bp = BeamSearchParams(beam_width=2, max_tokens=6)
    want = LLM(**kw).beam_search(["hello there"], bp)
    got = LLM(async_scheduling=True, **kw).beam_search(["hello there"], bp)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in want[0].sequences]


def test_a_long_prompt_shares_every_step_with_the_decodes():
    """Fair prefill (long_prefill_token_threshold=16): a 200-token prompt arriving among six
    decoding requests prefills in chunks of at most 16 beside them; every step of its
    prefill gives each short request its next token; nothing is preempted; the tokens are
    those of an uncapped synchronous engine."""
    short = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [(f"s{i}", p, short) for i, p in enumerate(prompts(6))]
    long = ("L", "a long prompt: " + "the quick brown fox jumps over the lazy dog " * 4, GREEDY)
    ref = run(engine(), reqs + [long])
    eng = engine(async_scheduling=True, long_prefill_token_threshold=16)
    eng.recorder = steps = []
    for r in reqs:
        eng.add_request(*r)
    seen, done, arrived = {}, {}, None
    while eng.has_unfinished():
        outs = eng.step()
        if arrived is not None and seen.get("L", 0) == 0:  # every unfinished short is there
            assert {o.request_id for o in outs} >= {r for r, _, _ in reqs if r not in done}
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if arrived is not None and out.request_id != "L" and seen.get("L", 0) == 0:
                # the long prompt prefills: every short request moves by one token
                assert n == seen[out.request_id] + 1, out.request_id
            seen[out.request_id] = n
            if out.finished:
                done[out.request_id] = out
        if arrived is None and min(seen.get(r[0], 0) for r in reqs) >= 4:
            eng.add_request(*long)
            arrived = len(steps)
    same(ref, done)
    assert max(s.num_tokens for s in steps[arrived:]) <= 6 + 16
    assert eng.scheduler.num_preempted == 0 and all_free(eng)


@pytest.mark.parametrize("cap, async_", [(1, False), (5, True)])
def test_a_prefill_cap_gives_the_same_tokens(cap, async_):
    """One-token prefill chunks must not run as decode windows (sync, windows on)."""
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(8))]
    eng = engine(long_prefill_token_threshold=cap, async_scheduling=async_)
    same(run(engine(), reqs), run(eng, reqs))
    assert all_free(eng)


class _Gate:
    """Stands for a step's device outputs that are not ready until `open` is set."""

    def __init__(self):
        self.open, self.waited = threading.Event(), threading.Event()

    def block_until_ready(self):
        self.waited.set()
        self.open.wait(30)
        return self


def test_a_served_arrival_joins_the_next_step_instead_of_the_one_after():
    """AsyncEngine (the server's loop) plans a step with room only once the step in flight
    has ended. While `hold` is set the step in flight is a gate that never ends on its own: a
    request that arrives meanwhile is taken in (applied) but nothing is planned; once the gate
    opens, the very next step sent prefills it."""
    eng = engine(async_scheduling=True)
    gates, hold = [], threading.Event()

    def gated():
        if not hold.is_set() or eng._in_flight is None:
            return None
        gates.append(_Gate())
        return gates[-1]

    def until(cond) -> bool:
        deadline = time.time() + 10
        while not cond() and time.time() < deadline:
            time.sleep(0.01)
        return cond()

    async def submit(rid: str):  # a stream belongs to the event loop it was made in
        return served.submit(rid, GREEDY, rid)

    eng.step_to_wait_for = gated
    served = AsyncEngine(eng)
    loop = asyncio.new_event_loop()
    try:
        first = loop.run_until_complete(submit("first"))
        loop.run_until_complete(first.__anext__())
        hold.set()
        assert until(lambda: gates and gates[-1].waited.is_set())
        steps, waiting = len(eng.stats), len(gates)
        second = loop.run_until_complete(submit("second"))
        assert until(lambda: "second" in eng.requests)  # taken in while the step runs
        time.sleep(0.3)
        assert len(eng.stats) == steps, "planned before the step in flight ended"
        gates[-1].open.set()  # the step ends: the next plan takes "second"
        assert until(lambda: len(gates) > waiting)
        assert len(eng.stats) == steps + 1
        assert eng.requests["second"].seqs[0].num_computed > 0  # in the step just sent
        hold.clear()
        for g in gates:
            g.open.set()
        assert len(loop.run_until_complete(second.__anext__()).outputs[0].token_ids) == 1
    finally:
        hold.clear()
        for g in gates:
            g.open.set()
        served.shutdown()
        loop.close()


def test_an_engine_with_no_room_or_a_queue_is_not_waited_for():
    eng = engine(async_scheduling=True, max_num_seqs=2)
    assert eng.step_to_wait_for() is None  # nothing in flight
    eng.add_request("a", "one", GREEDY)
    eng.step()
    assert eng.step_to_wait_for() is not None  # one running, a slot free
    eng.add_request("b", "two", GREEDY)
    eng.add_request("c", "three", GREEDY)
    eng.step()
    assert eng.step_to_wait_for() is None  # both slots taken, "c" waits
    run(eng, [])


def test_shutdown_waits_for_the_step_being_watched():
    """A daemon thread still inside a jax call at interpreter exit aborts the process
    ("FATAL: exception not rethrown", seen in CI as a served CLI exiting with -6), so
    shutdown returns only once the watcher has left the step it waits on."""
    eng = engine(async_scheduling=True)
    gate = _Gate()
    eng.step_to_wait_for = lambda: gate if eng._in_flight is not None else None
    served = AsyncEngine(eng)
    loop = asyncio.new_event_loop()

    async def submit():
        return served.submit("a", GREEDY, "a")

    try:
        loop.run_until_complete(submit())
        assert gate.waited.wait(30)
        threading.Timer(0.3, gate.open.set).start()
        served.shutdown()
        assert gate.open.is_set(), "shutdown returned while the watcher was in the step"
        assert not served._thread.is_alive() and not served._watcher.is_alive()
    finally:
        gate.open.set()
        loop.close()
