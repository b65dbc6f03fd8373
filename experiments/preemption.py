"""Paper Fig. 19: cost of preemption by recomputation vs swapping, by block size.

    python -m experiments.preemption [--sizes 16 64] [--requests 24]
    python -m experiments.preemption --sizes 8 16 32 64 128 256

A ShareGPT-like burst (all at t = 0, length scale 0.25) overfills a deliberately small pool
(640 token positions), so the engine preempts; each mode serves the same requests. Swapping
copies a victim's blocks to host memory and back (one transfer per block table slice);
recomputing drops them and re-runs the prefill. Reported: preemptions, total time, time per
preemption relative to a pool large enough to need none (same block size); each run is the
fastest of two (compiles and machine noise inflate single runs).
Paper: swapping is slow for small blocks (many small transfers), recomputation is flat in
block size; they are comparable at 16-64.
"""

from __future__ import annotations

import argparse

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax import compile_cache
from paged_jax.study.metrics import latency_summary, throughput
from paged_jax.study.workloads import make_workload

POOL_TOKENS, BIG = 640, 2048


def serve_once(parts, items, bs: int, pool_tokens: int, mode: str, progress, repeats: int) -> dict:
    cfg = {**sv.TINY, "block_size": bs, "num_kv_blocks": pool_tokens // bs + 1,
           "preemption_mode": mode}
    # Fastest of `repeats` runs: the first swap-in / recompute of each shape compiles.
    run = min((sv.serve(sv.make_engine(parts, **cfg), items, on_step=progress)
               for _ in range(repeats)), key=lambda r: r.span)
    return dict(block_size=bs, mode=mode, pool_tokens=pool_tokens, span_s=run.span,
                preemptions=sum(s.preempted for s in run.stats),
                normalized_latency=latency_summary(run.timings)["normalized_latency"],
                **throughput(run.timings, run.span))


def main(sizes=(16, 64), requests: int = 24, scale: float = 0.25, seed: int = 0,
         repeats: int = 2, name: str = "preemption", progress=None) -> dict:
    parts, rows = sv.tiny_model(), []
    items = make_workload("sharegpt", requests, float("inf"), parts[2], seed, scale,
                          sv.TINY["max_model_len"])
    for bs in sizes:
        # Each block size compiles its own programs; dropping the last size's keeps the
        # process under the kernel's limit on memory mappings (LLVM's JIT aborts past it).
        compile_cache.clear_programs()
        for pool_tokens in (BIG, POOL_TOKENS):
            sv.warm_up(parts, {**sv.TINY, "block_size": bs, "num_kv_blocks": pool_tokens // bs + 1},
                       items=items)
        ref = serve_once(parts, items, bs, BIG, "recompute", progress, repeats)
        for mode in ("recompute", "swap"):
            r = serve_once(parts, items, bs, POOL_TOKENS, mode, progress, repeats)
            r["overhead_per_preemption_s"] = ((r["span_s"] - ref["span_s"]) / r["preemptions"]
                                              if r["preemptions"] else 0.0)
            r["no_preemption_span_s"] = ref["span_s"]
            rows.append(r)
    payload = dict(config=dict(engine=sv.TINY, pool_tokens=POOL_TOKENS, big=BIG, requests=requests,
                               scale=scale, seed=seed), rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["block_size", "mode", "preemptions", "span_s", "no_preemption_span_s",
                       "overhead_per_preemption_s"]))
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.3))
    for mode in ("recompute", "swap"):
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["block_size"])
        ax.plot([r["block_size"] for r in sel],
                [1e3 * r["overhead_per_preemption_s"] for r in sel], "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("extra time per preemption (ms)")
    ax.set_title("Preemption: recompute vs swap (tiny model)", fontsize=9)
    ax.legend(fontsize=7)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
