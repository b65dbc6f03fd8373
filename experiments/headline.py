"""`make run`: the paper's headline results, condensed to a few minutes on 2 CPU cores.

    python -m experiments.headline [--full]

1. KV memory breakdown (paper Fig. 2) on a ShareGPT-like burst, tiny model.
2. One latency-vs-rate panel (paper Fig. 12), ShareGPT-like, tiny model, on the modeled
   A100 clock (paged_jax/study/cost_model.py: the engine runs for real, time is a roofline model).
3. paged-jax vs Hugging Face transformers on SmolLM2-135M (8 prompts, experiments/bench.py).
Each writes results/<name>.json and .png; a summary table is printed at the end.
"""

from __future__ import annotations

import argparse
import time

from tqdm.auto import tqdm

from experiments import bench, latency_vs_rate, memory_breakdown
from experiments.common import table

# Fractions of paging's capacity for the condensed latency panel (the full one has more).
HEADLINE_RATES = (0.2, 0.3, 0.4, 0.6, 0.8, 1.0)


def main(full: bool = False) -> dict:
    t0 = time.perf_counter()
    # disable=None: no bar when stderr is not a terminal (make's logs, CI), as LLM's bars.
    bar = tqdm(desc="headline (engine steps)", unit="step", dynamic_ncols=True, disable=None)
    mem = memory_breakdown.main(requests=48 if full else 32, name="headline_memory",
                                progress=bar.update)
    lat = latency_vs_rate.main(requests=200, measured_requests=0,
                               real_requests=0, datasets=("sharegpt",),
                               policies=memory_breakdown.POLICIES,
                               fractions=latency_vs_rate.FRACTIONS if full else HEADLINE_RATES,
                               name="headline_latency", progress=bar.update)
    bar.close()
    peer = bench.main(["--sides", "ours", "hf", "--rows", "batch 8", "--rounds", "2",
                       "--name", "headline_bench"])
    summary(mem, lat, peer, time.perf_counter() - t0)
    return dict(memory=mem, latency=lat, peers=peer)


def summary(mem: dict, lat: dict, peer: dict, seconds: float) -> None:
    pan = lat["panels"][0]
    rows = [dict(policy=r["policy"], token_states=f"{100 * r['token_states']:.1f}%",
                 paper=f"{100 * r['paper_token_states']:.1f}%",
                 mean_batch=r["mean_running"],
                 max_rate=latency_vs_rate.rate_label(pan, r["policy"]),
                 vllm_rate_ratio=latency_vs_rate.ratio_label(pan, r["policy"]))
            for r in mem["rows"] if r["policy"] in pan["sustainable"]["rate"]]
    print("\n== paged-jax vs the vLLM paper (tiny model, ShareGPT-like; max_rate on the "
          "modeled A100 clock; paper: 1.7-2.7x Orca-Oracle, 2.7-8x Orca-Max) ==")
    print(table(rows, ["policy", "token_states", "paper", "mean_batch", "max_rate",
                       "vllm_rate_ratio"]))
    sides = {e["side"]: e for e in peer["rows"]}
    ours, fp32 = sides["paged-jax float32"], sides["HF generate() float32"]
    print(f"\nSmolLM2-135M, 8 chat prompts x 32 tokens: paged-jax {ours['tok_s']:.1f} tok/s, "
          f"HF generate() float32 {fp32['tok_s']:.1f} (ours {fp32['ours_over_side']:.2f}x, "
          f"{fp32['verdict']}); matmul chain {ours['limit_tok_s']:.0f} tok/s")
    print(f"\nplots: {mem['png']}, {lat['png']}   ({seconds:.0f} s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    main(**vars(ap.parse_args()))
