"""The server's "auto" model (routing.RoutedLLM behind the OpenAI API), on two tiny models:
each routed answer names its model and is that model's own answer, decided as offline."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from paged_jax.routing.router import RoutedLLM
from paged_jax.serve.api import build_app
from tests.routing_helpers import PROMPTS, SP, median_threshold, tiny_pair
from tests.serve_helpers import Server, metric

pytestmark = pytest.mark.xdist_group("serve")
GREEDY = dict(temperature=0.0, max_tokens=SP.max_tokens, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served():
    """A routed server, plus what the same router and each model give offline (computed
    before the server's engine threads own the engines)."""
    weak, strong, head = tiny_pair()
    router = RoutedLLM(weak, strong, head, threshold=median_threshold(head), names=("w", "s"))
    expected = {o.prompt: (o.model, o.outputs[0].text) for o in router.generate(PROMPTS, SP)}
    assert {m for m, _ in expected.values()} == {"w", "s"}
    alone = {n: [o.outputs[0].text for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
             for n, llm in (("w", weak), ("s", strong))}
    with Server(build_app(router)) as srv:
        yield srv, expected, alone


def client(srv, cls=openai.OpenAI):
    return cls(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)


def test_auto_answers_as_the_model_it_routes_to(served):
    srv, expected, alone = served
    c = client(srv)
    assert [m.id for m in c.models.list().data] == ["w", "s", "auto"]

    async def all_at_once():
        ac = client(srv, openai.AsyncOpenAI)
        return await asyncio.gather(*(ac.completions.create(model="auto", prompt=p, **GREEDY)
                                      for p in PROMPTS))

    for p, res in zip(PROMPTS, asyncio.run(all_at_once()), strict=True):
        assert (res.model, res.choices[0].text) == expected[p]
        assert res.choices[0].text == alone[res.model][PROMPTS.index(p)]
        assert res.choices[0].logprobs is None  # the router's probe is not leaked
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    counts = {m: metric(text, "paged_jax:routed_requests_total", routed_to=m) for m in "ws"}
    assert sum(counts.values()) == len(PROMPTS) and min(counts.values()) >= 1
    for m in "ws":  # each model's own request metrics, in the one registry
        assert metric(text, "vllm:request_success_total", model_name=m,
                      finished_reason="length") >= counts[m]


def test_auto_streams_chats_and_named_models(served):
    srv, expected, alone = served
    c = client(srv)
    p = PROMPTS[-1]
    chunks = list(c.completions.create(model="auto", prompt=p, stream=True, **GREEDY))
    assert {ch.model for ch in chunks} == {expected[p][0]}
    assert "".join(ch.choices[0].text for ch in chunks) == expected[p][1]
    both = c.completions.create(model="auto", prompt=PROMPTS[:6], **GREEDY)
    assert [ch.text for ch in both.choices] == [expected[q][1] for q in PROMPTS[:6]]
    assert both.model == "auto"  # its prompts went to different models
    res = c.completions.create(model="s", prompt=PROMPTS[0], **GREEDY)
    assert (res.model, res.choices[0].text) == ("s", alone["s"][0])
    chat = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, temperature=0.0)
    assert chat.model in ("w", "s") and chat.choices[0].finish_reason in ("length", "stop")
    kept = next(q for q in PROMPTS if expected[q][0] == "w")
    res = c.completions.create(model="auto", prompt=kept, logprobs=2, **GREEDY)
    assert all(len(t) <= 3 for t in res.choices[0].logprobs.top_logprobs)  # asked 2 (+ own)


def test_auto_refuses_what_it_cannot_route(served):
    srv, *_ = served
    c = client(srv)
    with pytest.raises(openai.BadRequestError, match="text prompts only"):
        c.completions.create(model="auto", prompt=[1, 2, 3], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        c.completions.create(model="auto", prompt="x" * 5000, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="`w`, `s`, `auto`"):
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    res = c.completions.create(model="auto", prompt=PROMPTS[0], **GREEDY)  # still serving
    assert res.choices[0].finish_reason == "length"

