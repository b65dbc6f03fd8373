"""KV reservation policies (paper baselines) on the same engine: same outputs, fewer admitted."""

from __future__ import annotations

import pytest
from engine_helpers import engine

from paged_jax.sampling_params import SamplingParams
from paged_jax.study.reservation import POLICIES, Arena, make_policy, next_pow2

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def workload(n: int = 12) -> list[tuple[str, str]]:
    return [(f"r{i}", f"q{i} " + "ab" * (i % 5)) for i in range(n)]


def drive(eng, reqs) -> tuple[dict, list[set[str]]]:
    """Runs to completion; returns id -> token ids and the running ids after each step."""
    for rid, prompt in reqs:
        eng.add_request(rid, prompt, GREEDY)
    done, running = {}, []
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running.append({r.request_id for r in eng.scheduler.running})
    return done, running


def test_arena_first_fit_exact_positions():
    a = Arena(10)
    assert a.alloc("a", 4) and a.alloc("b", 3) and a.alloc("c", 3)
    assert a.used == {"a": (0, 4), "b": (4, 3), "c": (7, 3)}
    a.free("b")
    assert a.holes() == [3] and a.find(4) is None and a.find(3) == 4
    a.free("a")
    assert a.holes() == [7] and a.find(7) == 0


def test_reserved_tokens_per_policy():
    eng = engine()
    req = eng.add_request("x", [1] * 30, SamplingParams(max_tokens=20, ignore_eos=True))
    got = {p: make_policy(p, 8, 159, 256, 8).reserved_tokens(req) for p in POLICIES}
    assert got == {"paged": 0, "static": 256, "orca-max": 256, "orca-pow2": next_pow2(50),
                   "orca-oracle": 50}
    with pytest.raises(ValueError):
        make_policy("buddy", 8, 159, 256, 8)


@pytest.fixture(scope="module")
def runs() -> dict:
    return {p: drive(engine(policy=p), workload()) for p in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
def test_same_greedy_outputs_as_paged(runs, policy):
    done, _ = runs[policy]
    assert len(done) == 12
    assert done == runs["paged"][0]


def test_orca_max_admits_fewer_than_paged(runs):
    peak = {p: max(len(r) for r in runs[p][1]) for p in POLICIES}
    # 159 usable blocks / (256 tokens / 8 per block) = 4 reservations of max_model_len fit.
    assert peak["orca-max"] == 4 < peak["paged"]
    assert peak["orca-oracle"] >= peak["orca-pow2"] >= peak["orca-max"]


def test_static_admits_no_one_while_a_batch_runs(runs):
    _, running = runs["static"]
    prev: set[str] = set()
    for now in running:
        if now - prev:  # someone joined: only when the previous batch had fully ended
            assert not prev, (prev, now)
        prev = now
    assert max(len(r) for r in running) > 1  # batches, not one request at a time
