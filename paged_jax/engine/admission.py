"""Admission order for the waiting queue, and how often each request was passed over.

    fcfs          first come first served (preempted requests first: they hold slots)
    cache-aware   longest cached prefix first (SGLang's LPM), no request passed over more
                  than `max_skips` times

and whether a request's LoRA adapter can get a device slot beside the running ones'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from paged_jax.engine.sequence import Request

if TYPE_CHECKING:
    from paged_jax.engine.kv_manager import KVManager


def queue(waiting: list[Request], kv: KVManager, mode: str, skips: dict[str, int],
          max_skips: int) -> list[Request]:
    """Waiting requests in admission order (`mode`: "fcfs" or "cache-aware")."""
    if mode != "cache-aware" or kv.prefix is None:
        return list(waiting)

    def cached_len(req: Request) -> int:
        if not kv.fresh(req) or req.params.prompt_logprobs is not None:
            return 0
        return kv.prefix.lookup(req.seqs[0]).num_tokens

    return cache_aware_order(waiting, cached_len, skips, max_skips)


def cache_aware_order(
    waiting: list[Request], cached_len: Callable[[Request], int], skips: dict[str, int],
    max_skips: int,
) -> list[Request]:
    """Admission order: longest cached prefix first (SGLang's LPM), bounded unfairness.

    Preempted requests keep the front (they hold slots and were admitted before); then any
    request passed over `max_skips` times, first come first served; then the rest by cached
    prefix length, longest first, ties first come first served.
    """
    def key(ir: tuple[int, Request]) -> tuple:
        i, r = ir
        starved = skips.get(r.request_id, 0) >= max_skips
        return (r.order < 0, not starved, 0 if starved else -cached_len(r), i)

    return [r for _, r in sorted(enumerate(waiting), key=key)]


def count_skips(waiting: list[Request], admitted: list[Request], skips: dict[str, int]) -> None:
    """Every waiting request that arrived before an admitted one was passed over once more."""
    if not admitted:
        return
    rank = {r.request_id: i for i, r in enumerate(waiting)}
    last = max(rank.get(r.request_id, -1) for r in admitted)
    taken = {r.request_id for r in admitted}
    for r in waiting:
        if rank[r.request_id] < last and r.request_id not in taken:
            skips[r.request_id] = skips.get(r.request_id, 0) + 1


def adapter_fits(req: Request, running: list[Request], max_loras: int) -> bool:
    """Whether `req` may join the `running` requests: it runs no LoRA adapter, or one of
    theirs, or a device slot is left for its own (paged_jax/lora/manager.py)."""
    if req.lora is None:
        return True
    used = {r.lora.lora_int_id for r in running if r.lora is not None}
    return req.lora.lora_int_id in used or len(used) < max_loras
