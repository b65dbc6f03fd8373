"""OpenAI request bodies -> paged-jax requests, and RequestOutputs -> OpenAI response bodies.

Field names are OpenAI's (/v1/completions, /v1/chat/completions) plus the SamplingParams
fields vLLM accepts as extra body fields (top_k, min_p, repetition_penalty, ignore_eos, ...).
A field paged-jax does not serve is refused with an error naming it, never ignored.
"""

from __future__ import annotations

import time
import uuid

from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.sampling_params import SamplingParams


class BadRequest(ValueError):
    """A request the server answers with 400 (or `status`) and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# OpenAI field -> SamplingParams field, for both endpoints.
_SAMPLING = dict(n="n", temperature="temperature", top_p="top_p", seed="seed", stop="stop",
                 presence_penalty="presence_penalty", frequency_penalty="frequency_penalty")
# vLLM's extra body fields, same names as SamplingParams.
_EXTRA = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
          "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words")
# Structured outputs: OpenAI's response_format, vLLM's structured_outputs extra body field
# and its older guided_* fields.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED = {"response_format", "structured_outputs", *_GUIDED}
_COMMON = {"model", "stream", "stream_options", "user", "max_tokens", "logit_bias",
           *_SAMPLING, *_EXTRA, *_STRUCTURED}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError",
            500: "InternalServerError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def check_fields(body: dict, allowed: set[str]) -> None:
    """Refuses fields this server does not serve, naming them (api._body checked it is a dict)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unsupported field(s): {', '.join(unknown)}", unknown[0])


def sampling_params(body: dict, logprobs: int | None, max_tokens: int | None = 16
                    ) -> SamplingParams:
    """SamplingParams of a request body (OpenAI's defaults: temperature 1; `max_tokens` when
    the body has none: 16 for completions, the rest of the context for chat, as in vLLM;
    SamplingParams' own checks name a bad value)."""
    kw = {dst: body[src] for src, dst in _SAMPLING.items() if body.get(src) is not None}
    kw.update({k: body[k] for k in _EXTRA if body.get(k) is not None})
    kw["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens", max_tokens))
    if body.get("logit_bias"):
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise BadRequest(f"logit_bias must map token ids to numbers: {e}",
                             "logit_bias") from None
    if (constraint := structured_outputs(body)) is not None:
        kw["structured_outputs"] = constraint
    try:
        return SamplingParams(**kw, logprobs=logprobs)
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None


def structured_outputs(body: dict) -> dict | None:
    """The body's output constraint as StructuredOutputsParams fields (None: none), from at
    most one of response_format, structured_outputs and the guided_* fields."""
    given = sorted(k for k in _STRUCTURED if body.get(k) is not None
                   and body.get(k) != {"type": "text"})
    if len(given) > 1:
        raise BadRequest(f"give one output constraint, not {', '.join(given)}", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name in _GUIDED:
        return {_GUIDED[name]: value}
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise BadRequest("structured_outputs must be an object", name)
        return value
    return response_format(value)


def response_format(value) -> dict:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest("response_format json_schema needs json_schema.schema, a JSON "
                             "schema object", "response_format")
        return {"json": spec["schema"]}
    raise BadRequest(f"response_format type must be text, json_object or json_schema, got "
                     f"{kind!r}", "response_format")


def completion_request(body: dict) -> tuple[list, SamplingParams]:
    """(prompts, params) of a /v1/completions body; a prompt is text or token ids."""
    check_fields(body, COMPLETION_FIELDS)
    if body.get("echo"):
        raise BadRequest("echo is not supported", "echo")
    if body.get("suffix"):
        raise BadRequest("suffix is not supported", "suffix")
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise BadRequest("best_of must equal n (beam-style best_of is not supported)",
                         "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))
            for p in prompt):
        prompts = list(prompt)
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a list of either",
                         "prompt")
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return prompts, sampling_params(body, body.get("logprobs"))


def chat_request(body: dict, tokenizer) -> tuple[str, SamplingParams]:
    """(rendered prompt, params) of a /v1/chat/completions body."""
    check_fields(body, CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    flat = []
    for m in msgs:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message needs a role and content", "messages")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: only text is served
            if any(p.get("type") != "text" for p in content):
                raise BadRequest("only text content parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        flat.append({"role": m["role"], "content": content})
    try:
        prompt = tokenizer.apply_chat_template(flat, add_generation_prompt=True)
    except ValueError as e:
        raise BadRequest(str(e), "messages") from None
    top = body.get("top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") else None
    if top and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return prompt, sampling_params(body, logprobs, max_tokens=None)


# ---- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outs: list[RequestOutput]) -> dict:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_logprobs(c: CompletionOutput, start: int, tok, offset: int) -> dict | None:
    """OpenAI's completion logprobs of tokens start.. of `c`."""
    if c.logprobs is None:
        return None
    tokens, lps, tops, offs = [], [], [], []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
        text = tok.decode([tid])
        tokens.append(text)
        lps.append(entry[tid].logprob if tid in entry else None)
        tops.append({tok.decode([t]): lp.logprob for t, lp in entry.items()})
        offs.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(c: CompletionOutput, start: int, tok) -> dict | None:
    """OpenAI's chat logprobs ({"content": [...]}) of tokens start.. of `c`."""
    if c.logprobs is None:
        return None

    def item(tid, lp):
        text = tok.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
        own = item(tid, entry[tid].logprob if tid in entry else None)
        ranked = sorted(entry.items(), key=lambda e: e[1].rank or 0)
        own["top_logprobs"] = [item(t, lp.logprob) for t, lp in ranked]
        content.append(own)
    return {"content": content}


def model_name(served: list) -> str:
    """A response's model: the one that served every prompt, else "auto" (routed apart)."""
    names = {s.name for s in served}
    return names.pop() if len(names) == 1 else "auto"


def completion_body(rid: str, outs: list[RequestOutput], n: int, served: list) -> dict:
    """`served[i]` (with .name and .tok) is the model that served prompt i."""
    choices = [{"index": i * n + c.index, "text": c.text,
                "logprobs": completion_logprobs(c, 0, s.tok, 0),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for i, (o, s) in enumerate(zip(outs, served, strict=True)) for c in o.outputs]
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model_name(served), "choices": choices, "usage": usage(outs)}


def chat_body(rid: str, out: RequestOutput, served) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, served.tok), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
               for c in out.outputs]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": served.name, "choices": choices, "usage": usage([out])}
