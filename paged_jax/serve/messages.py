"""A chat body's `messages` -> the prompt its model's chat template renders from them.

Each message is checked, and every malformed part is a 400 naming it (`messages[i].role`):

    role        a string, passed to the template as given: the template decides what a role
                means, as in vLLM and transformers. SmolLM2's ChatML and the test model's
                template render any role as a header ("<|im_start|>narrator"); a template
                that refuses a role (raise_exception) is a 400 naming `messages`.
    content     a string; a list of text parts ({"type": "text", "text": ...}), joined;
                null only on an assistant message (rendered as ""), as OpenAI allows there.
    name, tool_call_id, tool_calls
                passed to the template when it uses them: the prompt is rendered without
                each such field too, and a field whose prompt comes out the same (the
                template never reads it) is refused rather than silently dropped.
    anything else (function_call, refusal, audio, ...): refused.
"""

from __future__ import annotations

import jinja2

from paged_jax.serve.fields import BadRequest, show

PASSED = ("name", "tool_call_id", "tool_calls")  # served when the template reads them
KEYS = {"role", "content", *PASSED}


def render(messages: list, tokenizer) -> str:
    """The prompt of a chat body's `messages` (fields.check_body checked it is a non-empty
    list), with the generation prompt; a malformed message is a BadRequest naming it."""
    flat = [_message(m, i) for i, m in enumerate(messages)]
    prompt = _apply(tokenizer, flat)
    for i, m in enumerate(flat):
        for key in PASSED:
            if key in m:
                without = [*flat[:i], {k: v for k, v in m.items() if k != key}, *flat[i + 1:]]
                if _apply(tokenizer, without) == prompt:
                    raise BadRequest(f"messages[{i}].{key} is not used by this model's chat "
                                     "template (refused rather than ignored)",
                                     f"messages[{i}].{key}")
    return prompt


def _apply(tokenizer, flat: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(flat, add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as e:  # the template's own refusal
        raise BadRequest(f"the chat template refused the messages: {e}", "messages") from None


def _message(m: object, i: int) -> dict:
    """One message as the template reads it (content as one string)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object with a role and content, got {show(m)}",
                         where)
    if extra := sorted(set(m) - KEYS):
        raise BadRequest(f"unsupported field(s) {', '.join(f'{where}.{k}' for k in extra)}; "
                         f"a message may hold {', '.join(sorted(KEYS))}", f"{where}.{extra[0]}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise BadRequest(f"{where}.role must be a non-empty string, got {show(role)}",
                         f"{where}.role")
    out = {"role": role, "content": _content(m.get("content"), role, where)}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise BadRequest(f"{where}.{key} must be a string, got {show(m[key])}",
                                 f"{where}.{key}")
            out[key] = m[key]
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise BadRequest(f"{where}.tool_calls must be a list of objects, got "
                             f"{show(calls)}", f"{where}.tool_calls")
        out["tool_calls"] = calls
    return out


def _content(content: object, role: str, where: str) -> str:
    """A message's content as one string: text, or text parts joined."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of text parts"
                         f"{'' if role == 'assistant' else ' (null only on assistant messages)'}"
                         f", got {show(content)}", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise BadRequest(f"{at} must be a content part object, got {show(part)}", at)
        if part.get("type") != "text":
            raise BadRequest(f"{at}.type must be \"text\" (only text parts are served), got "
                             f"{show(part.get('type'))}", f"{at}.type")
        if extra := sorted(set(part) - {"type", "text"}):
            raise BadRequest(f"unsupported field(s) {', '.join(f'{at}.{k}' for k in extra)}; "
                             "a text part holds type and text", f"{at}.{extra[0]}")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{at}.text must be a string, got {show(part.get('text'))}",
                             f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)
