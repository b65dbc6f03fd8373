"""The OpenAI-compatible HTTP API over `AsyncEngine`s (FastAPI): one model, or a RoutedLLM's
two models plus "auto" (each request routed by the router's policy; serve/routed.py).

    POST /v1/completions        text or token-id prompts; stream: true -> server-sent events
    POST /v1/chat/completions   the model's chat template; stream: true -> SSE chunks
    GET  /v1/models             the served models ("auto" too when routing)
    GET  /health                200 while the engine threads run and are warm; 503 with
                                {"status": "warming", ...} during warm-up, else 503
    GET  /metrics               Prometheus text, vLLM's metric names (metrics.py)
    GET  /get_load              {"load": requests running or waiting} (routers read it)

Errors carry OpenAI's body ({"error": {"message", "type", "param", "code"}}): 400 for a
malformed or bad request, naming the field (fields.py: every field's JSON type; messages.py:
chat messages; the engine's own message: prompt too long, bad sampling values),
404 for an unknown model (as OpenAI and vLLM answer), 503 when `max_pending` requests are
queued or running already. Streams end with "data: [DONE]"; with
stream_options.include_usage a last chunk carries the usage, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_jax.engine.sleep import Sleeping
from paged_jax.llm import LLM
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import RequestOutput
from paged_jax.routing.router import RoutedLLM
from paged_jax.sampling_params import BeamSearchParams
from paged_jax.serve import admin, sse
from paged_jax.serve import protocol as proto
from paged_jax.serve.async_engine import AsyncEngine, QueueFull, RequestStream
from paged_jax.serve.fields import param_of, show
from paged_jax.serve.metrics import ServerMetrics
from paged_jax.serve.routed import AUTO, submit_all


@dataclasses.dataclass
class Served:
    """One served model: its LLM, its name, its engine thread and its metrics; a LoRA
    adapter served by name shares its base model's and has `lora`."""

    llm: LLM
    name: str
    engine: AsyncEngine
    metrics: ServerMetrics
    lora: LoRARequest | None = None
    parent: str | None = None  # an adapter's base model

    @property
    def tok(self):
        return self.llm.get_tokenizer()


def build_app(llm: LLM | RoutedLLM, model_name: str | None = None,
              max_pending: int = 256, plan_eagerly: bool = False, warmup: str = "none",
              on_warm=None, lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The app serving `llm` as `model_name`; or, given a RoutedLLM, its two models under
    their names (`router.names`) and "auto" (each request routed by the router's head).
    Engine threads stop with the app; `plan_eagerly` as in AsyncEngine. `warmup`: the level
    each engine builds its programs at before its first step (engine/warmup.py; /health
    answers 503 "warming" until all are built), `on_warm(model, phase, done, total)` its
    progress. `lora_modules`: adapter name -> PEFT folder, each served as a model of its own
    on `llm` (needs enable_lora; vLLM's --lora-modules)."""
    router_ = llm if isinstance(llm, RoutedLLM) else None
    if router_ and (len(set(router_.names)) < 2 or AUTO in router_.names):
        raise ValueError(f'a routed server needs two model names other than "{AUTO}", got '
                         f"{router_.names}")
    pairs = (zip(router_.names, (router_.weak, router_.strong), strict=True) if router_
             else [(model_name, llm)])
    metrics = ServerMetrics(model_name or AUTO)
    models = {name: _served(m, name, max_pending, metrics, plan_eagerly, warmup, on_warm)
              for name, m in pairs}
    models |= adapters(models, lora_modules or {}, router_ is None)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for engine in {id(s.engine): s.engine for s in models.values()}.values():
            engine.shutdown()

    app = FastAPI(title="paged-jax", lifespan=lifespan)
    app.state.models, app.state.router, app.state.metrics = models, router_, metrics
    app.add_exception_handler(proto.BadRequest, _bad_request)
    app.include_router(router)
    app.include_router(admin.router)
    return app


def adapters(models: dict[str, Served], lora_modules: dict[str, str],
             one_model: bool) -> dict[str, Served]:
    """Each adapter as a served model on the (one) base model's engine, checked now: a bad
    folder fails at start, not at the first request."""
    if not lora_modules:
        return {}
    base = next(iter(models.values()))
    if not one_model or base.llm.engine_config.lora is None:
        raise ValueError("lora_modules need one model served with enable_lora=True")
    out = {}
    for i, (name, path) in enumerate(lora_modules.items(), start=1):
        if name in models or name == AUTO:
            raise ValueError(f"adapter name {name!r} is taken by a served model")
        lora = LoRARequest(name, i, str(path))
        base.llm.llm_engine.runner.adapters.check(lora)
        out[name] = dataclasses.replace(base, name=name, lora=lora, parent=base.name)
    return out


def _served(llm: LLM, name: str, max_pending: int, metrics: ServerMetrics,
            plan_eagerly: bool, warmup: str, on_warm) -> Served:
    m = metrics.for_model(name)
    m.watch(llm.llm_engine)
    engine = AsyncEngine(llm.llm_engine, max_pending, on_step=m.after_step,
                         on_abort=lambda rid: m.aborted(), plan_eagerly=plan_eagerly,
                         warmup=warmup, on_warm=on_warm and functools.partial(on_warm, name))
    return Served(llm, name, engine, m)


router = APIRouter()


async def _bad_request(_req, exc: proto.BadRequest) -> JSONResponse:
    return JSONResponse(proto.error_body(str(exc), exc.status, exc.param), exc.status)


@router.get("/health")
async def health(request: Request) -> Response:
    engines = [m.engine for m in request.app.state.models.values()]
    if any(e.error is not None for e in engines):
        return JSONResponse({"status": "stopped"}, 503)
    if not all(e.warm for e in engines):  # requests are taken meanwhile: they wait
        done, total = (sum(x) for x in zip(*(e.warm_progress for e in engines), strict=True))
        return JSONResponse({"status": "warming", "programs_built": done,
                             "programs_to_build": total}, 503)
    return Response(status_code=200)


@router.get("/get_load")
async def load(request: Request) -> dict:
    """Requests running or waiting, over the served models: what vllm-router's power_of_two
    policy reads (serve/cluster.py)."""
    return {"load": sum(m.engine.num_pending() for m in request.app.state.models.values())}


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.text(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    served = request.app.state.models
    names = [*served] + ([AUTO] if request.app.state.router else [])
    longest = max(m.llm.engine_config.max_model_len for m in served.values())
    return {"object": "list", "data": [{
        "id": n, "object": "model", "created": int(time.time()), "owned_by": "paged-jax",
        "max_model_len": served[n].llm.engine_config.max_model_len if n in served else longest,
        **_lineage(served.get(n))} for n in names]}


def _lineage(srv: Served | None) -> dict:
    """An adapter's base model and folder (vLLM's `parent` and `root`)."""
    if srv is None or srv.lora is None:
        return {}
    return {"parent": srv.parent, "root": srv.lora.lora_path}


@router.post("/v1/completions")
async def completions(request: Request):
    body, srv = await _body(request)
    prompts, params = proto.completion_request(body)
    if srv is None and isinstance(params, BeamSearchParams):
        raise proto.BadRequest("use_beam_search needs a named model: the router picks a model "
                               "per request from one sampled answer", "model")
    rid = proto.new_id("cmpl")
    streams = await _submit(request.app, srv, prompts, params, rid)
    if body.get("stream"):
        chunks = sse.completion_chunks(rid, streams, params.n, _include_usage(body))
        return StreamingResponse(sse.events(chunks, streams), media_type="text/event-stream")
    outs = await _collect(request, streams)
    return proto.completion_body(rid, outs, params.n, [s.served for s in streams])


@router.post("/v1/chat/completions")
async def chat(request: Request):
    body, srv = await _body(request)
    tok = (srv or next(iter(request.app.state.models.values()))).tok  # auto: the weak one's
    prompt, params = proto.chat_request(body, tok)
    rid = proto.new_id("chatcmpl")
    streams = await _submit(request.app, srv, [prompt], params, rid)
    if body.get("stream"):
        chunks = sse.chat_chunks(rid, streams[0], _include_usage(body))
        return StreamingResponse(sse.events(chunks, streams), media_type="text/event-stream")
    out = (await _collect(request, streams))[0]
    return proto.chat_body(rid, out, streams[0].served)


async def _body(request: Request) -> tuple[dict, Served | None]:
    """The JSON body and the model it asks for (None: "auto"; no model: the first served)."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise proto.BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise proto.BadRequest("the request body must be a JSON object")
    served, name = request.app.state.models, body.get("model")
    if name is not None and not isinstance(name, str):
        raise proto.BadRequest(f"model must be a string, got {show(name)}", "model")
    if name == AUTO and request.app.state.router is not None:
        return body, None
    if name is None or name in served:
        return body, served.get(name) or next(iter(served.values()))
    names = ", ".join(f"`{n}`" for n in [*served] + ([AUTO] if request.app.state.router
                                                      else []))
    raise proto.BadRequest(f"The model `{name}` does not exist; this server serves {names}",
                           "model", status=404)


def _include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


async def _submit(app, srv: Served | None, prompts: list, params, rid: str) -> list:
    """Submits every prompt (to `srv`, or routed when it is None), then waits for each one's
    first output, so that a full queue (503) or a request the engine refuses (400) is
    answered before any response starts."""
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    streams = []
    try:
        if srv is None:
            weak, strong = app.state.models.values()
            counter = app.state.metrics.routed
            return await submit_all(
                app.state.router, weak, strong, prompts, params, ids,
                on_route=lambda r: counter.labels(AUTO, r.model).inc())
        for p, i in zip(prompts, ids, strict=True):
            streams.append(srv.engine.submit(p, params, i, srv.lora))
            streams[-1].served = srv
        for s in streams:
            await s.peek()
    except (QueueFull, Sleeping) as e:
        _close(streams)
        raise proto.BadRequest(str(e), status=503) from None
    except ValueError as e:  # the engine's own check: prompt too long, bad values, ...
        _close(streams)
        raise proto.BadRequest(str(e), param_of(str(e))) from None
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
