"""Paper Fig. 12: normalized latency vs request rate, per KV reservation policy.

    python -m experiments.latency_vs_rate [--requests 200] [--measured-requests 48]
                                          [--real-requests 4] [--scale 1]

Every panel first serves its workload all at once under paging to find paging's capacity C
(requests/s), then serves Poisson arrivals at fractions of C under every policy, on the
virtual clock of experiments/serving.py. Panels:
  * tiny model, ShareGPT-like (lengths x0.25) and Alpaca-like, MODELED clock: the engine runs
    every step for real, and the clock advances by the step's roofline time for the paper's
    OPT-13B on an A100 (paged_jax/study/cost_model.py). This is the Fig. 12 reproduction: the
    memory policy sets the batch, and the batch sets throughput, as on the paper's GPU.
  * tiny model, ShareGPT-like, MEASURED clock (CPU wall time of each step).
  * SmolLM2-135M, Alpaca-like, measured clock, paged vs orca-max (a few requests).
A policy's highest sustainable rate is the highest tested rate up to which its mean
normalized latency stays within LIMIT x paged's at the lowest rate (the knee of the paper's
curves). Queues only build up over many requests, so small --requests flatten the curves.
Paper: vLLM sustains 1.7-2.7x Orca (Oracle) and 2.7-8x Orca (Max) rates on ShareGPT.
"""

from __future__ import annotations

import argparse
import dataclasses

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.study.cost_model import GpuCostModel
from paged_jax.study.metrics import latency_summary, throughput
from paged_jax.study.workloads import describe, make_workload

LIMIT = 2.0
BASE_SCALE = {"sharegpt": 0.25, "alpaca": 1.0}
# Fractions of paging's capacity: fine at the low end, where the baselines' knees are.
FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25)
MEASURED_FRACTIONS = (0.25, 0.5, 1.0, 2.0)


def capacity(parts, cfg: dict, items, cost=None) -> float:
    """Requests/s of paging when all requests arrive at once (the second of two runs: the
    first compiles whatever shapes this workload needs that the warm-up did not)."""
    burst = [_at0(w) for w in items]
    sv.serve(sv.make_engine(parts, **cfg), burst)
    run = sv.serve(sv.make_engine(parts, **cfg), burst, cost=cost)
    return throughput(run.timings, run.span)["requests_per_s"]


def _at0(w):
    return dataclasses.replace(w, arrival=0.0)


def panel(parts, cfg: dict, dataset: str, requests: int, scale: float, policies, fractions,
          seed: int, cost: GpuCostModel | None = None, progress=None) -> dict:
    """One dataset x model x clock: latency per (policy, rate) and sustainable rates."""
    base = make_workload(dataset, requests, 1.0, parts[2], seed, scale, cfg["max_model_len"])
    cap = capacity(parts, cfg, base, cost)
    points = []
    for frac in fractions:
        items = make_workload(dataset, requests, frac * cap, parts[2], seed, scale,
                              cfg["max_model_len"])
        if cost is None:
            # A discarded run first: arrivals at this rate batch differently, and any step
            # shape not compiled yet would otherwise land in the first policy's latencies.
            sv.serve(sv.make_engine(parts, **cfg), items)
        for policy in policies:
            run = sv.serve(sv.make_engine(parts, **cfg, reservation=policy), items,
                           on_step=progress, cost=cost)
            points.append(dict(dataset=dataset, policy=policy, rate=frac * cap, fraction=frac,
                               mean_running=sv.mean_running(run),
                               **latency_summary(run.timings),
                               **throughput(run.timings, run.span)))
    return dict(dataset=dataset, clock="modeled" if cost else "measured",
                capacity=cap, workload=describe(base), points=points,
                sustainable=sustainable(points, policies))


def sustainable(points: list[dict], policies) -> dict:
    """Per policy, the highest tested rate up to which latency stays within LIMIT x paged's
    lowest-rate latency (its knee); and paging's rate over each policy's."""
    ref = min((p for p in points if p["policy"] == "paged"), key=lambda p: p["rate"])
    bound = LIMIT * ref["normalized_latency"]
    best = {pol: _knee(sorted((p["rate"], p["normalized_latency"]) for p in points
                              if p["policy"] == pol), bound) for pol in policies}
    ratio = {pol: (best["paged"] / best[pol] if best[pol] else float("inf")) for pol in policies}
    return dict(bound_s_per_token=bound, rate=best, paged_over_policy=ratio)


def _knee(curve: list[tuple[float, float]], bound: float) -> float:
    """The last rate before the latency first exceeds `bound` (0 if the lowest already does)."""
    best = 0.0
    for rate, lat in curve:
        if lat > bound:
            break
        best = rate
    return best


def main(requests: int = 200, measured_requests: int = 48, real_requests: int = 4,
         scale: float = 1.0, seed: int = 0, policies=sv.POLICIES, fractions=FRACTIONS,
         datasets=("sharegpt", "alpaca"), name: str = "latency_vs_rate", progress=None) -> dict:
    parts, cfg, cost = sv.tiny_model(), sv.TINY, GpuCostModel()
    sv.warm_up(parts, cfg)
    panels = [dict(model="tiny", **panel(parts, cfg, d, requests, BASE_SCALE[d] * scale,
                                         policies, fractions, seed, cost, progress))
              for d in datasets if requests]
    if measured_requests:
        d = datasets[0]
        panels.append(dict(model="tiny", **panel(
            parts, cfg, d, measured_requests, BASE_SCALE[d] * scale, policies,
            MEASURED_FRACTIONS, seed, None, progress)))
    if real_requests:
        rparts = sv.real_model()
        sv.warm_up(rparts, sv.REAL, n=8)
        panels.append(dict(model="SmolLM2-135M", **panel(
            rparts, sv.REAL, "alpaca", real_requests, 0.25 * scale, ("paged", "orca-max"),
            (1.0, 3.0), seed, None, progress)))
    payload = dict(config=dict(tiny=cfg, real=sv.REAL, requests=requests,
                               measured_requests=measured_requests, scale=scale, seed=seed,
                               limit=LIMIT, cost_model=cost.describe(),
                               clock="virtual (serving.py)"),
                   panels=panels)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(panels, name))
    print_summary(panels)
    return payload


def print_summary(panels: list[dict]) -> None:
    rows = [dict(model=p["model"], dataset=p["dataset"], clock=p["clock"],
                 policy=pol, mean_batch=_top(p, pol)["mean_running"],
                 sustainable_rate=rate_label(p, pol),
                 paged_over=ratio_label(p, pol))
            for p in panels for pol in p["sustainable"]["rate"]]
    print(table(rows, ["model", "dataset", "clock", "policy", "mean_batch", "sustainable_rate",
                       "paged_over"]))


def rate_label(p: dict, policy: str) -> str:
    """A policy's sustainable rate; "< lowest" when even the lowest tested rate was over."""
    rate = p["sustainable"]["rate"][policy]
    return f"{rate:.2f}" if rate else f"< {min(q['rate'] for q in p['points']):.2f}"


def ratio_label(p: dict, policy: str) -> str:
    """Paging's sustainable rate over the policy's ("> n" when the policy's is below range)."""
    sus, lowest = p["sustainable"], min(q["rate"] for q in p["points"])
    if sus["rate"][policy]:
        return f"{sus['paged_over_policy'][policy]:.1f}x"
    return f"> {sus['rate']['paged'] / lowest:.0f}x"


def _top(p: dict, policy: str) -> dict:
    """The policy's point at the highest tested rate (its batch when saturated)."""
    return max((q for q in p["points"] if q["policy"] == policy), key=lambda q: q["rate"])


def plot(panels: list[dict], name: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.3), squeeze=False)
    for ax, p in zip(axes[0], panels, strict=True):
        for pol in p["sustainable"]["rate"]:
            pts = sorted((q for q in p["points"] if q["policy"] == pol), key=lambda q: q["rate"])
            ax.plot([q["rate"] for q in pts], [q["normalized_latency"] for q in pts], "o-",
                    label=pol, ms=3)
        ax.set_yscale("log")
        clock = "modeled A100" if p["clock"] == "modeled" else "CPU"
        ax.set_title(f"{p['model']}, {p['dataset']}-like, {clock} clock", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.legend(fontsize=7)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--measured-requests", type=int, default=48)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--real-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
