"""Engine: batched == one-at-a-time, seeds, preemption, no leaks, no recompiles, stops.

Most tests run on static shapes (one program per kind of call: a few compiles); the two whose
subject is the shape buckets users get run on them, and batched (static) == one-at-a-time
(buckets) checks that both give the same tokens."""

import numpy as np
import pytest

from paged_jax.engine.programs import PROGRAMS
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import BUCKETS, GREEDY, all_free, engine, prompts, run, tokens


@pytest.fixture(scope="module")
def batched_greedy():
    eng = engine()
    outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(prompts(32))], check=True)
    assert all_free(eng)
    return outs


def test_batched_equals_one_at_a_time(batched_greedy):
    eng = engine(**BUCKETS)
    for i, p in enumerate(prompts(32)):
        single = run(eng, [(f"s{i}", p, GREEDY)])
        assert tokens(single, f"s{i}") == tokens(batched_greedy, str(i)), f"prompt {i}"
    assert all_free(eng)


@pytest.mark.parametrize("mode, swap_blocks", [("recompute", 0), ("swap", 1000), ("swap", 3)])
def test_forced_preemption_loses_nothing(batched_greedy, mode, swap_blocks):
    """swap_blocks: the swap space in blocks (3: most preemptions must recompute instead)."""
    eng = engine(num_kv_blocks=20, preemption_mode=mode)
    eng.kv.swap_space = swap_blocks * eng.kv.block_bytes
    peak, step = 0, eng.step

    def watched_step():  # swap-outs happen while the step plans
        nonlocal peak
        out = step()
        peak = max(peak, eng.kv.swapped_bytes)
        return out

    eng.step = watched_step
    outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(prompts(32))], check=True)
    assert sum(s.preempted for s in eng.stats) > 0, "the tiny cache should force preemption"
    assert eng.refused_steps == 0, "the scheduler planned more blocks than were free"
    for i in range(32):
        assert tokens(outs, str(i)) == tokens(batched_greedy, str(i)), f"prompt {i}"
    assert all_free(eng)
    assert peak <= eng.kv.swap_space and eng.kv.swapped_bytes == 0
    assert (peak == 0) if mode == "recompute" else (peak > 0 or swap_blocks < 1000)


def test_seeded_sampling_independent_of_batch():
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                        ignore_eos=True)
    target = "the same request"
    alone = tokens(run(engine(), [("x", target, sp)]), "x")
    others = [(str(i), p, SamplingParams(temperature=1.0, seed=i, max_tokens=9))
              for i, p in enumerate(prompts(6))]
    mixed = run(engine(decode_window=1), others[:3] + [("x", target, sp)] + others[3:])
    assert tokens(mixed, "x") == alone
    assert tokens(run(engine(), [("x", target, sp)]), "x") == alone  # and across runs


def test_parallel_sampling_shares_prompt_blocks():
    prompt = "a shared prompt that spans several blocks of the cache " * 2
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    eng = engine()
    eng.add_request("p", prompt, sp)
    peak = 0
    while eng.has_unfinished():
        outs = eng.step()
        peak = max(peak, eng.config.num_kv_blocks - 1 - int(eng.state.pool.num_free))
    n_prompt = len(eng.tokenizer.encode(prompt))
    independent = 4 * -(-(n_prompt + 4) // 8)
    assert peak < independent / 2, (peak, independent)
    out = outs[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all_free(eng)


def test_abort_frees_everything():
    eng = engine()
    for i, p in enumerate(prompts(6)):
        eng.add_request(str(i), p, GREEDY)
    eng.step()
    eng.step()
    for i in range(0, 6, 2):
        eng.abort(str(i))
    done = run(eng, [])
    assert sorted(done) == ["1", "3", "5"]
    assert all_free(eng)


def test_no_recompilation_after_warmup():
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(12))]
    run(engine(**BUCKETS), reqs)  # warm-up: compiles every bucket this workload uses
    built = PROGRAMS.built
    run(engine(**BUCKETS), [(f"b{i}", p, sp) for i, p, sp in reqs])
    assert PROGRAMS.built == built


def test_stop_strings_tokens_min_tokens_and_logprobs(batched_greedy):
    ref = tokens(batched_greedy, "3")[0]
    eng = engine()
    text = eng.tokenizer.decode(ref)
    stop_str = text[5:8]
    outs = run(eng, [
        ("stop_id", prompts(32)[3], SamplingParams(temperature=0, max_tokens=24,
                                                    stop_token_ids=[ref[4]])),
        ("stop_str", prompts(32)[3], SamplingParams(temperature=0, max_tokens=24,
                                                     stop=[stop_str])),
        ("lp", prompts(32)[3], SamplingParams(temperature=0, max_tokens=3, logprobs=2)),
    ])
    c = outs["stop_id"].outputs[0]
    assert c.token_ids == ref[:5] and c.finish_reason == "stop" and c.stop_reason == ref[4]
    c = outs["stop_str"].outputs[0]
    assert c.text == text[: text.find(stop_str)] and c.stop_reason == stop_str
    c = outs["lp"].outputs[0]
    pairs = list(zip(c.token_ids, c.logprobs, strict=True))
    assert len(pairs) == 3 and all(tok in d for tok, d in pairs)
    assert np.isclose(sum(d[t].logprob for t, d in pairs), c.cumulative_logprob, atol=1e-4)
    assert all(x.decoded_token == eng.tokenizer.decode([i], False)
               for _, d in pairs for i, x in d.items())


def test_min_tokens_holds_back_a_stop_token():
    eng = engine()
    # stop_token_ids=[x] with x the greedy first token would end after one token.
    first = tokens(run(eng, [("a", "eos test", GREEDY)]), "a")[0][0]
    outs = run(eng, [("b", "eos test", SamplingParams(temperature=0, max_tokens=8,
                                                      stop_token_ids=[first], min_tokens=3))])
    c = outs["b"].outputs[0]
    assert len(c.token_ids) >= 3  # min_tokens holds the stop back


@pytest.mark.parametrize("bad, match", [
    ("x" * 300, "max_model_len"),
    ("", "empty"),
    ({"foo": 1}, "prompt_token_ids"),
    ([1, -2], "non-negative"),
    ([1, 9999], "vocab"),
])
def test_bad_prompts_are_rejected_clearly(bad, match):
    eng = engine()
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", bad, SamplingParams(max_tokens=8))
    assert not eng.has_unfinished()


def test_request_larger_than_cache_is_rejected():
    eng = engine(num_kv_blocks=10)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("big", "y" * 40, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request("lp", "y", SamplingParams(max_tokens=2, logprobs=10))


@pytest.mark.parametrize("params, match", [
    (SamplingParams(max_tokens=4, stop_token_ids=list(range(1, 10))), "at most 8"),
    (SamplingParams(max_tokens=4, stop_token_ids=[10**6]), "vocabulary"),
])
def test_bad_parameters_are_rejected_at_submission_and_the_engine_keeps_serving(params, match):
    eng = engine()
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", "a prompt", params)
    assert not eng.has_unfinished() and "bad" not in eng.requests
    outs = run(eng, [("good", "a prompt", GREEDY)])
    assert len(tokens(outs, "good")[0]) == GREEDY.max_tokens


def test_logit_bias_and_allowed_ids_in_the_engine_leave_other_requests_alone(batched_greedy):
    eng = engine()
    sp = lambda **kw: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)  # noqa: E731
    outs = run(eng, [("0", prompts(32)[0], GREEDY),
                     ("allowed", prompts(32)[1], sp(allowed_token_ids=[65, 66])),
                     ("bias", prompts(32)[2], sp(logit_bias={90: 1e4}))])
    assert set(tokens(outs, "allowed")[0]) <= {65, 66}
    assert tokens(outs, "bias")[0] == [90] * 12
    assert tokens(outs, "0") == tokens(batched_greedy, "0")  # same slots, rows not biased
    with pytest.raises(ValueError, match="bad_words.*2 tokens"):  # a byte tokenizer: " x"
        eng.add_request("bad", "p", sp(bad_words=["x"]))
    with pytest.raises(ValueError, match="allowed_token_ids.*vocabulary"):
        eng.add_request("bad", "p", sp(allowed_token_ids=[10**6]))
    assert all_free(eng) and not eng.has_unfinished()


def test_decode_window_matches_single_steps(batched_greedy):
    outs = run(engine(decode_window=1),
               [(str(i), p, GREEDY) for i, p in enumerate(prompts(8))])
    for i in range(8):
        assert tokens(outs, str(i)) == tokens(batched_greedy, str(i))


def test_preemption_never_plans_more_blocks_than_are_free():
    """A decode takes the last free block, the next decode preempts a request: the blocks the
    preemption frees must be counted net of what the plan already claimed, or the device
    refuses the step (and, before this was fixed, the engine could repeat it forever)."""
    from paged_jax.study.workloads import make_workload

    eng = engine(num_kv_blocks=17, max_model_len=64)
    items = make_workload("alpaca", 24, float("inf"), eng.tokenizer, 0, 0.5, 64)
    for w in items:
        eng.add_request(w.request_id, {"prompt_token_ids": w.prompt_token_ids}, w.params())
    steps = 0
    while eng.has_unfinished() and steps < 1000:
        eng.step()
        steps += 1
    assert not eng.has_unfinished() and sum(s.preempted for s in eng.stats) > 0
    assert eng.refused_steps == 0
    assert all_free(eng)


# ---- one step = one jitted call and one device -> host read ---------------------------------
class DeviceTraffic:
    """Counts jitted calls (the runner's programs) and device -> host reads (jax.device_get,
    numpy conversions of jax arrays, scalar conversions) while installed."""

    def __init__(self, monkeypatch):
        import jax
        from jax._src import array as jarray

        from paged_jax.engine import runner
        from paged_jax.engine.programs import Programs

        self.calls = self.reads = 0
        self._inside = 0
        # every step, window, verify and ops call goes through the programs table
        monkeypatch.setattr(Programs, "call", self._count_call(Programs.call))
        monkeypatch.setattr(runner, "_restore", self._count_call(runner._restore))
        monkeypatch.setattr(runner.jax, "device_get", self._count_read(jax.device_get))
        monkeypatch.setattr(np, "asarray", self._count_read(np.asarray, arrays_only=True))
        monkeypatch.setattr(np, "array", self._count_read(np.array, arrays_only=True))
        value = jarray.ArrayImpl._value  # int(x), bool(x), x.tolist() read through it

        def counted(arr):
            if arr._npy_value is None and not self._inside:
                self.reads += 1
            return value.fget(arr)

        monkeypatch.setattr(jarray.ArrayImpl, "_value", property(counted))

    def _count_call(self, f):
        def g(*a, **k):
            self.calls += 1
            return f(*a, **k)
        return g

    def _count_read(self, f, arrays_only=False):
        import jax

        def g(x, *a, **k):
            if (arrays_only and not isinstance(x, jax.Array)) or self._inside:
                return f(x, *a, **k)
            self.reads += 1
            self._inside += 1
            try:
                return f(x, *a, **k)
            finally:
                self._inside -= 1
        return g


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_jitted_call_and_one_read_per_step(monkeypatch, async_scheduling):
    """Admissions, prefix hits and registrations, n > 1 forks, stop strings, aborts and
    preemption in a small pool: every step is one jitted call and one device -> host read
    (async scheduling: each call is read once, a step later, or at once where the next plan
    needs exact counts)."""
    eng = engine(num_kv_blocks=28, decode_window=4, check=False,
                 async_scheduling=async_scheduling)
    system = "a shared system prompt, long enough for two blocks. "
    for i in range(10):
        sp = SamplingParams(temperature=0.8 if i % 3 == 0 else 0.0, n=2 if i % 3 == 0 else 1,
                            seed=i, max_tokens=6 + 3 * (i % 4), ignore_eos=True,
                            stop=["e"] if i % 4 == 1 else None)
        eng.add_request(str(i), system + f"question {i} " * (i % 3), sp)
    eng.step()  # compiles outside the count
    traffic = DeviceTraffic(monkeypatch)
    per_step, steps = [], 0
    while eng.has_unfinished():
        before = (traffic.calls, traffic.reads)
        eng.step()
        steps += 1
        if steps == 3:
            eng.abort("9")  # an abort while others run rides in the next step
        per_step.append((traffic.calls - before[0], traffic.reads - before[1]))
    monkeypatch.undo()
    assert eng.scheduler.num_preempted > 0 and eng.prefix.hit_rate > 0
    assert max(c for c, _ in per_step) == 1, per_step
    if async_scheduling:
        assert traffic.calls == traffic.reads, per_step
    else:
        assert max(r for _, r in per_step) == 1, per_step
    eng.kv.check()
    assert all_free(eng)


# ---- bounded memory -------------------------------------------------------------------------
def footprint(root) -> dict[str, int]:
    """Lengths of every container reachable from `root` through object attributes (device
    and numpy arrays, modules, functions and locks are leaves), by attribute path."""
    import collections
    import types

    import jax

    sizes, seen = {}, set()

    def walk(x, path: str) -> None:
        if id(x) in seen or isinstance(x, jax.Array | np.ndarray | types.ModuleType |
                                       types.FunctionType | type | str | bytes):
            return
        seen.add(id(x))
        if isinstance(x, dict | list | set | tuple | collections.deque):
            sizes[path] = len(x)
            items = x.items() if isinstance(x, dict) else enumerate(x)
            for k, v in list(items)[:64]:  # elements of one kind: a few stand for all
                walk(v, f"{path}[{type(k).__name__}]")
        elif hasattr(x, "__dict__") and not callable(x):
            for k, v in vars(x).items():
                walk(v, f"{path}.{k}")

    walk(root, "engine")
    return sizes


def test_a_long_run_holds_no_more_than_a_short_one():
    """After 4,000 more requests the engine holds what it held before: no per-request or
    per-step state only grows (requests, skips, stats, prefix cache, slots)."""
    eng = engine(check=False, admission="cache-aware")
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    count = iter(range(10**6))

    def serve(n: int) -> None:
        for _ in range(n // 64):  # arrivals in bursts, as a server sees them
            for _ in range(64):
                i = next(count)
                eng.add_request(f"r{i}", [1 + i % 97, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], sp)
            while eng.has_unfinished():
                eng.step()

    serve(2_048)  # past every bounded buffer's size (stats keeps the last 256 steps)
    short = footprint(eng)
    serve(4_096)
    assert footprint(eng) == short


def test_a_finished_sample_takes_no_slot_when_its_request_is_admitted_again():
    """An n = 2 request whose first sample has ended (a stop string would end it) is
    preempted and admitted again: only its live sample gets a slot back, so every slot is
    free once it finishes (a slot given to the finished one was held for good before)."""
    eng = engine(check=True, max_num_seqs=4)
    req = eng.add_request("a", "hello there", SamplingParams(
        n=2, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True))
    while not req.forked:
        eng.step()
    eng.step()
    eng.scheduler.free([req.seqs[1]])
    eng.scheduler.preempt(req)
    while eng.has_unfinished():
        eng.step()
    assert all_free(eng) and len(eng.kv.free_slots) == 4 and not eng.kv.owners
