"""The OpenAI-compatible HTTP API over an `AsyncEngine` (FastAPI).

    POST /v1/completions        text or token-id prompts; stream: true -> server-sent events
    POST /v1/chat/completions   the model's chat template; stream: true -> SSE chunks
    GET  /v1/models             the one served model
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text, vLLM's metric names (metrics.py)

Errors carry OpenAI's body ({"error": {"message", "type", "param", "code"}}): 400 for a
malformed or bad request (the engine's own message: prompt too long, bad sampling values),
404 for an unknown model (as OpenAI and vLLM answer), 503 when `max_pending` requests are
queued or running already. Streams end with "data: [DONE]"; with
stream_options.include_usage a last chunk carries the usage, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_jax.llm import LLM
from paged_jax.outputs import RequestOutput
from paged_jax.serve import protocol as proto
from paged_jax.serve import sse
from paged_jax.serve.async_engine import AsyncEngine, QueueFull, RequestStream
from paged_jax.serve.metrics import ServerMetrics


@dataclasses.dataclass
class Served:
    """What the routes use: the engine thread, its metrics, the tokenizer, the model's name."""

    llm: LLM
    name: str
    engine: AsyncEngine
    metrics: ServerMetrics

    @property
    def tok(self):
        return self.llm.get_tokenizer()


def build_app(llm: LLM, model_name: str, max_pending: int = 256) -> FastAPI:
    """The app serving `llm` as `model_name`; its engine thread stops with the app."""
    metrics = ServerMetrics(model_name)
    engine = AsyncEngine(llm.llm_engine, max_pending, on_step=metrics.after_step,
                         on_abort=lambda rid: metrics.aborted())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.shutdown()

    app = FastAPI(title="paged-jax", lifespan=lifespan)
    app.state.served = Served(llm, model_name, engine, metrics)
    app.add_exception_handler(proto.BadRequest, _bad_request)
    app.include_router(router)
    return app


router = APIRouter()


async def _bad_request(_req, exc: proto.BadRequest) -> JSONResponse:
    return JSONResponse(proto.error_body(str(exc), exc.status, exc.param), exc.status)


@router.get("/health")
async def health(request: Request) -> Response:
    alive = request.app.state.served.engine.error is None
    return Response(status_code=200 if alive else 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.served.metrics.text(),
                    media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    srv = request.app.state.served
    return {"object": "list", "data": [{
        "id": srv.name, "object": "model", "created": int(time.time()),
        "owned_by": "paged-jax", "max_model_len": srv.llm.engine_config.max_model_len}]}


@router.post("/v1/completions")
async def completions(request: Request):
    srv: Served = request.app.state.served
    body = await _body(request, srv.name)
    prompts, params = proto.completion_request(body)
    rid = proto.new_id("cmpl")
    streams = await _submit(srv.engine, prompts, params, rid)
    if body.get("stream"):
        chunks = sse.completion_chunks(rid, srv.name, streams, params.n, srv.tok,
                                       _include_usage(body))
        return StreamingResponse(sse.events(chunks, streams), media_type="text/event-stream")
    outs = await _collect(request, streams)
    return proto.completion_body(rid, srv.name, outs, params.n, srv.tok)


@router.post("/v1/chat/completions")
async def chat(request: Request):
    srv: Served = request.app.state.served
    body = await _body(request, srv.name)
    prompt, params = proto.chat_request(body, srv.tok)
    rid = proto.new_id("chatcmpl")
    streams = await _submit(srv.engine, [prompt], params, rid)
    if body.get("stream"):
        chunks = sse.chat_chunks(rid, srv.name, streams[0], srv.tok, _include_usage(body))
        return StreamingResponse(sse.events(chunks, streams), media_type="text/event-stream")
    return proto.chat_body(rid, srv.name, (await _collect(request, streams))[0], srv.tok)


async def _body(request: Request, model_name: str) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise proto.BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise proto.BadRequest("the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise proto.BadRequest(f"The model `{body.get('model')}` does not exist; this server "
                               f"serves `{model_name}`", "model", status=404)
    return body


def _include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


async def _submit(engine: AsyncEngine, prompts: list, params, rid: str) -> list[RequestStream]:
    """Submits every prompt, then waits for each one's first output, so that a full queue
    (503) or a request the engine refuses (400) is answered before any response starts."""
    streams = []
    try:
        for i, p in enumerate(prompts):
            streams.append(engine.submit(p, params, rid if len(prompts) == 1 else f"{rid}-{i}"))
        for s in streams:
            await s.peek()
    except QueueFull as e:
        _close(streams)
        raise proto.BadRequest(str(e), status=503) from None
    except ValueError as e:  # the engine's own check: prompt too long, bad values, ...
        _close(streams)
        raise proto.BadRequest(str(e)) from None
    except BaseException:
        _close(streams)
        raise
    return streams


def _close(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


async def _collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's final output; a client that hangs up meanwhile aborts the requests (a
    non-streaming handler is not cancelled when its client leaves, so it is watched)."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        _close(streams)

    watcher = asyncio.ensure_future(watch())
    try:
        return [await _last(s) for s in streams]
    finally:
        watcher.cancel()


async def _last(stream: RequestStream) -> RequestOutput:
    """The final output (aborting the request if this handler is cancelled)."""
    out = None
    try:
        async for item in stream:
            out = item
    finally:
        stream.close()
    return out
