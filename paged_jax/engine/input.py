"""Input processing: a request's prompt parsed into token ids, and every check that a
request can be served, run at submission (a request that fails one is never admitted).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.engine.sequence import Request, Sequence
from paged_jax.models import ModelConfig
from paged_jax.sample.state import MAX_STOP_IDS
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.models.tokenizer import Tokenizer


def make_request(request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                 tok: Tokenizer | None, ec, mc: ModelConfig, arrival_time: float) -> Request:
    """A checked request with its n sequences; raises ValueError naming what is wrong."""
    text, ids = prompt_ids(prompt, tok)
    params = check_fits(params, ids, ec, mc)
    check_tokenizer(params, tok)
    req = Request(request_id, text, ids, params, arrival_time, order=-1)
    req.banned_ids = bad_word_ids(params, tok)
    if params.prompt_logprobs is not None:
        req.prompt_logprobs = [None] * len(ids)
    req.seqs = [Sequence(i, list(ids), len(ids), owner=req) for i in range(params.n)]
    return req


def prompt_ids(prompt: str | list[int] | dict,
               tok: Tokenizer | None) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, token ids, or vLLM's dict forms (text
    needs a tokenizer)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _check_ids(list(prompt["prompt_token_ids"]))
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict needs a 'prompt' or 'prompt_token_ids' key, "
                             f"got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError("this engine has no tokenizer: pass the prompt as "
                             "{'prompt_token_ids': [...]}")
        return prompt, _check_ids(tok.encode(prompt))
    if isinstance(prompt, list | tuple):
        return None, _check_ids(list(prompt))
    raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt)}")


def check_tokenizer(params: SamplingParams, tok: Tokenizer | None) -> None:
    """Without a tokenizer (vLLM's skip_tokenizer_init), nothing may need text."""
    if tok is not None:
        return
    for name, used in (("detokenize=True", params.detokenize), ("bad_words", params.bad_words),
                       ("stop strings", params.stop)):
        if used:
            raise ValueError(f"{name} needs a tokenizer, and this engine has none "
                             "(pass detokenize=False, no stop strings or bad_words)")


def _check_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    if not all(isinstance(i, int | np.integer) and i >= 0 for i in ids):
        raise ValueError("prompt_token_ids must be non-negative ints")
    return [int(i) for i in ids]


def check_fits(params: SamplingParams, ids: list[int], ec, mc: ModelConfig) -> SamplingParams:
    """Rejects a request that could never be served; fills max_tokens=None up to the limit."""
    if max(ids) >= mc.vocab_size:
        raise ValueError(f"prompt token id {max(ids)} is outside the model's vocabulary "
                         f"(vocab_size {mc.vocab_size})")
    prompt_len = len(ids)
    room = ec.max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt has {prompt_len} tokens, but max_model_len is "
                         f"{ec.max_model_len}: no room for any output token")
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=room)
    if prompt_len + params.max_tokens > ec.max_model_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                         f"exceeds max_model_len ({ec.max_model_len})")
    if params.n > ec.max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={ec.max_num_seqs}")
    # n sequences may each have to be recomputed privately after a preemption.
    blocks = params.n * ec.cache.peak_blocks(prompt_len + params.max_tokens,
                                             ec.max_num_batched_tokens)
    if blocks > ec.num_kv_blocks - 1:
        raise ValueError(f"request needs up to {blocks} KV blocks (n={params.n} x "
                         f"{prompt_len + params.max_tokens} tokens) but the cache holds "
                         f"{ec.num_kv_blocks - 1}")
    if len(params.stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} ids; at most "
                         f"{MAX_STOP_IDS} are supported")
    if params.stop_token_ids and max(params.stop_token_ids) >= mc.vocab_size:
        raise ValueError(f"stop_token_ids {max(params.stop_token_ids)} is outside the model's "
                         f"vocabulary (vocab_size {mc.vocab_size})")
    for name, ids in (("logit_bias", list(params.logit_bias or {})),
                      ("allowed_token_ids", list(params.allowed_token_ids or []))):
        if ids and max(ids) >= mc.vocab_size:
            raise ValueError(f"{name} has token id {max(ids)}, outside the model's vocabulary "
                             f"(vocab_size {mc.vocab_size})")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > ec.max_logprobs:
            raise ValueError(f"{name}={k} exceeds the engine's max_logprobs={ec.max_logprobs}")
    return params


def bad_word_ids(params: SamplingParams, tok: Tokenizer) -> tuple[int, ...]:
    """The token ids a request's bad_words ban: each word as written and after a space (as
    vLLM tokenizes them). Only single-token words are supported: vLLM also bans the last
    token of a longer word after its prefix, which would need the output on the device."""
    out = []
    for word in params.bad_words or []:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tok.encode(text)
            if len(ids) != 1:
                raise ValueError(f"bad_words: {text!r} is {len(ids)} tokens; only words that "
                                 "are a single token (with and without a leading space) are "
                                 "supported")
            out.append(ids[0])
    return tuple(dict.fromkeys(out))
