"""Replicas of one model behind a balancer, on a virtual clock: what each policy of
`balance.py` does to latency and throughput.

Every replica is a real engine with its own KV pool and its own clock, advanced by each step's
roofline time on the paper's GPU (paged_jax/study/cost_model.py), so replicas run in parallel as
separate GPUs would: the dispatcher steps whichever busy replica is furthest behind, and hands
an arrival to the balancer once every busy replica has caught up with it. Requests wait in a
replica's queue when it is busy; none is dropped (`lost` counts any that never finished).

`shared_prefix_traffic` is the skewed workload cache-aware balancing is for: a few long system
prompts with Zipf popularity, each followed by a user part of its own.
"""

from __future__ import annotations

import numpy as np

from paged_jax.engine import Engine
from paged_jax.engine.balance import Balancer
from paged_jax.study.cost_model import GpuCostModel
from paged_jax.study.metrics import kv_snapshot
from paged_jax.study.workloads import WorkItem

GPU = GpuCostModel()


def shared_prefix_traffic(n: int, rate: float, *, groups: int = 16, prefix_len: int = 256,
                          zipf: float = 1.1, seed: int = 0) -> list[WorkItem]:
    """n requests: a Zipf-popular system prompt + a 16-64 token user part, 16-48 output
    tokens, Poisson arrivals at `rate` per second (byte-level token ids)."""
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(32, 127, prefix_len)) for _ in range(groups)]
    pop = 1.0 / np.arange(1, groups + 1) ** zipf
    g = rng.choice(groups, n, p=pop / pop.sum())
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [WorkItem(f"q{i}", [int(x) for x in prefixes[g[i]]]
                     + [int(x) for x in rng.integers(32, 127, rng.integers(16, 65))],
                     int(rng.integers(16, 49)), float(t[i])) for i in range(n)]


def simulate(engines: list[Engine], items: list[WorkItem], policy: str,
             cost: GpuCostModel = GPU) -> dict:
    """Serves `items` on fresh `engines` under `policy`: latency, throughput, cache hits."""
    bal = Balancer(engines, policy)
    clock = [0.0] * len(engines)
    start, done, first = {}, {}, {}
    pending = sorted(items, key=lambda w: w.arrival)
    i = 0
    while i < len(pending) or any(e.has_unfinished() for e in engines):
        busy = [r for r, e in enumerate(engines) if e.has_unfinished()]
        if busy and (i == len(pending) or min(clock[r] for r in busy) < pending[i].arrival):
            r = min(busy, key=lambda k: clock[k])
            outs = engines[r].step()
            clock[r] += cost.last_step_seconds(engines[r],
                                               kv_snapshot(engines[r])["token_states"])
            for o in outs:
                first.setdefault(o.request_id, clock[r])
                if o.finished:
                    done[o.request_id] = clock[r]
                    bal.done(o.request_id)
            continue
        w = pending[i]
        i += 1
        r = bal.pick(w.request_id, w.prompt_token_ids, w.output_len)
        if not engines[r].has_unfinished():
            clock[r] = max(clock[r], w.arrival)
        engines[r].add_request(w.request_id, {"prompt_token_ids": w.prompt_token_ids},
                               w.params(), arrival_time=w.arrival)
        start[w.request_id] = w.arrival
    return summary(items, policy, engines, start, first, done)


def summary(items, policy, engines, start, first, done) -> dict:
    e2e = np.array([done[k] - start[k] for k in done])
    ttft = np.array([first[k] - start[k] for k in done])
    span = max(done.values()) - min(start.values())
    caches = [e.prefix for e in engines if e.prefix is not None]
    hits = sum(c.hit_tokens for c in caches) / max(1, sum(c.queried_tokens for c in caches))
    return dict(policy=policy, replicas=len(engines), requests=len(items), served=len(done),
                lost=len(items) - len(done), e2e_p50=float(np.median(e2e)),
                e2e_p99=float(np.percentile(e2e, 99)), ttft_p50=float(np.median(ttft)),
                ttft_p99=float(np.percentile(ttft, 99)),
                throughput=float(sum(w.output_len for w in items) / span),
                prefix_hit_rate=float(hits))
