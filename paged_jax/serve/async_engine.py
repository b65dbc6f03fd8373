"""The engine on its own thread, for servers: requests arrive, stream and abort at any time.

    caller (asyncio)                         engine thread (owns the Engine)
    submit(...)    --- inbox: add ---------->  add_request; a bad request's error goes back
                                              loop: step() -> each touched request's output
    async for out  <- its stream (per step) -  (call_soon_threadsafe into the caller's loop)
    stream.close() --- inbox: abort -------->  abort: blocks freed before the next step

Only the engine thread touches the Engine (it is not thread safe). Outputs are delivered once
per engine step: with async scheduling (the server's default) every step is read and delivered
on its own, so a token reaches its stream one step after it was sampled; without it, a decode
window of W steps is one call and its W tokens arrive together. The number of requests queued
or running is bounded (`max_pending`): past it `submit` raises `QueueFull` at once (servers
answer 503) instead of letting the queue grow without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable

import jax

from paged_jax.engine import Engine
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams


class QueueFull(RuntimeError):
    """The engine holds `max_pending` requests already."""


_DONE = object()  # end of a stream


class RequestStream:
    """One request's outputs, in order, as an async iterator (the last one finished).
    `close()` before the end aborts the request; servers call it when the client leaves."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._peeked: RequestOutput | None = None
        self.served = None  # set by the server: the model serving this request
        self.route = None  # "auto": the router's decision made before submitting (routed.py)

    async def peek(self) -> RequestOutput | None:
        """Waits for the first output (raising the engine's error if it refused the
        request) without consuming it; None if the stream ended without one."""
        if self._peeked is None and not self.finished:
            try:
                self._peeked = await self.__anext__()
            except StopAsyncIteration:
                return None
        return self._peeked

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._peeked is not None:
            out, self._peeked = self._peeked, None
            return out
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _DONE:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Aborts the request unless it has finished (its blocks are freed before the
        engine's next step)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    """Runs `engine` on a daemon thread until `shutdown()`.

    Args:
      engine: the engine to drive (nothing else may use it while this runs).
      max_pending: most requests waiting or running at once.
      on_step: called on the engine thread after every step with (engine, outputs), for
        metrics.
      plan_eagerly: with async scheduling, plan each step as soon as the previous one is
        sent, as offline. False (default): while a step runs with room for another request,
        wait for it to end before planning the next, so requests arriving meanwhile join
        the very next step (`Engine.step_to_wait_for`); the host's work on the finished
        step's outputs still overlaps the next step.
    """

    def __init__(self, engine: Engine, max_pending: int = 256,
                 on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
                 on_abort: Callable[[str], None] | None = None, plan_eagerly: bool = False,
                 warmup: str = "none",
                 on_warm: Callable[[str, int, int], None] | None = None):
        self.engine, self.max_pending, self.plan_eagerly = engine, max_pending, plan_eagerly
        self.on_step, self.on_abort = on_step, on_abort
        # warm-up (engine/warmup.py) runs on the engine thread before its first step;
        # requests submitted meanwhile wait in the inbox
        self.warmup, self.on_warm = warmup, on_warm
        self.warm_progress = (0, 0)  # programs built, programs to build
        self.warm_report = None if warmup != "none" else "none"  # set when warm
        if warmup != "none":
            engine.check_warm_up(warmup)  # a refusal stops the server's start, not its thread
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams (caller threads vs the engine thread)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the loop, if it crashed
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self._watched: queue.Queue = queue.Queue()  # (tick, device outputs) to wait for
        self._ticks = itertools.count()
        self._watcher = threading.Thread(target=self._watch, name="paged-jax-watch", daemon=True)
        self._watcher.start()
        self._thread.start()

    # ---- caller side -----------------------------------------------------------------------
    def num_pending(self) -> int:
        with self._lock:
            return len(self._streams)

    def submit(self, prompt: str | list[int] | dict, params: SamplingParams | BeamSearchParams,
               request_id: str | None = None, lora=None) -> RequestStream:
        """Queues a request (a beam search for BeamSearchParams) for the engine thread (call
        from an event loop's thread), under LoRA adapter `lora` if given; its outputs arrive
        on the returned stream. The engine's refusal (prompt too long, ...) arrives there
        too, as the stream's first item.

        Raises:
          QueueFull: `max_pending` requests are in the engine already.
          RuntimeError: the engine thread has stopped.
        """
        if self._stop.is_set() or self.error is not None:
            raise RuntimeError(f"the engine is not running ({self.error!r})")
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid)
        with self._lock:
            if len(self._streams) >= self.max_pending:
                raise QueueFull(f"the server is full ({self.max_pending} requests queued or "
                                "running); retry later")
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[rid] = stream
        # arrival is now, not when the engine thread next looks (after a step)
        self._inbox.put(("add", rid, prompt, params, time.time(), lora))
        return stream

    def abort(self, request_id: str) -> None:
        """Aborts a request (a no-op once it has finished)."""
        self._inbox.put(("abort", request_id))

    def narrow_outputs(self, request_id: str, logprobs: int | None,
                       return_hidden_states: bool) -> None:
        """Engine.narrow_outputs, applied on the engine thread."""
        self._inbox.put(("narrow", request_id, logprobs, return_hidden_states))

    def call(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps (sleep, wake_up: nothing
        else may touch the engine); its result or exception arrives on the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the loop after its current step; open streams end with an error.

        Joins both threads: a daemon thread still inside a jax call when the interpreter
        exits is killed mid-C++ and aborts the process ("FATAL: exception not rethrown")."""
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        self._watched.put(None)
        self._watcher.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------
    @property
    def warm(self) -> bool:
        """Whether warm-up has finished (or was not asked for)."""
        return self.warm_report is not None

    def _warm_up(self) -> None:
        def progress(phase: str, done: int, total: int) -> None:
            self.warm_progress = (done, total)
            if self.on_warm is not None:
                self.on_warm(phase, done, total)

        self.warm_report = self.engine.warm_up(self.warmup, progress)

    def _run(self) -> None:
        try:
            if not self.warm:
                self._warm_up()
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    outs = self.engine.step()
                    for out in outs:
                        self._deliver(out.request_id, out)
                    if self.on_step is not None:
                        self.on_step(self.engine, outs)
                    self._wait_for_step()
        except BaseException as e:  # noqa: BLE001 - reported to every open stream
            self.error = e
        finally:
            self._close_all(RuntimeError(f"the engine stopped ({self.error!r})"))

    def _wait_for_step(self) -> None:
        """Blocks until the step in flight ends, applying commands as they arrive, when the
        engine says an arrival could join the next step (`plan_eagerly` in the class).

        Not woken by an arrival: planned at the first one, a step would take that request
        alone, and a burst would become one small prefill step per request (tried: a burst of
        32 requests then lost about a quarter of its throughput to the eager order)."""
        out = None if self.plan_eagerly else self.engine.step_to_wait_for()
        if out is None:
            return
        tick = next(self._ticks)
        self._watched.put((tick, out))
        while not self._stop.is_set() and (cmd := self._inbox.get()) != ("ready", tick):
            self._apply(cmd)  # an add or abort (a stale tick, after a stop, is a no-op)

    def _watch(self) -> None:
        """Watcher thread: puts ("ready", tick) in the inbox when the watched outputs are."""
        while (item := self._watched.get()) is not None:
            tick, out = item
            try:
                jax.block_until_ready(out)
            except Exception:  # noqa: BLE001, S110 - read and freed already: it has ended
                pass
            self._inbox.put(("ready", tick))

    def _drain(self, block: bool) -> None:
        """Applies every queued command; waits for one first when the engine is idle."""
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, arrival, lora = cmd
            add = (self.engine.add_beam_request if isinstance(params, BeamSearchParams)
                   else self.engine.add_request)  # a beam search: scheduled like the rest
            try:
                add(rid, prompt, params, arrival_time=arrival, lora_request=lora)
            except Exception as e:  # noqa: BLE001 - the caller gets the engine's own error
                self._deliver(rid, e)
        elif cmd[0] == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller's to report
                fut.set_exception(e)
        elif cmd[0] == "narrow":
            self.engine.narrow_outputs(*cmd[1:])
        elif cmd[0] == "abort":
            rid = cmd[1]
            if rid in self.engine.requests:
                self.engine.abort(rid)
                if self.on_abort is not None:
                    self.on_abort(rid)
            self._deliver(rid, _DONE)

    def _deliver(self, rid: str, item) -> None:
        last = item is _DONE or isinstance(item, BaseException) or item.finished
        with self._lock:
            stream = self._streams.pop(rid, None) if last else self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _close_all(self, err: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, err)
