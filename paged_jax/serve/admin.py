"""Sleep mode over HTTP (vLLM's endpoints): POST /sleep?level=1|2, POST /wake_up, GET
/is_sleeping. Each runs on the engine threads between steps (AsyncEngine.call) for every
served model; adapters share their base model's engine, which sleeps once.

A sleeping server stays up: /health answers, and a completion is refused with 503 naming the
sleep until /wake_up. Sleeping while requests run is refused with 409: it would discard the
KV cache they run on (engine/sleep.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from paged_jax.serve import protocol as proto

router = APIRouter()


def _engines(request: Request) -> list:
    """(LLM, AsyncEngine) of every served engine, each once."""
    return list({id(s.engine): (s.llm, s.engine)
                 for s in request.app.state.models.values()}.values())


async def _on_each(request: Request, fn) -> list:
    futures = [engine.call(lambda _e, llm=llm: fn(llm)) for llm, engine in _engines(request)]
    try:
        return [await asyncio.wrap_future(f) for f in futures]
    except RuntimeError as e:  # an engine with requests running: nothing discarded
        raise proto.BadRequest(str(e), status=409) from None


@router.post("/sleep")
async def sleep(request: Request, level: int = 1) -> JSONResponse:
    if level not in (1, 2):
        raise proto.BadRequest(f"sleep level must be 1 or 2, got {level}", "level")
    freed = await _on_each(request, lambda llm: llm.sleep(level))
    return JSONResponse({"level": level, "freed_bytes": sum(freed)})


@router.post("/wake_up")
async def wake_up(request: Request) -> JSONResponse:
    await _on_each(request, lambda llm: llm.wake_up())
    return JSONResponse({"is_sleeping": False})


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": any(llm.is_sleeping() for llm, _ in _engines(request))}
