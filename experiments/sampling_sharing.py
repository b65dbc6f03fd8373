"""Paper Fig. 15: KV blocks saved by sharing prompt blocks across parallel samples (and beams).

    python -m experiments.sampling_sharing [--requests 16] [--widths 2 4 6]

Alpaca-like requests (all at t = 0) ask for n samples each (temperature 1, seeded). The n
sequences of a request share the prompt's blocks (copy-on-write on the partly filled last
block). Saving = 1 - blocks actually used / blocks the same sequences would hold privately,
averaged over decode iterations. Beam search (`LLM.beam_search`, one prompt at a time, beams
forking and freeing blocks) is measured at its peak: saving = 1 - peak blocks in use / blocks
of W private beams of the same length (prompt + max_tokens - 1, the longest written).
Paper (Alpaca, OPT-13B): parallel sampling saves 6.1-9.8%, beam search 37.6-55.2%.
"""

from __future__ import annotations

import argparse

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.llm import LLM
from paged_jax.sampling_params import BeamSearchParams
from paged_jax.study.metrics import throughput
from paged_jax.study.workloads import describe, make_workload

PAPER = {"parallel": "6.1-9.8%", "beam": "37.6-55.2%"}


def saving(run: sv.Run) -> float:
    """1 - used / private blocks, summed over iterations."""
    w = sv.step_weights(run)
    used = sum(x * s["blocks_used"] for x, s in zip(w, run.snapshots, strict=True))
    private = sum(x * s["blocks_private"] for x, s in zip(w, run.snapshots, strict=True))
    return 1.0 - used / private if private else 0.0


def beam_rows(parts, cfg: dict, items, widths, progress=None) -> list[dict]:
    """Peak KV blocks of beam search vs W private beams, per width."""
    # No decode_window: beam search runs no windows, and LLM's default (async) applies.
    keys = ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "enable_prefix_caching")
    llm = LLM(model_parts=parts, **{k: cfg[k] for k in keys})
    bs, rows = cfg["block_size"], []
    for w in widths:
        peak = private = 0
        for it in items:
            llm.beam_search([{"prompt_token_ids": it.prompt_token_ids}],
                            BeamSearchParams(beam_width=w, max_tokens=it.output_len,
                                             ignore_eos=True))
            peak += llm.last_beam_peak_blocks
            private += w * -(-(len(it.prompt_token_ids) + it.output_len - 1) // bs)
            if progress:
                progress()
        rows.append(dict(mode="beam", width=w, saving=1 - peak / private, paper=PAPER["beam"]))
    return rows


def main(requests: int = 16, widths=(2, 4, 6), scale: float = 1.0, seed: int = 0,
         beam_requests: int = 4, name: str = "sampling_sharing", progress=None) -> dict:
    parts, cfg = sv.tiny_model(), sv.TINY
    sv.warm_up(parts, cfg)
    items = make_workload("alpaca", requests, float("inf"), parts[2], seed, scale,
                          cfg["max_model_len"])
    rows = []
    for n in widths:
        run = sv.serve(sv.make_engine(parts, **cfg), items, on_step=progress, params=lambda w, n=n:
                       w.params(n=n, temperature=1.0, seed=seed + int(w.request_id.split("-")[1])))
        rows.append(dict(mode="parallel", width=n, saving=saving(run), paper=PAPER["parallel"],
                         **throughput(run.timings, run.span)))
    if hasattr(LLM, "beam_search"):
        rows += beam_rows(parts, cfg, items[:beam_requests], widths, progress)
        beam = f"measured on the first {beam_requests} requests (peak blocks)"
    else:
        beam = "not measured: LLM.beam_search does not exist in this tree yet"
    payload = dict(config=dict(engine=cfg, requests=requests, scale=scale, seed=seed,
                               workload=describe(items)), rows=rows, beam_search=beam)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["mode", "width", "saving", "paper", "output_tokens_per_s"]))
    print("beam search:", beam)
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        sel = [r for r in rows if r["mode"] == mode]
        ax.plot([r["width"] for r in sel], [100 * r["saving"] for r in sel], "o-",
                label=f"{mode} (paper {PAPER[mode]})")
    ax.set_xlabel("samples per request (n) / beam width")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_title("Memory saving from block sharing, Alpaca-like", fontsize=9)
    ax.legend(fontsize=7)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--beam-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    main(**vars(ap.parse_args()))
