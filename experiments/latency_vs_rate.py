"""Paper Fig. 12: normalized latency vs request rate, per KV reservation policy.

    python -m experiments.latency_vs_rate [--requests 48] [--scale 1] [--real-requests 4]

For each dataset (ShareGPT-like at length scale 0.25, Alpaca-like at 1.0, times --scale) the
tiny random model first serves the workload all at once under paging to find its capacity
C (requests/s); then every policy serves Poisson arrivals at fractions of C, on the virtual
clock of experiments/serving.py (C is paging's; the baselines saturate at lower fractions).
Queues only build up over many requests, so small --requests flatten the curves. A
policy's highest sustainable rate is the highest tested rate whose mean normalized latency
stays within LIMIT x paged's at the lowest rate (the knee of the paper's curves). One small
panel repeats this on the real SmolLM2-135M (paged vs orca-max), skipped with
--real-requests 0.
Paper: vLLM sustains 1.7-2.7x Orca (Oracle) and 2.7-8x Orca (Max) rates on ShareGPT.
"""

from __future__ import annotations

import argparse
import dataclasses

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.metrics import latency_summary, throughput
from paged_jax.workloads import describe, make_workload

LIMIT = 2.0
BASE_SCALE = {"sharegpt": 0.25, "alpaca": 1.0}
FRACTIONS = (0.25, 0.5, 1.0, 2.0)


def capacity(parts, cfg: dict, items) -> float:
    """Requests/s of paging when all requests arrive at once (the second of two runs: the
    first compiles whatever shapes this workload needs that the warm-up did not)."""
    burst = [_at0(w) for w in items]
    sv.serve(sv.make_engine(parts, **cfg), burst)
    run = sv.serve(sv.make_engine(parts, **cfg), burst)
    return throughput(run.timings, run.span)["requests_per_s"]


def _at0(w):
    return dataclasses.replace(w, arrival=0.0)


def panel(parts, cfg: dict, dataset: str, requests: int, scale: float, policies, fractions,
          seed: int, progress=None) -> dict:
    """One dataset x model: latency per (policy, rate) and sustainable rates."""
    base = make_workload(dataset, requests, 1.0, parts[2], seed, scale, cfg["max_model_len"])
    cap = capacity(parts, cfg, base)
    points = []
    for frac in fractions:
        items = make_workload(dataset, requests, frac * cap, parts[2], seed, scale,
                              cfg["max_model_len"])
        # A discarded run first: arrivals at this rate batch differently, and any step shape
        # not compiled yet would otherwise land in the first policy's latencies.
        sv.serve(sv.make_engine(parts, **cfg), items)
        for policy in policies:
            run = sv.serve(sv.make_engine(parts, **cfg, reservation=policy), items,
                           on_step=progress)
            points.append(dict(dataset=dataset, policy=policy, rate=frac * cap, fraction=frac,
                               mean_running=sv.mean_running(run),
                               **latency_summary(run.timings),
                               **throughput(run.timings, run.span)))
    return dict(dataset=dataset, capacity=cap, workload=describe(base), points=points,
                sustainable=sustainable(points, policies))


def sustainable(points: list[dict], policies) -> dict:
    """Highest tested rate per policy within LIMIT x paged's lowest-rate latency; ratios."""
    ref = min((p for p in points if p["policy"] == "paged"), key=lambda p: p["rate"])
    bound = LIMIT * ref["normalized_latency"]
    best = {pol: max([p["rate"] for p in points if p["policy"] == pol
                      and p["normalized_latency"] <= bound], default=0.0) for pol in policies}
    ratio = {pol: (best["paged"] / best[pol] if best[pol] else float("inf")) for pol in policies}
    return dict(bound_s_per_token=bound, rate=best, paged_over_policy=ratio)


def main(requests: int = 48, scale: float = 1.0, real_requests: int = 4, seed: int = 0,
         policies=sv.POLICIES, fractions=FRACTIONS, datasets=("sharegpt", "alpaca"),
         name: str = "latency_vs_rate", progress=None) -> dict:
    parts, cfg = sv.tiny_model(), sv.TINY
    sv.warm_up(parts, cfg)
    panels = [dict(model="tiny", **panel(parts, cfg, d, requests, BASE_SCALE[d] * scale,
                                         policies, fractions, seed, progress))
              for d in datasets]
    if real_requests:
        rparts = sv.real_model()
        sv.warm_up(rparts, sv.REAL, n=8)
        panels.append(dict(model="SmolLM2-135M", **panel(
            rparts, sv.REAL, "alpaca", real_requests, 0.25 * scale, ("paged", "orca-max"),
            (1.0, 3.0), seed, progress)))
    payload = dict(config=dict(tiny=cfg, real=sv.REAL, requests=requests, scale=scale,
                               seed=seed, limit=LIMIT, clock="virtual (serving.py)"),
                   panels=panels)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(panels, name))
    print_summary(panels)
    return payload


def print_summary(panels: list[dict]) -> None:
    rows = [dict(model=p["model"], dataset=p["dataset"], policy=pol,
                 sustainable_rate=p["sustainable"]["rate"][pol],
                 paged_over=p["sustainable"]["paged_over_policy"][pol])
            for p in panels for pol in p["sustainable"]["rate"]]
    print(table(rows, ["model", "dataset", "policy", "sustainable_rate", "paged_over"]))


def plot(panels: list[dict], name: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.3), squeeze=False)
    for ax, p in zip(axes[0], panels, strict=True):
        for pol in p["sustainable"]["rate"]:
            pts = sorted((q for q in p["points"] if q["policy"] == pol), key=lambda q: q["rate"])
            ax.plot([q["rate"] for q in pts], [q["normalized_latency"] for q in pts], "o-",
                    label=pol, ms=3)
        ax.set_yscale("log")
        ax.set_title(f"{p['model']}, {p['dataset']}-like", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.legend(fontsize=7)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--real-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
