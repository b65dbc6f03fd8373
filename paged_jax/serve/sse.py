"""Streaming responses: engine outputs -> OpenAI chunks (text deltas) -> server-sent events.

Each engine step's output holds a request's whole text so far; a chunk carries what is new
since the last one, per choice. A client that goes away cancels the response's generator;
its `finally` closes the streams, which aborts the requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from paged_jax.outputs import RequestOutput
from paged_jax.serve import protocol as proto
from paged_jax.serve.async_engine import RequestStream


async def events(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> AsyncIterator[str]:
    """"data: {chunk}" events, then "data: [DONE]"."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.close()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _deltas(sent: dict, key, out: RequestOutput):
    """(choice, new text, first new token index) for each choice with something new.

    Text that ends in an incomplete UTF-8 character (U+FFFD until the next token completes
    it) is held back until it is complete or the choice finishes, so the deltas add up to
    the final text."""
    for c in out.outputs:
        text_at, tok_at = sent.get((key, c.index), (0, 0))
        text = c.text if c.finish_reason else c.text.rstrip("\ufffd")
        if len(text) > text_at or len(c.token_ids) > tok_at or c.finish_reason:
            sent[(key, c.index)] = (max(len(text), text_at), len(c.token_ids))
            yield c, text[text_at:], tok_at, text_at


async def completion_chunks(rid: str, streams: list[RequestStream], n: int,
                            include_usage: bool) -> AsyncIterator[dict]:
    """Chunks of every stream, each named after the model serving it (`stream.served`)."""
    sent, last = {}, {}
    async for i, out in _merged(streams):
        last[i] = out
        model, tok = streams[i].served.name, streams[i].served.tok
        for c, delta, tok_at, text_at in _deltas(sent, i, out):
            yield {"id": rid, "object": "text_completion", "created": int(time.time()),
                   "model": model,
                   "choices": [{"index": i * n + c.index, "text": delta,
                                "logprobs": proto.completion_logprobs(c, tok_at, tok, text_at),
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason}]}
    if include_usage:
        yield {"id": rid, "object": "text_completion", "created": int(time.time()),
               "model": proto.model_name([s.served for s in streams]), "choices": [],
               "usage": proto.usage(list(last.values()))}


async def chat_chunks(rid: str, stream: RequestStream,
                      include_usage: bool) -> AsyncIterator[dict]:
    sent, roled, last = {}, set(), None
    model, tok = stream.served.name, stream.served.tok

    def chunk(choice: dict) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model, "choices": [choice]}

    async for out in stream:
        last = out
        for c, delta, tok_at, _ in _deltas(sent, 0, out):
            if c.index not in roled:  # OpenAI's first delta of a choice names the role
                roled.add(c.index)
                yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            yield chunk({"index": c.index, "delta": {"content": delta},
                         "logprobs": proto.chat_logprobs(c, tok_at, tok),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    if include_usage and last is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
               "model": model, "choices": [], "usage": proto.usage([last])}
