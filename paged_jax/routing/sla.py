"""Latency bounds for routing: would a model answer in time, given what it already has queued?

A router in latency-SLA mode moves a request to the strong model only if that model is
expected to meet the bounds; otherwise the request stays on the weak model, which has already
produced its first token. Estimates come from the engine's own recent steps (`Engine.stats`):

    TTFT ~ (prompt tokens queued or in prefill + this prompt) / recent prefill tokens per second
    TPOT ~ recent seconds per decode iteration (decode windows: duration / steps; else
           the mean of recent steps that only decode)

An engine with no history yet is assumed to meet any bound (nothing measured to say otherwise).
"""

from __future__ import annotations

import dataclasses

from paged_jax.engine import Engine

RECENT = 32  # steps of history the estimates use


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Expected time to first token and per output token, in seconds (None: no history)."""

    ttft: float | None
    tpot: float | None

    def meets(self, ttft_slo: float | None, tpot_slo: float | None) -> bool:
        """Whether both bounds hold (an unknown estimate or an unset bound holds)."""
        return all(bound is None or est is None or est <= bound
                   for est, bound in ((self.ttft, ttft_slo), (self.tpot, tpot_slo)))


def queued_tokens(engine: Engine) -> int:
    """Prompt tokens the engine still has to compute: waiting requests and running prefills."""
    reqs = engine.scheduler.waiting + engine.scheduler.running
    return sum(s.num_pending for r in reqs for s in r.seqs[:1])


def estimate(engine: Engine, prompt_tokens: int) -> Estimate:
    """TTFT and TPOT a new request of `prompt_tokens` would see on this engine now."""
    recent = [s for s in list(engine.stats)[-RECENT:] if s.duration > 0]
    steps = [s for s in recent if s.kind == "step" and s.num_tokens]
    windows = [s for s in recent if s.kind == "window" and s.num_steps]
    ttft = tpot = None
    if steps:
        rate = sum(s.num_tokens for s in steps) / sum(s.duration for s in steps)
        ttft = (queued_tokens(engine) + prompt_tokens) / rate
    decodes = [s for s in steps if s.num_tokens <= s.running]  # a token per running sequence
    if windows:
        tpot = sum(s.duration for s in windows) / sum(s.num_steps for s in windows)
    elif decodes:  # async scheduling (or decode_window=1): steps, no windows
        tpot = sum(s.duration for s in decodes) / len(decodes)
    return Estimate(ttft, tpot)
