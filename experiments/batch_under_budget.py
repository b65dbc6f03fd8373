"""How many sequences each KV policy runs at once under a fixed KV budget, and throughput.

    python -m experiments.batch_under_budget [--requests 48] [--budgets 129 257]

ShareGPT-like requests (length scale 0.25) all arrive at t = 0; the KV pool holds `budget`
blocks of 16 tokens (block 0 reserved). Every policy runs on the same engine, model and
kernels; only admission differs (paged_jax/study/reservation.py). Each extra budget is a new pool
shape, so it compiles once (cached in .cache/xla afterwards).
Paper (Sec. 6.2): vLLM batches 2.2x-4.3x more requests than Orca (Oracle/Max) on ShareGPT.
"""

from __future__ import annotations

import argparse

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.study.metrics import throughput
from paged_jax.study.workloads import describe, make_workload


def main(requests: int = 48, budgets=(129,), scale: float = 0.25, seed: int = 0,
         policies=sv.POLICIES, name: str = "batch_under_budget", progress=None) -> dict:
    parts = sv.tiny_model()
    rows = []
    for budget in budgets:
        cfg = {**sv.TINY, "num_kv_blocks": budget}
        items = make_workload("sharegpt", requests, float("inf"), parts[2], seed, scale,
                              cfg["max_model_len"])
        sv.warm_up(parts, cfg, items=items)
        for policy in policies:
            run = sv.serve(sv.make_engine(parts, **cfg, reservation=policy), items,
                           on_step=progress)
            rows.append(dict(budget_blocks=budget, budget_tokens=(budget - 1) * 16,
                             policy=policy, mean_running=sv.mean_running(run),
                             peak_running=max(s.running for s in run.stats),
                             **throughput(run.timings, run.span), **sv.roof(run, parts)))
        ref = next(r for r in rows if r["budget_blocks"] == budget and r["policy"] == "paged")
        for r in rows:
            if r["budget_blocks"] == budget:
                r["paged_batch_ratio"] = ref["mean_running"] / max(r["mean_running"], 1e-9)
    payload = dict(config=dict(engine=sv.TINY, requests=requests, scale=scale, seed=seed,
                               workload=describe(items)), rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["budget_blocks", "policy", "mean_running", "peak_running",
                       "paged_batch_ratio", "output_tokens_per_s", "achieved_GBps",
                       "fraction_of_bandwidth"]))
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    budgets = sorted({r["budget_blocks"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.3))
    width = 0.8 / len(budgets)
    for j, bud in enumerate(budgets):
        sel = [next(r for r in rows if r["policy"] == p and r["budget_blocks"] == bud)
               for p in policies]
        xs = [i + j * width for i in range(len(policies))]
        a.bar(xs, [r["mean_running"] for r in sel], width, label=f"{bud - 1} blocks")
        b.bar(xs, [r["output_tokens_per_s"] for r in sel], width, label=f"{bud - 1} blocks")
    for ax, lab in ((a, "mean running requests"), (b, "output tokens/s")):
        ax.set_xticks([i + width * (len(budgets) - 1) / 2 for i in range(len(policies))])
        ax.set_xticklabels(policies, fontsize=7)
        ax.set_ylabel(lab)
        ax.legend(fontsize=7)
    fig.suptitle("Batch size and throughput under a fixed KV budget (tiny model)", fontsize=9)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--budgets", type=int, nargs="+", default=[129])
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
