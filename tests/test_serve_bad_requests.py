"""Malformed OpenAI requests, as a new user sends them: every malformed field of every endpoint
is a 400 whose message and `param` name it, never a 500 nor a silent 200.

One tiny-model app in this process (FastAPI's TestClient: no port, lifespan run and stopped;
each request bounded by `post`'s timeout). Each case changes one field of a valid body; the
valid bodies pass the same validation (protocol.completion_request / chat_request), so a
400 can only come from the field the case changed. Chat messages: roles reach the chat
template as given (the template decides what a role means); name / tool_call_id /
tool_calls are served when the template reads them, else refused (serve/messages.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from paged_jax.models.testing import byte_tokenizer
from paged_jax.models.tokenizer import Tokenizer
from paged_jax.serve import protocol as proto
from paged_jax.serve.api import build_app
from tests.serve_helpers import MODEL, tiny_llm

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
MISSING = object()  # a case that drops the field
USER = {"role": "user", "content": "hi"}

# (field, malformed value, what the error must name): fields both endpoints serve.
COMMON = [
    ("model", 5, "model"), ("model", ["tiny"], "model"), ("model", {"a": 1}, "model"),
    ("max_tokens", "2", "max_tokens"), ("max_tokens", 2.5, "max_tokens"),
    ("max_tokens", True, "max_tokens"), ("max_tokens", 0, "max_tokens"),
    ("temperature", "hot", "temperature"), ("temperature", True, "temperature"),
    ("temperature", -1, "temperature"), ("temperature", [1], "temperature"),
    ("top_p", "x", "top_p"), ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"),
    ("n", "2", "n"), ("n", 1.5, "n"), ("n", 0, "n"),
    ("seed", "7", "seed"), ("seed", 1.5, "seed"), ("seed", True, "seed"),
    ("stop", {"a": 1}, "stop"), ("stop", [1], "stop"), ("stop", ["ok", 2], "stop"),
    ("stop", 5, "stop"), ("stop", [""], "stop"),
    ("presence_penalty", "x", "presence_penalty"), ("presence_penalty", 3, "presence_penalty"),
    ("frequency_penalty", [0], "frequency_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("top_k", "x", "top_k"), ("top_k", 1.5, "top_k"), ("top_k", -2, "top_k"),
    ("min_p", "x", "min_p"), ("min_p", 2, "min_p"),
    ("repetition_penalty", "x", "repetition_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("ignore_eos", "yes", "ignore_eos"), ("ignore_eos", 1, "ignore_eos"),
    ("min_tokens", "1", "min_tokens"), ("min_tokens", -1, "min_tokens"),
    ("stop_token_ids", "1", "stop_token_ids"), ("stop_token_ids", [1.5], "stop_token_ids"),
    ("stop_token_ids", {"1": 1}, "stop_token_ids"), ("stop_token_ids", [-1], "stop_token_ids"),
    ("skip_special_tokens", "no", "skip_special_tokens"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output"),
    ("allowed_token_ids", [], "allowed_token_ids"), ("allowed_token_ids", ["a"],
                                                     "allowed_token_ids"),
    ("allowed_token_ids", 5, "allowed_token_ids"), ("allowed_token_ids", [999],
                                                    "allowed_token_ids"),
    ("bad_words", "abc", "bad_words"), ("bad_words", [1], "bad_words"),
    ("logit_bias", [1], "logit_bias"), ("logit_bias", "x", "logit_bias"),
    ("logit_bias", {"a": 1}, "logit_bias"), ("logit_bias", {"1": "2"}, "logit_bias"),
    ("logit_bias", {"1": 500}, "logit_bias"), ("logit_bias", {"1": True}, "logit_bias"),
    ("stream", "yes", "stream"), ("stream", 1, "stream"),
    ("stream_options", 5, "stream_options"),
    ("stream_options", {"include_usage": True}, "stream_options"),  # without stream: true
    ("user", 5, "user"),
    ("response_format", "json", "response_format"),
    ("response_format", {"type": "xml"}, "response_format"),
    ("response_format", {"type": "text", "extra": 1}, "response_format"),
    ("response_format", {"type": "json_schema"}, "response_format"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": []}},
     "response_format"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {},
                                                                "strict": "yes"}}, "strict"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}, "name": 5}},
     "name"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}},
     "response_format"),
    ("response_format", {"type": "json_object", "json_schema": {}}, "response_format"),
    ("structured_outputs", "x", "structured_outputs"),
    ("structured_outputs", {"foo": 1}, "structured_outputs"),
    ("structured_outputs", {"regex": 5}, "structured_outputs"),
    ("guided_json", 5, "guided_json"), ("guided_json", "{not json", "guided_json"),
    ("guided_regex", 5, "guided_regex"), ("guided_choice", "a", "guided_choice"),
    ("guided_choice", [1], "guided_choice"), ("guided_grammar", ["x"], "guided_grammar"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tools"),
    ("tool_choice", "auto", "tool_choice"), ("functions", [], "functions"),
    ("frobnicate", 1, "frobnicate"),
]
COMPLETION_ONLY = [
    ("prompt", 5, "prompt"), ("prompt", MISSING, "prompt"), ("prompt", [], "prompt"),
    ("prompt", [True], "prompt"), ("prompt", [[1, "a"]], "prompt"), ("prompt", {"a": 1},
                                                                      "prompt"),
    ("prompt", [-1], "prompt"), ("prompt", [999], "prompt"), ("prompt", [[]], "prompt"),
    ("logprobs", "2", "logprobs"), ("logprobs", True, "logprobs"), ("logprobs", -1, "logprobs"),
    ("logprobs", 1.5, "logprobs"), ("logprobs", 99, "logprobs"),
    ("echo", "yes", "echo"), ("echo", True, "echo"),
    ("suffix", 5, "suffix"), ("suffix", "x", "suffix"),
    ("best_of", "2", "best_of"), ("best_of", 3, "best_of"),
    ("messages", [USER], "messages"), ("top_logprobs", 2, "top_logprobs"),
    ("max_completion_tokens", 2, "max_completion_tokens"),
]
CHAT_ONLY = [
    ("messages", "hi", "messages"), ("messages", [], "messages"),
    ("messages", MISSING, "messages"), ("messages", None, "messages"),
    ("messages", [5], "messages[0]"), ("messages", [USER, "oops"], "messages[1]"),
    ("messages", [{"content": "hi"}], "messages[0].role"),
    ("messages", [{"role": 5, "content": "hi"}], "messages[0].role"),
    ("messages", [{"role": "", "content": "hi"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": 5}], "messages[0].content"),
    ("messages", [{"role": "user", "content": None}], "messages[0].content"),
    ("messages", [{"role": "user"}], "messages[0].content"),
    ("messages", [{"role": "user", "content": {"text": "hi"}}], "messages[0].content"),
    ("messages", [{"role": "user", "content": [5]}], "messages[0].content[0]"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}], "messages[0].content[0].type"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}],
     "messages[0].content[0].text"),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}],
     "messages[0].content[0].text"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}],
     "messages[0].content[0].x"),
    # fields the test model's template never reads: refused, not dropped
    ("messages", [{**USER, "name": "bob"}], "messages[0].name"),
    ("messages", [{**USER, "name": 5}], "messages[0].name"),
    ("messages", [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[1].tool_calls"),
    ("messages", [USER, {"role": "assistant", "content": "x", "tool_calls": "f"}],
     "messages[1].tool_calls"),
    ("messages", [{"role": "tool", "content": "4", "tool_call_id": "1"}],
     "messages[0].tool_call_id"),
    ("messages", [{**USER, "function_call": {"name": "f"}}], "messages[0].function_call"),
    ("messages", [{**USER, "refusal": None}], "messages[0].refusal"),
    ("logprobs", "yes", "logprobs"), ("logprobs", 1, "logprobs"),
    ("top_logprobs", "2", "top_logprobs"), ("top_logprobs", 2, "top_logprobs"),
    ("top_logprobs", 1.5, "top_logprobs"),
    ("max_completion_tokens", "2", "max_completion_tokens"),
    ("max_completion_tokens", 0, "max_completion_tokens"),
    ("prompt", "hi", "prompt"), ("echo", False, "echo"), ("best_of", 1, "best_of"),
]
CASES = ([("/v1/completions", COMPLETION, *c) for c in COMMON + COMPLETION_ONLY]
         + [("/v1/chat/completions", CHAT, *c) for c in COMMON + CHAT_ONLY])


def case_id(case: tuple) -> str:
    url, _, field, value, _ = case
    shown = "missing" if value is MISSING else repr(value)
    return f"{url.split('/')[-1]}-{field}={shown[:40]}"


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(tiny_llm(), MODEL), raise_server_exceptions=False) as c:
        yield c


_POOL = ThreadPoolExecutor(1)


def post(client: TestClient, url: str, timeout: float = 60, **kw) -> httpx.Response:
    """client.post, failing after `timeout` seconds instead of hanging (TestClient itself
    takes no timeout)."""
    return _POOL.submit(client.post, url, **kw).result(timeout=timeout)


def with_field(base: dict, field: str, value: object) -> dict:
    body = {k: v for k, v in base.items() if k != field}
    if value is not MISSING:
        body[field] = value
    if field == "stream_options" and isinstance(value, dict) and value != {
            "include_usage": True}:
        body["stream"] = True  # the key's own check, not "stream_options needs stream"
    if field == "top_logprobs" and value != 2:
        body["logprobs"] = True  # the value's own check, not "needs logprobs: true"
    return body


def test_the_valid_bodies_pass():
    """The bases every case changes are valid: a case's 400 comes from its own field."""
    assert proto.completion_request(COMPLETION)[0] == ["hi"]
    assert proto.chat_request(CHAT, byte_tokenizer())[0] == "<user>hi\n<assistant>"


def test_a_routers_no_op_fields_pass_and_any_other_value_is_refused():
    """vllm-router adds no_stop_trim / return_hidden_states (false) to what it forwards."""
    body = dict(COMPLETION, no_stop_trim=False, return_hidden_states=False)
    assert proto.completion_request(body)[0] == ["hi"]
    for field in ("no_stop_trim", "return_hidden_states"):
        with pytest.raises(proto.BadRequest, match=f"unsupported field.*{field}"):
            proto.completion_request(dict(body, **{field: True}))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_malformed_field_is_a_400_naming_it(client, case):
    url, base, field, value, named = case
    r = post(client, url, json=with_field(base, field, value))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert named in error["message"], error
    assert error["param"] is not None and error["param"].split(".")[0].split("[")[0] in (
        field, named), error
    assert error["type"] == "BadRequestError" and error["code"] == 400


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"null", b"5"])
def test_a_body_that_is_no_json_object_is_a_400(client, url, raw):
    r = post(client, url, content=raw)
    assert r.status_code == 400 and "body" in r.json()["error"]["message"]


def test_unknown_roles_reach_the_template_as_written(client):
    """A role the OpenAI API does not define is rendered as the chat template renders it
    (the test model's: "<role>"; SmolLM2's ChatML: "<|im_start|>role"), as vLLM passes it
    on, and the request is served."""
    body = {**CHAT, "messages": [{"role": "narrator", "content": "hi"}], "max_tokens": 1}
    assert proto.chat_request(body, byte_tokenizer())[0] == "<narrator>hi\n<assistant>"
    r = post(client, "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("<narrator>hi\n<assistant>")


def tokenizer_with(template: str) -> Tokenizer:
    tok = byte_tokenizer()
    return Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=tok.eos_token_ids,
                     chat_template=template)


def test_a_template_that_refuses_a_role_is_a_400():
    strict = tokenizer_with(
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    body = {"messages": [{"role": "narrator", "content": "hi"}]}
    with pytest.raises(proto.BadRequest, match="unknown role narrator") as e:
        proto.chat_request(body, strict)
    assert e.value.param == "messages" and e.value.status == 400


def test_name_and_tool_fields_are_served_when_the_template_reads_them():
    tok = tokenizer_with(
        "{% for m in messages %}<{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}>"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}"
        "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ m['content'] }}"
        "{% endfor %}")
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "user", "content": "hi", "name": "bob"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "4", "tool_call_id": "1"}]}
    assert proto.chat_request(body, tok)[0] == "<user bob>hi<assistant>[f]<tool>(1)4"


@pytest.mark.parametrize("strict", [True, False, None, "absent"])
def test_a_json_schema_is_enforced_whatever_strict_says(strict):
    """strict=false lets OpenAI treat the schema as a hint; an enforced schema answers a hint
    too, so every strict is served as the same constraint (test_structured_outputs' server
    test sends strict=false and validates the output against the schema)."""
    spec = {"name": "pet", "schema": {"type": "object"}}
    if strict != "absent":
        spec["strict"] = strict
    body = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": spec}}
    constraint = proto.completion_request(body)[1].structured_outputs
    assert constraint.kind == "json" and constraint.json == {"type": "object"}
