"""The server's "auto" model: each request is routed between the two served models by a
RoutedLLM's policy (routing/policies.py), as `RoutedLLM.generate` does offline.

    router.pre_route(prompt): the prompt head's choice before any model runs (the prompt
      and cascade-routing policies): submitted to that model as asked, streamed from its
      first token; otherwise (the cascade, and the rest of cascade routing):
    submit to the weak model's engine (logprobs and hidden state asked for)
      -> read its outputs until the router's window is full (or the answer ended)
      -> router.decide(...)
         weak:   the same stream goes on from there (outputs are cumulative, so the
                 client's first chunk holds the window's text); the probe's extra
                 logprobs are stripped
         strong: the weak request is aborted (its full prompt blocks stay in the weak
                 prefix cache) and the request is submitted to the strong model's engine

A cascaded request streams nothing until the router has read the weak model's window: its
first chunk holds the window's text (on the shipped pair's short answers, usually the whole
answer). Both engines run on their own threads, so moved requests decode on the strong model
while the weak one serves the rest. Responses name the model that served each request.
"""

from __future__ import annotations

import asyncio
import dataclasses

from paged_jax.outputs import RequestOutput
from paged_jax.routing.features import ready
from paged_jax.routing.router import RoutedLLM, as_asked
from paged_jax.sampling_params import SamplingParams
from paged_jax.serve.async_engine import RequestStream

AUTO = "auto"


class RoutedStream:
    """A routed request, read like the RequestStream of the model serving it (`served`);
    outputs carry that model's name and only the logprobs the client asked for."""

    def __init__(self, inner: RequestStream, served, asked: SamplingParams | None):
        self.inner, self.served, self._asked = inner, served, asked

    @property
    def finished(self) -> bool:
        return self.inner.finished

    async def peek(self) -> RequestOutput | None:
        out = await self.inner.peek()
        return None if out is None else self._fix(out)

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return self._fix(await self.inner.__anext__())

    def close(self) -> None:
        self.inner.close()

    def _fix(self, out: RequestOutput) -> RequestOutput:
        out = dataclasses.replace(out, model=self.served.name)
        return out if self._asked is None else as_asked(out, self._asked)


async def submit_all(router: RoutedLLM, weak, strong, prompts: list, params: SamplingParams,
                     ids: list[str], on_route=None) -> list[RoutedStream]:
    """Routes every prompt (text only: the two models' tokenizers differ); returns once each
    has been routed (its first output waiting on the model that serves it). On any error (a
    full queue, a request the engine refuses) every stream is closed and the first error
    raised."""
    for p in prompts:
        if not isinstance(p, str):
            raise ValueError(f'the "{AUTO}" model routes text prompts only (token ids belong '
                             "to one model's tokenizer)")
    firsts = []
    try:
        for p, rid in zip(prompts, ids, strict=True):
            route = router.pre_route(p)
            served = strong if route is not None and route.model == strong.name else weak
            s = served.engine.submit(p, params if route else router.probe_params(params), rid)
            s.served, s.route = served, route
            firsts.append(s)
    except BaseException:
        for s in firsts:
            s.close()
        raise
    routed = await asyncio.gather(*(_route(router, s, weak, strong, p, params, on_route)
                                     for s, p in zip(firsts, prompts, strict=True)),
                                  return_exceptions=True)
    errors = [r for r in routed if isinstance(r, BaseException)]
    if errors:
        for r, s in zip(routed, firsts, strict=True):
            (s if isinstance(r, BaseException) else r).close()
        raise errors[0]
    return routed


async def _route(router: RoutedLLM, stream: RequestStream, weak, strong, prompt: str,
                 params: SamplingParams, on_route) -> RoutedStream:
    if stream.route is not None:  # decided by the prompt head: streamed as it is
        if on_route is not None:
            on_route(stream.route)
        await stream.peek()  # a refusal surfaces here, before the response starts
        return RoutedStream(stream, stream.served, None)
    out = await stream.peek()
    while out is not None and not ready(out, router.window):
        await stream.__anext__()  # cumulative outputs: the next one holds this one's tokens
        out = await stream.peek()
    if out is None or not ready(out, router.window):
        return RoutedStream(stream, weak, params)  # ended before a token (aborted)
    route = router.decide(prompt, out)
    if on_route is not None:
        on_route(route)
    if route.model != strong.name:  # kept: later steps report only what was asked
        weak.engine.narrow_outputs(stream.request_id, params.logprobs,
                                   params.return_hidden_states)
        return RoutedStream(stream, weak, params)
    stream.close()
    moved = strong.engine.submit(prompt, params, stream.request_id)
    moved.served = strong
    await moved.peek()  # a refusal surfaces here, before the response starts
    return RoutedStream(moved, strong, None)
