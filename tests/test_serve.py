"""The OpenAI-compatible server, driven by the real `openai` client on a loopback port.

A tiny random model with a byte tokenizer (fast to compile); greedy answers over HTTP must be
the tokens offline `LLM.generate` gives. Every server here is started and stopped by its test,
and every request is bounded by a client timeout.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from paged_jax import SamplingParams
from tests.serve_helpers import MODEL, metric, serve, tiny_llm

pytestmark = pytest.mark.xdist_group("serve")  # one worker: compiled shapes are reused
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def client(srv, cls=openai.OpenAI):
    return cls(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)


def offline(prompts: list[str], max_tokens: int = 12) -> list[str]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in tiny_llm().generate(prompts, sp, use_tqdm=False)]


def test_models_health_metrics_and_completions():
    with serve() as srv:
        c = client(srv)
        assert [m.id for m in c.models.list().data] == [MODEL]
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        res = c.completions.create(model=MODEL, prompt="hello there", **GREEDY)
        assert res.choices[0].text == offline(["hello there"])[0]
        assert res.choices[0].finish_reason == "length"
        assert res.usage.completion_tokens == 12 and res.usage.prompt_tokens == 11
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 1
        assert metric(text, "vllm:generation_tokens_total") == 12
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 1
        # TTFT split as vLLM splits it: queueing + prefill = TTFT (one request)
        split = [metric(text, f"vllm:request_{k}_time_seconds_sum") for k in ("queue", "prefill")]
        assert min(split) >= 0 and sum(split) == pytest.approx(
            metric(text, "vllm:time_to_first_token_seconds_sum"), abs=1e-6)
        assert metric(text, "vllm:num_requests_running") == 0


def test_metrics_count_the_xla_programs_built():
    """paged_jax:xla_programs_built counts programs built in the process (a new jitted
    function adds one), and a request whose shapes were served before builds none."""
    import jax
    import jax.numpy as jnp

    built = lambda: metric(httpx.get(srv.url + "/metrics", timeout=10).text,  # noqa: E731
                           "paged_jax:xla_programs_built")
    with serve() as srv:
        c = client(srv)
        before = built()
        jax.jit(lambda x: x * 3.25 + 1.5)(jnp.ones(7)).block_until_ready()
        assert built() >= before + 1
        c.completions.create(model=MODEL, prompt="same shapes", **GREEDY)
        warm = built()
        c.completions.create(model=MODEL, prompt="same shapes", **GREEDY)
        assert built() == warm, "a request met shapes the first one compiled, yet built"


def test_streamed_equals_whole_and_usage_comes_last():
    with serve() as srv:
        c = client(srv)
        whole = c.completions.create(model=MODEL, prompt="stream me", **GREEDY)
        chunks = list(c.completions.create(model=MODEL, prompt="stream me", stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
        assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
        # One chunk per engine step (async scheduling, the default: every step delivered).
        assert len([ch for ch in chunks if ch.choices]) >= 12 // 4
        chat = [{"role": "user", "content": "hi"}]
        full = c.chat.completions.create(model=MODEL, messages=chat, **GREEDY)
        parts = list(c.chat.completions.create(model=MODEL, messages=chat, stream=True, **GREEDY))
        assert parts[0].choices[0].delta.role == "assistant"
        got = "".join(p.choices[0].delta.content or "" for p in parts)
        assert got == full.choices[0].message.content and len(got) > 0
        assert parts[-1].choices[0].finish_reason == "length"


def test_n_seed_logprobs_and_stop():
    with serve() as srv:
        c = client(srv)
        res = c.completions.create(model=MODEL, prompt="abc", n=3, temperature=1.0, seed=7,
                                   max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
        assert sorted(ch.index for ch in res.choices) == [0, 1, 2]
        again = c.completions.create(model=MODEL, prompt="abc", n=3, temperature=1.0, seed=7,
                                     max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
        assert [x.text for x in res.choices] == [x.text for x in again.choices]  # seeded
        lp = res.choices[0].logprobs
        assert len(lp.tokens) == 6 and all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
        text = offline(["abc"], 12)[0]
        stop = text[5:7]
        res = c.completions.create(model=MODEL, prompt="abc", stop=[stop], **GREEDY)
        assert res.choices[0].finish_reason == "stop" and stop not in res.choices[0].text


def test_32_concurrent_requests_match_offline_generate():
    prompts = [f"request {i}: " + "lorem " * (i % 5) for i in range(32)]
    want = offline(prompts)

    async def all_of(c):
        return await asyncio.gather(*(c.completions.create(model=MODEL, prompt=p, **GREEDY)
                                      for p in prompts))

    with serve() as srv:
        got = asyncio.run(all_of(client(srv, openai.AsyncOpenAI)))
        assert [r.choices[0].text for r in got] == want
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 32


def test_client_leaving_mid_stream_aborts_and_frees_blocks():
    with serve() as srv:
        body = dict(model=MODEL, prompt="a long one", max_tokens=200, temperature=0.0,
                    ignore_eos=True, stream=True)
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]  # a few events, then hang up
        assert got[0].startswith("data: ")
        deadline, text = time.time() + 30, ""
        while time.time() < deadline:
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            if metric(text, "vllm:request_success_total", finished_reason="abort") == 1:
                break
            time.sleep(0.2)
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        engine = srv.app.state.models[MODEL].engine.engine
        deadline = time.time() + 10
        while engine.kv.blocks_used() and time.time() < deadline:
            time.sleep(0.1)
        assert engine.kv.blocks_used() == 0 and not engine.has_unfinished()
        res = client(srv).completions.create(model=MODEL, prompt="still serving", **GREEDY)
        assert res.choices[0].text == offline(["still serving"])[0]


def test_a_non_streaming_client_that_gives_up_is_noticed():
    """The request needs 4000 tokens (seconds even on a fast spell: the tiny model decodes
    about 1,600 tokens/s at best here), the client gives up after 0.15 s: an abort, never a
    finished request (at 240 tokens a fast spell could finish first)."""
    with serve(max_model_len=4096, num_kv_blocks=560) as srv:
        engine = srv.app.state.models[MODEL].engine.engine
        body = dict(model=MODEL, prompt="a long one", max_tokens=4000, temperature=0.0,
                    ignore_eos=True)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.15)
        deadline, text = time.time() + 30, ""
        while time.time() < deadline:
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            if metric(text, "vllm:request_success_total", finished_reason="abort") == 1:
                break
            time.sleep(0.2)
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 0
        while (engine.has_unfinished() or engine.kv.blocks_used()) and time.time() < deadline:
            time.sleep(0.1)  # async scheduling: the step in flight at the abort is read next
        assert not engine.has_unfinished() and engine.kv.blocks_used() == 0


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving():
    with serve(max_model_len=64) as srv:
        c = client(srv)
        r = httpx.post(srv.url + "/v1/completions", content=b"{not json", timeout=10)
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            c.completions.create(model="nope", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            c.completions.create(model=MODEL, prompt="x", temperature=-1)
        with pytest.raises(openai.BadRequestError, match="max_model_len|longer"):
            c.completions.create(model=MODEL, prompt="x" * 100, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="unsupported field"):
            c.completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": 1})
        with pytest.raises(openai.BadRequestError, match="messages"):
            c.chat.completions.create(model=MODEL, messages=[])
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": 5},
                       timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        res = c.completions.create(model=MODEL, prompt="fine", **GREEDY)
        assert res.choices[0].text == offline(["fine"])[0]


def test_a_full_server_answers_503_and_loses_nothing():
    async def burst(c):
        reqs = [c.completions.create(model=MODEL, prompt=f"r{i}", max_tokens=30,
                                     temperature=0.0, extra_body={"ignore_eos": True})
                for i in range(12)]
        return await asyncio.gather(*reqs, return_exceptions=True)

    with serve(max_pending=4) as srv:
        results = asyncio.run(burst(client(srv, openai.AsyncOpenAI)))
        ok = [r for r in results if not isinstance(r, Exception)]
        full = [r for r in results if isinstance(r, openai.APIStatusError)
                and r.status_code == 503]
        assert len(ok) + len(full) == 12, [r for r in results if isinstance(r, Exception)]
        assert 4 <= len(ok) < 12 and all(len(r.choices[0].text) > 0 for r in ok)
        assert "full" in json.dumps(full[0].body)


def test_async_scheduling_streams_one_token_per_chunk_under_load():
    """8 concurrent streams on a server with async scheduling: every chunk carries exactly one
    token (counted by its logprobs), the texts are offline generate's, and once a client hangs
    up on an otherwise idle server the gauges say so at the next scrape (no step follows)."""
    prompts = [f"stream {i}: " + "lorem " * (i % 3) for i in range(8)]
    want = offline(prompts, 16)

    async def stream(c: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, list[int]]:
        body = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                    ignore_eos=True, stream=True, logprobs=1)
        text, sizes = "", []
        async with c.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    sizes.append(len(choice["logprobs"]["tokens"]))
        return text, sizes

    async def all_of(url: str):
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(stream(c, url, p) for p in prompts))

    with serve(async_scheduling=True) as srv:
        got = asyncio.run(all_of(srv.url))
        assert [t for t, _ in got] == want
        assert all(sizes == [1] * 16 for _, sizes in got), [s for _, s in got]
        body = dict(model=MODEL, prompt="a long one", max_tokens=200, temperature=0.0,
                    ignore_eos=True, stream=True)
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(3)]
        deadline, running = time.time() + 30, 1.0
        while running and time.time() < deadline:
            time.sleep(0.2)
            running = metric(httpx.get(srv.url + "/metrics", timeout=10).text,
                             "vllm:num_requests_running")
        assert running == 0


def test_beam_search_on_completions_runs_beside_sampled_requests():
    """vLLM's `use_beam_search`: n beams, best first, the offline LLM.beam_search's, while
    sampled requests run in the same steps and get their own tokens; fields beam search does
    not read are refused by name (stream included), and the server keeps serving."""
    from paged_jax.sampling_params import BeamSearchParams
    want = tiny_llm().beam_search(["beam me up"], BeamSearchParams(3, 8, ignore_eos=True))[0]
    prompts = [f"side {i} " * 3 for i in range(4)]
    beam = dict(model=MODEL, prompt="beam me up", n=3, max_tokens=8,
                extra_body={"use_beam_search": True, "ignore_eos": True})

    async def mixed(c):
        return await asyncio.gather(c.completions.create(**beam), *(
            c.completions.create(model=MODEL, prompt=p, **GREEDY) for p in prompts))

    with serve() as srv:
        res, *side = asyncio.run(mixed(client(srv, openai.AsyncOpenAI)))
        got = sorted(res.choices, key=lambda ch: ch.index)
        assert [ch.text for ch in got] == [s.text for s in want.sequences]
        assert res.usage.completion_tokens == 3 * 8 and got[0].logprobs is None
        assert [r.choices[0].text for r in side] == offline(prompts)
        for bad in ({"stream": True}, {"stop": ["x"]}, {"logprobs": 2}, {"temperature": 0.5},
                    {"n": 0}):
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "x", "use_beam_search": True, **bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == next(iter(bad)), r.json()
        res = client(srv).completions.create(model=MODEL, prompt="fine", **GREEDY)
        assert res.choices[0].text == offline(["fine"])[0]
