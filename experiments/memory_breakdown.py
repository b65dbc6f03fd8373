"""Paper Fig. 2: what the reserved KV memory holds, paged vs Orca-style reservations.

    python -m experiments.memory_breakdown [--requests 48] [--scale 0.25]

A ShareGPT-like workload (all requests at t = 0, so memory is the bottleneck) is served on
the tiny random model by each reservation policy in the same engine. At every step the KV
token positions in use are split into token states / reserved for future tokens / internal /
external fragmentation (definitions in paged_jax/study/metrics.py), time-averaged over the run.
Paper (13B model, A100, ShareGPT): vLLM 96.3% token states; Orca 20.4% (Max), 26.8% (Pow2),
38.2% (Oracle).
"""

from __future__ import annotations

import argparse

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.study.metrics import CATEGORIES, breakdown, latency_summary, throughput
from paged_jax.study.workloads import describe, make_workload

PAPER = {"paged": 0.963, "orca-oracle": 0.382, "orca-pow2": 0.268, "orca-max": 0.204}
POLICIES = ("paged", "orca-oracle", "orca-pow2", "orca-max")


def main(requests: int = 48, scale: float = 0.25, seed: int = 0, name: str = "memory_breakdown",
         progress=None) -> dict:
    parts, cfg = sv.tiny_model(), sv.TINY
    items = make_workload("sharegpt", requests, float("inf"), parts[2], seed, scale,
                          cfg["max_model_len"])
    sv.warm_up(parts, cfg, items=items)
    rows = []
    for policy in POLICIES:
        run = sv.serve(sv.make_engine(parts, **cfg, reservation=policy), items, on_step=progress)
        shares = breakdown(run.snapshots, sv.step_weights(run))
        rows.append(dict(policy=policy, **shares, paper_token_states=PAPER[policy],
                         mean_running=sv.mean_running(run),
                         **throughput(run.timings, run.span), **sv.roof(run, parts),
                         normalized_latency=latency_summary(run.timings)["normalized_latency"]))
    payload = dict(config=dict(engine=cfg, requests=requests, scale=scale, seed=seed,
                               workload=describe(items)), rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["policy", *CATEGORIES, "paper_token_states", "mean_running",
                       "output_tokens_per_s", "achieved_GBps"]))
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    left = [0.0] * len(rows)
    colors = ("tab:green", "tab:orange", "tab:red", "tab:gray")
    for c, color in zip(CATEGORIES, colors, strict=True):
        vals = [100 * r[c] for r in rows]
        ax.barh([r["policy"] for r in rows], vals, left=left, color=color, label=c)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for y, r in enumerate(rows):
        ours, paper = 100 * r["token_states"], 100 * r["paper_token_states"]
        ax.text(1, y, f"{ours:.1f}% (paper {paper:.1f}%)", va="center", fontsize=8,
                color="white")
    ax.set_xlabel("KV cache memory in use (%)")
    ax.set_title("KV memory breakdown, ShareGPT-like (tiny model)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
