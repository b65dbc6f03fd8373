"""OpenAI request bodies -> paged-jax requests, and RequestOutputs -> OpenAI response bodies.

Field names are OpenAI's (/v1/completions, /v1/chat/completions) plus the SamplingParams
fields vLLM accepts as extra body fields (top_k, min_p, repetition_penalty, ignore_eos, ...).
A field paged-jax does not serve is refused with an error naming it, never ignored.
"""

from __future__ import annotations

import time
import uuid

from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from paged_jax.serve import fields, messages
from paged_jax.serve.fields import GUIDED, STRUCTURED

BadRequest = fields.BadRequest  # what api.py answers with OpenAI's error body


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError",
            500: "InternalServerError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sampling_params(body: dict, logprobs: int | None, max_tokens: int | None = 16
                    ) -> SamplingParams:
    """SamplingParams of a request body (OpenAI's defaults: temperature 1; `max_tokens` when
    the body has none: 16 for completions, the rest of the context for chat, as in vLLM).
    SamplingParams' own checks name a bad value; the error's `param` is that field."""
    kw = {dst: body[src] for src, dst in fields.SAMPLING.items() if body.get(src) is not None}
    kw.update({k: body[k] for k in fields.EXTRA if body.get(k) is not None})
    limit = next((k for k in ("max_completion_tokens", "max_tokens")
                  if body.get(k) is not None), None)
    kw["max_tokens"] = body[limit] if limit else max_tokens
    if body.get("logit_bias"):
        kw["logit_bias"] = fields.logit_bias(body["logit_bias"])
    if (constraint := structured_outputs(body)) is not None:
        kw["structured_outputs"] = constraint
    try:
        return SamplingParams(**kw, logprobs=logprobs)
    except (TypeError, ValueError) as e:
        name = str(e).split(" ", 1)[0].split(".", 1)[0].split("=", 1)[0]
        param = {"max_tokens": limit, "logprobs": "top_logprobs" if "top_logprobs" in body
                 else "logprobs"}.get(name) or name
        # the body's own name for the field (max_completion_tokens for SamplingParams' max_tokens)
        raise BadRequest(str(e).replace(name, param, 1),
                         param if param in body else None) from None


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The body's output constraint (None: none), from at most one of response_format,
    structured_outputs and the guided_* fields; a bad one is refused naming its field."""
    given = sorted(k for k in STRUCTURED if body.get(k) is not None
                   and body.get(k) != {"type": "text"})
    if len(given) > 1:
        raise BadRequest(f"give one output constraint, not {', '.join(given)}", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name in GUIDED:
        value = {GUIDED[name]: value}
    elif name == "response_format":
        value = response_format(value)
    try:
        return StructuredOutputsParams.of(value)
    except ValueError as e:
        raise BadRequest(str(e) if str(e).startswith(name) else f"{name}: {e}", name) from None


JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def response_format(value: dict) -> dict:
    """OpenAI's response_format as StructuredOutputsParams fields: {"type": "json_object"},
    or {"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}.

    The schema is always enforced (every token is masked to what it can continue with):
    strict=true asks for exactly that; strict=false (or absent) lets OpenAI treat the schema
    as a hint, and an enforced schema is a valid answer to a hint, so both are served alike,
    as vLLM serves them. A non-boolean strict, or any other key, is refused."""
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if kind not in ("json_object", "json_schema") or extra or (
            kind == "json_object" and "json_schema" in value):
        raise BadRequest(f"response_format must be {{\"type\": \"text\"}}, {{\"type\": "
                         f"\"json_object\"}} or {{\"type\": \"json_schema\", \"json_schema\": "
                         f"{{...}}}}, got {fields.show(value)}", "response_format")
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise BadRequest("response_format json_schema needs json_schema.schema, a JSON "
                         "schema object", "response_format")
    if extra := sorted(set(spec) - JSON_SCHEMA_KEYS):
        raise BadRequest(f"response_format.json_schema has unsupported key(s) "
                         f"{', '.join(extra)}", "response_format")
    for key, kind_ok in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_ok):
            raise BadRequest(f"response_format.json_schema.{key} must be a "
                             f"{'boolean' if kind_ok is bool else 'string'}, got "
                             f"{fields.show(spec[key])}", "response_format")
    return {"json": spec["schema"]}


def completion_request(body: dict) -> tuple[list, SamplingParams | BeamSearchParams]:
    """(prompts, params) of a /v1/completions body; a prompt is text or token ids. With
    vLLM's `use_beam_search`, the params are a beam search's (n beams)."""
    fields.check_body(body, fields.COMPLETION_FIELDS, fields.COMPLETION_TYPES)
    if body.get("use_beam_search"):
        return _prompts(body.get("prompt")), beam_params(body)
    if body.get("echo"):
        raise BadRequest("echo is not supported", "echo")
    if body.get("suffix"):
        raise BadRequest("suffix is not supported", "suffix")
    if body.get("best_of") not in (None, body.get("n") or 1):
        raise BadRequest("best_of must equal n (beam-style best_of is not supported)",
                         "best_of")
    return _prompts(body.get("prompt")), sampling_params(body, body.get("logprobs"))


def beam_params(body: dict) -> BeamSearchParams:
    """BeamSearchParams of a `use_beam_search` body: n beams (best_of, if given, must equal
    n), max_tokens (16 by default), temperature 0 (its default here), ignore_eos,
    length_penalty and the logit bias fields; any other field is refused by name."""
    other = sorted(k for k in body if k not in fields.BEAM_FIELDS and body[k] is not None)
    if other:
        raise BadRequest(f"{other[0]} is not supported with use_beam_search", other[0])
    given = lambda k, default: default if body.get(k) is None else body[k]  # noqa: E731
    if body.get("best_of") not in (None, given("n", 1)):
        raise BadRequest("best_of must equal n (the beams returned)", "best_of")
    kw = {k: body[k] for k in ("ignore_eos", "length_penalty", "allowed_token_ids",
                               "bad_words", "temperature") if body.get(k) is not None}
    if body.get("logit_bias"):
        kw["logit_bias"] = fields.logit_bias(body["logit_bias"])
    try:
        return BeamSearchParams(beam_width=given("n", 1), max_tokens=given("max_tokens", 16),
                                **kw)
    except (TypeError, ValueError) as e:
        name = {"beam_width": "n"}.get(str(e).split(" ", 1)[0], str(e).split(" ", 1)[0])
        raise BadRequest(str(e), name if name in body else None) from None


def _prompts(prompt: object) -> list:
    """A completions `prompt` as the engine's prompts (text, or {"prompt_token_ids": ...};
    ids past the vocabulary are the engine's check)."""
    def ids(p: object) -> bool:
        return isinstance(p, list) and bool(p) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)

    if isinstance(prompt, str) or ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p)
                                                     for p in prompt):
        prompts = list(prompt)
    else:
        raise BadRequest(f"prompt must be a string, a list of token ids, or a list of either, "
                         f"got {fields.show(prompt)}", "prompt")
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]


def chat_request(body: dict, tokenizer) -> tuple[str, SamplingParams]:
    """(rendered prompt, params) of a /v1/chat/completions body (messages.py: what each
    message may hold and how it reaches the chat template)."""
    fields.check_body(body, fields.CHAT_FIELDS, fields.CHAT_TYPES)
    if body.get("messages") is None:
        raise BadRequest("messages must be a non-empty list of messages", "messages")
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") else None
    params = sampling_params(body, logprobs, max_tokens=None)
    return messages.render(body["messages"], tokenizer), params


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
