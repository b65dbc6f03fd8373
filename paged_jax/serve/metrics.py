"""Prometheus metrics of a running engine, under vLLM's metric names.

Gauges are read from the engine when /metrics is scraped (`watch`), so they are true at every
scrape: while idle, and after an abort that no step has followed. Request metrics are recorded
when a request finishes (or is aborted). Each server has its own registry, so tests
can run several in one process. A server of several models (routing: two models and "auto")
has one registry; `for_model` gives each model's view, labelled with its name.
"""

from __future__ import annotations

import copy
import functools
import threading

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from paged_jax.engine import Engine
from paged_jax.outputs import RequestOutput

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TPOT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class _Compiles:
    """Programs XLA built in this process (compiled, or loaded from the persistent cache) and
    the seconds they took: JAX reports each under its backend-compile event. Process-wide,
    like the compilation itself; a listener is registered once, on first use."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.seconds, self._lock = 0, 0.0, threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration: float, **_) -> None:
        if event == self.EVENT:
            with self._lock:
                self.count, self.seconds = self.count + 1, self.seconds + duration


@functools.cache
def compiles() -> _Compiles:
    """The process's one `_Compiles` (its listener registered on the first call)."""
    return _Compiles()


class ServerMetrics:
    """The server's metrics; `text()` is the /metrics body."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = dict(labelnames=["model_name"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", **lab)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                             **lab)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "Share of the KV pool's blocks in use (1 = full)", **lab)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", **lab)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache", **lab)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions of running requests",
                                   **lab)
        self._preempted = 0  # the engine's count at the last step
        # speculative decoding (vLLM's names): verify rows with drafts, tokens drafted, kept
        self.spec = {name: Counter(f"vllm:spec_decode_{name}", text, **lab) for name, text in (
            ("num_drafts", "Verify steps of a sequence with draft tokens"),
            ("num_draft_tokens", "Draft tokens proposed"),
            ("num_accepted_tokens", "Draft tokens accepted"))}
        self._spec_seen: dict[str, dict[str, int]] = {}  # model -> totals at the last step
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests",
                                     **lab)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", **lab)
        self.success = Counter("vllm:request_success", "Requests finished, by reason",
                               labelnames=["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, **lab)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first", buckets=_TPOT, **lab)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             buckets=_LATENCY, **lab)
        # TTFT split as vLLM splits it: waiting for a first step, then prefill to first token
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Arrival to first scheduled step", buckets=_LATENCY, **lab)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "First scheduled step to first token", buckets=_LATENCY,
                                      **lab)
        self.routed = Counter("paged_jax:routed_requests",
                              'Requests of the "auto" model, by the model that served them',
                              labelnames=["model_name", "routed_to"], registry=r)
        # a server compiles while it serves when a step meets a shape warm-up did not
        c = compiles()
        Gauge("paged_jax:xla_programs_built", "XLA programs compiled or loaded from the "
              "persistent cache by this process", registry=r).set_function(lambda: c.count)
        Gauge("paged_jax:xla_build_seconds", "Seconds this process spent building XLA programs",
              registry=r).set_function(lambda: c.seconds)
        self.model = model_name

    def for_model(self, model_name: str) -> ServerMetrics:
        """The same registry, recording under another model's name."""
        view = copy.copy(self)
        view.model = model_name
        return view

    def watch(self, engine: Engine) -> None:
        """The gauges read `engine` at each scrape (lengths and counts only: safe to read
        while the engine thread steps)."""
        m, sched = self.model, engine.scheduler
        self.running.labels(m).set_function(lambda: len(sched.running))
        self.waiting.labels(m).set_function(lambda: len(sched.waiting))
        self.kv_usage.labels(m).set_function(engine.kv.usage)

    def after_step(self, engine: Engine, outs: list[RequestOutput]) -> None:
        """Request metrics of the requests that finished in a step, and its preemptions."""
        n = engine.scheduler.num_preempted
        self.preemptions.labels(self.model).inc(n - self._preempted)
        self._preempted = n
        seen = self._spec_seen.setdefault(self.model, dict.fromkeys(self.spec, 0))
        for name, counter in self.spec.items():
            total = getattr(engine.scheduler.spec, name)
            counter.labels(self.model).inc(total - seen[name])
            seen[name] = total
        for out in outs:
            if out.finished:
                self.finished(out)

    def finished(self, out: RequestOutput) -> None:
        m, t = self.model, out.metrics
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.prefix_queries.labels(m).inc(len(out.prompt_token_ids))
        self.prefix_hits.labels(m).inc(out.num_cached_tokens or 0)
        n = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.labels(m).inc(n)
        reason = out.outputs[0].finish_reason or "abort"
        self.success.labels(m, reason).inc()
        if t is None or t.first_token_time is None:
            return
        self.ttft.labels(m).observe(t.first_token_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(t.first_scheduled_time - t.arrival_time)
            self.prefill_time.labels(m).observe(t.first_token_time - t.first_scheduled_time)
        end = t.finished_time or t.last_token_time or t.first_token_time
        self.e2e.labels(m).observe(end - t.arrival_time)
        longest = max(len(c.token_ids) for c in out.outputs)
        if longest > 1:
            self.tpot.labels(m).observe((end - t.first_token_time) / (longest - 1))

    def aborted(self, n: int = 1) -> None:
        self.success.labels(self.model, "abort").inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)
