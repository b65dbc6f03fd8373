"""Replicas behind vllm-router: `python -m experiments.scale_out [--model PATH] [--requests 48]`.

The shared-prefix workload (paged_jax/routing/replicas.py's `shared_prefix_traffic`: 16
Zipf-popular 256-character system prompts, each request's own 16-64 characters after it,
16-48 output tokens, Poisson arrivals), sent as text through `paged-jax cluster`
(serve/cluster.py's parts: two replicas started once, warm, pinned to cores 0 and 1; a
vllm-router started for each run, in front of one or both) to

    1 replica   (core 0), round_robin
    2 replicas  (cores 0 and 1), round_robin
    2 replicas  (cores 0 and 1), cache_aware

in `--rounds` paired rounds (the sides alternate their order from round to round; each round
its own prompts, so no round hits what another cached). Per side and round:
output tok/s, TTFT p50 / p99, prefix-cache hit rate over the replicas (their
vllm:prefix_cache_hits / queries), requests lost. Targets (issue 57, the one rule of
experiments/common.py on the per-round ratios): cache-aware's hit rate >= 1.5x
round-robin's, its throughput not below round-robin's (>= 0.95x), and 2 replicas on 2 cores
>= 1.6x one replica on one core (round-robin both). The router process and this client
share the same two cores. Writes results/scale_out.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace

from experiments import bench_serving as bs
from experiments.common import MIN_ROUNDS, not_slower, save_json, table, target_verdict
from paged_jax.routing.replicas import shared_prefix_traffic
from paged_jax.serve.cli import default_name
from paged_jax.serve.cluster import free_port, start_replicas, start_router, wait_ready

SIDES = (("1 replica", 1, "round_robin"), ("2 replicas round_robin", 2, "round_robin"),
         ("2 replicas cache_aware", 2, "cache_aware"))
COLUMNS = ["side", "round", "done", "lost", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
           "prefix_hit_rate"]


def workload(n: int, rate: float, seed: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(prompt="".join(map(chr, w.prompt_token_ids)), prompt_token_ids=[],
                            output_len=w.output_len, arrival=w.arrival)
            for w in shared_prefix_traffic(n, rate, seed=seed)]


def prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the prefix caches, summed over the replicas."""
    import httpx

    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def run_side(name: str, urls: list[str], policy: str, items, a, r: int) -> dict:
    """One side of one round: a router in front of `urls` for this run alone."""
    import signal

    port = free_port()
    router = start_router(urls, policy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(router, url, "/readiness", 60)
        h0, q0 = prefix_counts(urls)
        t0 = time.perf_counter()
        res = asyncio.run(bs.run_rate(url, default_name(a.model), items, a.timeout))
        wall = time.perf_counter() - t0
        h1, q1 = prefix_counts(urls)
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(30)
    row = dict(side=name, round=r, replicas=len(urls), policy=policy,
               **bs.summarize(a.rate, res, wall))
    row["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    return row


def replicas(a) -> list:
    """Two warm replicas, pinned to cores 0 and 1 (one serves the 1-replica side alone)."""
    procs = start_replicas(a.model, 2, ["--warmup", "auto"], pin=True)
    for proc, url in procs:
        wait_ready(proc, url, "/health", 1800)
    return procs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=float("inf"))
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    procs, rows = replicas(a), []
    urls = [u for _, u in procs]
    try:
        for r in range(a.rounds):  # each round its own prompts: no hits from rounds before
            items = workload(a.requests, a.rate, a.seed + r)
            for name, n_rep, policy in (SIDES if r % 2 == 0 else SIDES[::-1]):
                rows.append(run_side(name, urls[:n_rep], policy, items, a, r))
                print(table(rows[-1:], COLUMNS), flush=True)
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(60)
    side = {name: [x for x in rows if x["side"] == name] for name, _, _ in SIDES}
    tok = {k: [x["output_tok_s"] for x in v] for k, v in side.items()}
    hit = {k: [x["prefix_hit_rate"] for x in v] for k, v in side.items()}
    rr, ca = "2 replicas round_robin", "2 replicas cache_aware"
    out = dict(requests=a.requests, rate=a.rate, rounds=a.rounds, rows=rows, targets=dict(
        hit_rate_cache_aware_over_round_robin=target_verdict(
            [c / max(b, 1e-9) for c, b in zip(hit[ca], hit[rr], strict=True)], 1.5),
        throughput_cache_aware_vs_round_robin=not_slower(tok[ca], tok[rr]),
        two_replicas_over_one=target_verdict(
            [b / o for b, o in zip(tok[rr], tok["1 replica"], strict=True)], 1.6),
        requests_lost=dict(value=sum(x["lost"] + x["failed"] for x in rows), target=0)))
    out["json"] = str(save_json("scale_out", out))
    return out


if __name__ == "__main__":
    main()
