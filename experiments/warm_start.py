"""Ready means warm: `python -m experiments.warm_start [--model PATH] [--rounds 5]`.

Three servers (`python -m paged_jax.serve`, the default engine flags, started in turn):

    no warm-up, cold cache   --warmup none, an empty XLA compile cache folder
    warm-up, cold cache      --warmup auto, an empty folder (the one this run fills)
    warm-up, warm cache      --warmup auto, the folder the run before filled

For each: start-up seconds (process start to /health 200), then `--rounds` rounds of an idle
TTFT (one request on an idle server) and an arrival TTFT (8 requests decode, and once each
has its first token one more arrives), the two prompts of a round as long as each other
and each round's of another length (20, 57, 94, ... tokens: the arrival's prefill joins the
decodes in a mixed step of another token bucket), and the XLA programs the server built
after it said ready (paged_jax:xla_programs_built).

Targets (issue 57), on the warm-up, cold-cache server: 0 programs built after ready, and
arrival TTFT <= 2x idle TTFT in every round (experiments/common.py's rule on the per-round
ratios). Writes results/warm_start.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from experiments import bench_serving as bs
from experiments.common import save_json, table, target_verdict
from paged_jax.serve.cli import default_name

# (side, --warmup, compile cache folder: "none" an empty one of its own, "run" the one the
# warm-up sides share: empty for the first, filled by it for the second)
SIDES = (("no warm-up, cold cache", "none", "none"), ("warm-up, cold cache", "auto", "run"),
         ("warm-up, warm cache", "auto", "run"))
DECODERS, DECODE_TOKENS, ARRIVAL_TOKENS = 8, 48, 8


def item(prompt: list[int], tokens: int, arrival: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=prompt, output_len=tokens, arrival=arrival)


async def idle_ttft(url: str, model: str, prompt: list[int]) -> float:
    import httpx

    async with httpx.AsyncClient() as client:
        r = await bs.one(client, url, model, item(prompt, ARRIVAL_TOKENS), time.perf_counter(),
                         300)
    return 1e3 * (r["times"][0] - r["sent"])


def first_tokens(text: str) -> float:
    """Requests that have had their first token, from the server's /metrics."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:time_to_first_token_seconds_count"))


async def arrival_ttft(url: str, model: str, prompts: list[list[int]],
                       arrival: list[int]) -> float:
    """TTFT of `arrival`, sent once every decoder has streamed its first token."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        base = first_tokens((await client.get(url + "/metrics", timeout=10)).text)
        t0 = time.perf_counter()
        decoders = [asyncio.create_task(bs.one(client, url, model, item(p, DECODE_TOKENS), t0,
                                               300)) for p in prompts]
        while first_tokens((await client.get(url + "/metrics", timeout=10)).text) < \
                base + len(prompts):
            await asyncio.sleep(0.02)
        r = await bs.one(client, url, model, item(arrival, ARRIVAL_TOKENS), time.perf_counter(),
                         300)
        await asyncio.gather(*decoders)
    return 1e3 * (r["times"][0] - r["sent"])


def ids(rng, n: int) -> list[int]:
    return [int(x) for x in rng.integers(100, 10_000, n)]


def serve(model: str | None, warmup: str, cache: str) -> tuple[object, str, float]:
    t0 = time.perf_counter()
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # the started server's, not ours
    try:
        proc, url = bs.start_server(model, ["--warmup", warmup])  # serve's defaults
    finally:
        del os.environ["JAX_COMPILATION_CACHE_DIR"]
    return proc, url, time.perf_counter() - t0


def run_side(name: str, warmup: str, cache: str, a, rng) -> dict:
    proc, url, start_s = serve(a.model, warmup, cache)
    model = default_name(a.model)
    try:
        ready = bs.scrape(url).get(bs.BUILDS[0], 0.0)
        idle, busy = [], []
        for r in range(a.rounds):
            prompts = [ids(rng, 24 + 8 * i) for i in range(DECODERS)]
            n = 20 + 37 * r  # the idle request's prompt is as long (other tokens: no hits)
            idle.append(asyncio.run(idle_ttft(url, model, ids(rng, n))))
            busy.append(asyncio.run(arrival_ttft(url, model, prompts, ids(rng, n))))
        built = bs.scrape(url).get(bs.BUILDS[0], 0.0) - ready
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    ratios = [b / i for b, i in zip(busy, idle, strict=True)]
    return dict(side=name, warmup=warmup, start_s=start_s, programs_at_ready=ready,
                programs_built_after_ready=built, idle_ttft_ms=idle, arrival_ttft_ms=busy,
                ratio_per_round=ratios, ttft_ratio=target_verdict(ratios, 2.0, False))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as own, tempfile.TemporaryDirectory() as shared:
        for name, warmup, folder in SIDES:
            rows.append(run_side(name, warmup, own if folder == "none" else shared, a, rng))
            print(table([dict(rows[-1], ratio=rows[-1]["ttft_ratio"]["median"],
                              verdict=rows[-1]["ttft_ratio"]["verdict"])],
                        ["side", "start_s", "programs_at_ready", "programs_built_after_ready",
                         "ratio", "verdict"]), flush=True)
    target = rows[1]
    out = dict(rounds=a.rounds, decoders=DECODERS, rows=rows, targets=dict(
        ttft_ratio=target["ttft_ratio"],
        no_programs_after_ready=dict(value=target["programs_built_after_ready"], target=0,
                                     verdict="met" if target["programs_built_after_ready"] == 0
                                     else "not met")))
    out["json"] = str(save_json("warm_start", out))
    return out


if __name__ == "__main__":
    main()
