"""engine/warmup.py: after warm-up, serving builds no program; the server answers 503
"warming" until it is warm, and keeps the requests that arrive meanwhile."""

from __future__ import annotations

import time

import httpx
import pytest

from paged_jax.engine import warmup
from paged_jax.engine.programs import PROGRAMS
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import BUCKETS, engine, run

# Small buckets: few programs (rows 1, 2, 4; tokens 16 and 64), every kind of step.
SMALL = dict(BUCKETS, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=60,
             check=False)
SYSTEM = "a shared system prompt of some length. "


def whole_blocks(n: int) -> dict:
    """A prompt of n token ids (n a multiple of the block size: a second request of it hits
    every block but recomputes its last token inside the last, shared one: a copy)."""
    return {"prompt_token_ids": [(7 * n + 3 * i) % 200 + 1 for i in range(n)]}


def workload() -> list[tuple]:
    """Greedy and sampled requests; one-token and chunked prompts; more requests than rows;
    whole-block prompts (run again later: copy-on-write)."""
    reqs = [(f"w{n}", whole_blocks(n), SamplingParams(max_tokens=3, temperature=0))
            for n in (16, 24, 40)]
    for i in range(14):
        prompt = "x" if i == 5 else SYSTEM + "question " * (i % 4) + "y" * (i * 11 % 70)
        sp = SamplingParams(max_tokens=3 + i % 7, temperature=0.0 if i % 2 else 0.7, seed=i,
                            ignore_eos=True)
        reqs.append((f"r{i}", prompt, sp))
    return reqs


@pytest.mark.parametrize("mode", ["async", "windows"])
def test_no_program_is_built_after_warm_up(mode):
    kw = dict(async_scheduling=True, decode_window=1) if mode == "async" else \
        dict(async_scheduling=False, decode_window=4)
    eng = engine(**SMALL, **kw)
    report = eng.warm_up("auto")
    assert report.planned == report.built + report.present > 10
    built = PROGRAMS.built
    reqs = workload()
    run(eng, reqs[:3])
    # whole-block prompts again: alone (one token each, copied into: a decode-only step
    # with admissions and copies), then beside a new long prompt (a prefill step with copies)
    again = [(f"again-{rid}", p, sp) for rid, p, sp in reqs[:3]]
    run(eng, again[:2])
    run(eng, [(f"long-{r}", SYSTEM * 3, sp) for r, _, sp in again[2:]] + again)
    run(eng, reqs[3:])  # a burst: mixed prefill + decode steps at every row count
    assert eng.prefix.hit_rate > 0
    assert PROGRAMS.built == built, "serving met a shape warm-up did not build"
    assert eng.warm_up("auto").built == 0  # all present now


def test_a_warm_up_builds_what_the_same_run_would_have_built():
    """The same workload without warm-up builds programs (so the test above can fail)."""
    from paged_jax.compile_cache import clear_programs

    eng = engine(**SMALL, async_scheduling=True, decode_window=1)
    clear_programs()
    built = PROGRAMS.built
    run(eng, workload())
    assert PROGRAMS.built > built


def test_levels_are_checked_and_mapping_limit_refused(monkeypatch):
    eng = engine(**SMALL)
    with pytest.raises(ValueError, match="warm-up level 'most'"):
        eng.warm_up("most")
    assert eng.warm_up("none").planned == 0
    monkeypatch.setattr(warmup, "MAPPINGS_PER_PROGRAM", 10**6)
    monkeypatch.setattr(warmup, "plan", lambda *a: [warmup.Item("ops", "ops")] * 2)
    from paged_jax.compile_cache import clear_programs

    clear_programs()
    with pytest.raises(ValueError, match="vm.max_map_count"):
        eng.warm_up("full")
    from paged_jax.serve.api import build_app
    from tests.serve_helpers import MODEL, tiny_llm

    with pytest.raises(ValueError, match="vm.max_map_count"):  # the server does not start
        build_app(tiny_llm(), MODEL, warmup="auto")


def test_full_adds_filters_and_logprobs():
    eng = engine(**SMALL)
    ec = eng.config
    auto, full = (warmup.plan(level, ec, "cpu", True) for level in ("auto", "full"))
    assert len(full) - 1 == 3 * (len(auto) - 1)  # the ops call once
    assert {i.shape.flags.filters for i in full if i.shape} == {False, True}
    assert {i.shape.flags.num_top_logprobs for i in full if i.shape} == {0, ec.max_logprobs}


def test_server_is_warming_then_ready_and_keeps_early_requests():
    from paged_jax.compile_cache import clear_programs
    from paged_jax.serve.api import build_app
    from paged_jax.serve.background import Server
    from tests.serve_helpers import MODEL, tiny_llm

    clear_programs()  # none built by an earlier test: the server starts cold
    seen = []
    llm = tiny_llm(static_shapes=False, max_num_seqs=2, max_num_batched_tokens=32)
    app = build_app(llm, MODEL, warmup="auto", on_warm=lambda *a: seen.append(a))
    with Server(app) as srv:
        first = httpx.get(srv.url + "/health", timeout=10)
        body = {"model": MODEL, "prompt": "early", "max_tokens": 4, "temperature": 0}
        early = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
        deadline = time.time() + 300
        while (health := httpx.get(srv.url + "/health", timeout=10)).status_code != 200:
            assert time.time() < deadline and health.json()["status"] == "warming"
            time.sleep(0.2)
    assert first.status_code == 503 and first.json()["status"] == "warming"
    assert early.status_code == 200 and early.json()["usage"]["completion_tokens"] == 4
    assert seen and seen[-1][0] == MODEL and seen[-1][2] == seen[-1][3]  # done == total
