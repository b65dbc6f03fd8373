"""Paper Fig. 18b: latency and throughput vs KV block size, at a fixed KV memory.

    python -m experiments.block_size [--sizes 8 16 32] [--requests 32]
    python -m experiments.block_size --sizes 1 2 4 8 16 32 64 128 256      (the paper's sweep)

The pool always holds 2048 token positions (2048 / block_size blocks); a ShareGPT-like and an
Alpaca-like workload arrive all at once on the tiny model. Small blocks waste less memory
but make the kernel gather more, smaller pieces; large blocks waste positions (internal
fragmentation) and so fit fewer sequences. Each block size is a new shape (one compile).
Paper: 16-128 best on ShareGPT, 16-32 on Alpaca; vLLM's default is 16.
"""

from __future__ import annotations

import argparse

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax import compile_cache
from paged_jax.study.metrics import breakdown, latency_summary, throughput
from paged_jax.study.workloads import make_workload

POOL_TOKENS = 2048
SCALE = {"sharegpt": 0.25, "alpaca": 1.0}


def main(sizes=(8, 16, 32), requests: int = 32, seed: int = 0,
         datasets=("sharegpt", "alpaca"), repeats: int = 2, name: str = "block_size",
         progress=None) -> dict:
    parts, rows = sv.tiny_model(), []
    for bs in sizes:
        # Each block size compiles its own programs; dropping the last size's keeps the
        # process under the kernel's limit on memory mappings (LLVM's JIT aborts past it).
        compile_cache.clear_programs()
        cfg = {**sv.TINY, "block_size": bs, "num_kv_blocks": POOL_TOKENS // bs + 1}
        sv.warm_up(parts, cfg)
        for d in datasets:
            items = make_workload(d, requests, float("inf"), parts[2], seed, SCALE[d],
                                  cfg["max_model_len"])
            sv.warm_up(parts, cfg, n=1, items=items)
            # Fastest of `repeats`: machine noise on a shared 2-core box inflates single runs.
            run = min((sv.serve(sv.make_engine(parts, **cfg), items, on_step=progress)
                       for _ in range(repeats)), key=lambda r: r.span)
            lat = latency_summary(run.timings)
            rows.append(dict(block_size=bs, dataset=d, mean_running=sv.mean_running(run),
                             normalized_latency=lat["normalized_latency"],
                             token_states=breakdown(run.snapshots,
                                                    sv.step_weights(run))["token_states"],
                             **throughput(run.timings, run.span), **sv.roof(run, parts)))
    payload = dict(config=dict(engine=sv.TINY, pool_tokens=POOL_TOKENS, requests=requests,
                               seed=seed, scale=SCALE), rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["block_size", "dataset", "mean_running", "token_states",
                       "normalized_latency", "output_tokens_per_s", "achieved_GBps"]))
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.3))
    for d in dict.fromkeys(r["dataset"] for r in rows):
        sel = sorted((r for r in rows if r["dataset"] == d), key=lambda r: r["block_size"])
        xs = [r["block_size"] for r in sel]
        a.plot(xs, [r["normalized_latency"] for r in sel], "o-", label=f"{d}-like")
        b.plot(xs, [r["output_tokens_per_s"] for r in sel], "o-", label=f"{d}-like")
    for ax, lab in ((a, "normalized latency (s/token)"), (b, "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(lab)
        ax.legend(fontsize=7)
    fig.suptitle(f"Block size at a fixed {POOL_TOKENS}-token KV pool (tiny model)", fontsize=9)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
