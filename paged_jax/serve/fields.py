"""OpenAI request fields: which each endpoint serves, and the JSON type each must have.

A malformed field is a 400 whose message and `param` name it, checked before any value
reaches SamplingParams or the chat template, where a wrong type could pass as another (a
dict `stop` read as its keys, a number read as text) or fail deep inside (a 500). null is
as absent, as in OpenAI's API. Ranges (temperature >= 0, n >= 1, ...) are SamplingParams'
own checks, whose messages start with the field's name (protocol.sampling_params).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable


class BadRequest(ValueError):
    """A request the server answers with 400 (or `status`) and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# OpenAI field -> SamplingParams field, for both endpoints.
SAMPLING = dict(n="n", temperature="temperature", top_p="top_p", seed="seed", stop="stop",
                presence_penalty="presence_penalty", frequency_penalty="frequency_penalty")
# vLLM's extra body fields, same names as SamplingParams.
EXTRA = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
         "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words")
# Structured outputs: OpenAI's response_format, vLLM's structured_outputs extra body field
# and its older guided_* fields.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED = {"response_format", "structured_outputs", *GUIDED}
COMMON = {"model", "stream", "stream_options", "user", "max_tokens", "logit_bias",
          *SAMPLING, *EXTRA, *STRUCTURED}
# Fields vllm-router (serve/cluster.py) adds to every /v1/completions body it forwards, at
# values that ask for nothing: served as absent. Any other value is refused as unsupported.
ROUTER_NO_OPS = {"no_stop_trim": False, "return_hidden_states": False}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix",
                               "use_beam_search", "length_penalty"}
# vLLM's beam search on /v1/completions (`use_beam_search`): the fields it reads; any other
# (stream, stop, logprobs, sampling knobs) is refused by name, not ignored.
BEAM_FIELDS = {"model", "user", "prompt", "n", "best_of", "max_tokens", "temperature",
               "ignore_eos", "length_penalty", "logit_bias", "allowed_token_ids", "bad_words",
               "use_beam_search"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a count


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _str(v: object) -> bool:
    return isinstance(v, str)


def _list_of(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


Kind = tuple[str, Callable[[object], bool]]  # (what the field must be, in words; its check)
INT: Kind = ("an integer", _int)
NUMBER: Kind = ("a number", _number)
BOOL: Kind = ("a boolean", lambda v: isinstance(v, bool))
STRING: Kind = ("a string", _str)
OBJECT: Kind = ("an object", lambda v: isinstance(v, dict))
INTS: Kind = ("a list of integers", _list_of(_int))
STRINGS: Kind = ("a list of strings", _list_of(_str))

TYPES: dict[str, Kind] = {
    "model": STRING, "user": STRING, "stream": BOOL, "stream_options": OBJECT,
    "max_tokens": INT, "max_completion_tokens": INT, "n": INT, "seed": INT, "top_k": INT,
    "min_tokens": INT, "best_of": INT, "top_logprobs": INT,
    "temperature": NUMBER, "top_p": NUMBER, "min_p": NUMBER, "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER, "repetition_penalty": NUMBER,
    "ignore_eos": BOOL, "skip_special_tokens": BOOL, "include_stop_str_in_output": BOOL,
    "echo": BOOL, "suffix": STRING,
    "stop": ("a string or a list of strings", lambda v: _str(v) or _list_of(_str)(v)),
    "stop_token_ids": INTS, "allowed_token_ids": INTS, "bad_words": STRINGS,
    "logit_bias": OBJECT, "response_format": OBJECT, "structured_outputs": OBJECT,
    "guided_json": ("a JSON schema (an object or JSON text)", lambda v: _str(v) or
                    isinstance(v, dict)),
    "guided_regex": STRING, "guided_choice": STRINGS, "guided_grammar": STRING,
    "messages": ("a non-empty list of messages", lambda v: isinstance(v, list) and bool(v)),
    "prompt": ("a string, a list of token ids, or a list of either", lambda v: True),
}
COMPLETION_TYPES = {**TYPES, "logprobs": INT,  # completions: how many top logprobs
                    "use_beam_search": BOOL, "length_penalty": NUMBER}
CHAT_TYPES = {**TYPES, "logprobs": BOOL}  # chat: whether; top_logprobs says how many


def show(value: object) -> str:
    """A short rendering of a JSON value for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def param_of(message: str) -> str | None:
    """The request field an engine error names (its messages start with the field's name:
    "prompt token id 999 is ...", "logprobs=9 exceeds ..."), or None."""
    word = re.split(r"[\s=:.\[]", message, maxsplit=1)[0]
    return word if word in COMPLETION_TYPES or word in CHAT_TYPES else None


def check_body(body: dict, allowed: set[str], types: dict[str, Kind]) -> None:
    """Refuses a field this endpoint does not serve, or one of the wrong JSON type, naming it
    (api._body checked the body is an object)."""
    unknown = sorted(k for k in set(body) - allowed if body[k] != ROUTER_NO_OPS.get(k, k))
    if unknown:
        raise BadRequest(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    for name, value in body.items():
        if name not in allowed:
            continue  # a router's field at its no-op value (ROUTER_NO_OPS)
        what, ok = types[name]
        if value is not None and not ok(value):
            raise BadRequest(f"{name} must be {what}, got {show(value)}", name)
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise BadRequest("stream_options is only allowed with stream: true",
                             "stream_options")
        if set(options) - {"include_usage"}:
            raise BadRequest(f"stream_options has unsupported key(s) "
                             f"{sorted(set(options) - {'include_usage'})}; only include_usage "
                             "is served", "stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise BadRequest(f"stream_options.include_usage must be a boolean, got "
                             f"{show(usage)}", "stream_options")


def logit_bias(value: dict) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}) as SamplingParams takes it."""
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {show(key)}",
                             "logit_bias") from None
        if not _number(bias) or not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100] (OpenAI's "
                             f"range), got {show(bias)} for {key}", "logit_bias")
        out[token] = float(bias)
    return out
