"""Paper Fig. 16/17 (shared prefix) and a multi-turn chat: automatic prefix caching on vs off.

    python -m experiments.shared_prefix [--requests 32] [--turns 4] [--real] [--no-orca]

Few-shot: every request is `prefix + its own sentence`, the prefix holding 1 or 5 examples
(the paper's WMT16 En-De prompts: 80 and 341 tokens). All requests arrive at t = 0, so the
KV cache is the bottleneck and sharing the prefix lets more requests run at once.
Multi-turn chat: C conversations of T turns; turn t's prompt is the whole conversation so far
(system prompt, earlier questions and the model's answers) plus a new question, sent when the
previous turn finished. With caching, each turn recomputes only its new tokens.

Reported per run: output tokens/s and requests/s (virtual clock, experiments/serving.py),
mean TTFT, prefix hit rate (cached / prompt tokens) and blocks saved (cached full blocks
attached instead of allocated). The paper reports vLLM with prefix sharing at 1.67x (1-shot)
and 3.58x (5-shot) the throughput of Orca (Oracle); here the main comparison is the same
engine with caching on vs off, plus Orca (Oracle) (no caching) as the paper's baseline.
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.study.metrics import latency_summary, throughput
from paged_jax.study.workloads import TEXT, WorkItem

PAPER_SPEEDUP = {"1-shot": 1.67, "5-shot": 3.58}  # vLLM vs Orca (Oracle), Fig. 16
PREFIX_TOKENS = {"1-shot": 80, "5-shot": 341}  # the paper's prefix lengths


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text))


def few_shot(shots: str, n: int, tok, seed: int, suffix: int = 24, out: int = 24) -> list[WorkItem]:
    """n requests sharing a PREFIX_TOKENS[shots]-token prefix, each with its own sentence."""
    rng, base = np.random.default_rng(seed), _ids(tok, TEXT * 4)
    prefix = base[: PREFIX_TOKENS[shots]]
    items = []
    for i in range(n):
        start = int(rng.integers(0, len(base) - suffix))
        own = (_ids(tok, f"#{i}: ") + base[start:start + suffix])[:suffix]
        items.append(WorkItem(f"{shots}-{i}", prefix + own, out, 0.0))
    return items


def serve_once(parts, cfg: dict, items: list[WorkItem], **engine_kw) -> dict:
    """Serves a burst on a fresh engine (after an unmeasured pass that compiles every shape
    this configuration uses); returns the row of measurements."""
    for _ in range(2):
        eng = sv.make_engine(parts, **{**cfg, **engine_kw})
        run = sv.serve(eng, items)
    return _row(cfg, run.timings, run.span, list(run.outputs.values()), run.stats)


def _row(cfg: dict, timings, span: float, outputs, stats) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    k = cfg["block_size"]
    return dict(**throughput(timings, span), ttft=latency_summary(timings)["ttft"],
                hit_rate=cached / prompt if prompt else 0.0, prompt_tokens=prompt,
                cached_tokens=cached, blocks_saved=sum(o.num_cached_tokens // k for o in outputs),
                span_s=span, computed_tokens=sum(st.num_tokens for st in stats),
                device_calls=sum(st.kind != "idle" for st in stats))


def multi_turn(parts, cfg: dict, convs: int, turns: int, seed: int, caching: bool) -> dict:
    """C conversations x T turns on one engine; each turn is sent when the last one ended."""
    tok, rng = parts[2], np.random.default_rng(seed)
    base = _ids(tok, TEXT * 4)
    system = _ids(tok, "<system>You are a helpful assistant. Answer briefly.\n")
    history = [list(system) for _ in range(convs)]
    eng = sv.make_engine(parts, **{**cfg, "enable_prefix_caching": caching})
    timings, outputs, span, stats = [], [], 0.0, []
    for t in range(turns):
        items = []
        for c in range(convs):
            start = int(rng.integers(0, len(base) - 20))
            history[c] += _ids(tok, f"<user>{c}.{t} ") + base[start:start + 20]
            items.append(WorkItem(f"c{c}-t{t}", list(history[c]), 24, 0.0))
        run = sv.serve(eng, items)
        for c in range(convs):
            out = run.outputs[f"c{c}-t{t}"]
            history[c] += list(out.outputs[0].token_ids)
            outputs.append(out)
        timings += run.timings
        span += run.span
        stats = run.stats  # the engine's stats accumulate over the turns
    return _row(cfg, timings, span, outputs, stats)


def main(requests: int = 32, convs: int = 8, turns: int = 4, seed: int = 0, real: bool = False,
         orca: bool = True, name: str = "shared_prefix") -> dict:
    parts = sv.real_model() if real else sv.tiny_model()
    cfg = dict(sv.REAL if real else sv.TINY)
    sv.warm_up(parts, cfg)
    rows = []
    for shots in ("1-shot", "5-shot"):
        items = few_shot(shots, requests, parts[2], seed)
        runs = {"caching on": dict(enable_prefix_caching=True),
                "caching off": dict(enable_prefix_caching=False)}
        if orca:
            runs["orca-oracle"] = dict(enable_prefix_caching=False, reservation="orca-oracle")
        for label, kw in runs.items():
            rows.append(dict(workload=shots, run=label, **serve_once(parts, cfg, items, **kw)))
    for caching in (True, False):
        multi_turn(parts, cfg, convs, turns, seed, caching)  # compiles this run's shapes
        rows.append(dict(workload=f"chat {convs}x{turns}",
                         run="caching on" if caching else "caching off",
                         **multi_turn(parts, cfg, convs, turns, seed, caching)))
    _speedups(rows)
    payload = dict(config=dict(engine=cfg, requests=requests, convs=convs, turns=turns,
                               seed=seed, model="SmolLM2-135M" if real else "tiny random"),
                   paper_speedup_vs_orca_oracle=PAPER_SPEEDUP, rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["workload", "run", "output_tokens_per_s", "requests_per_s", "ttft",
                       "hit_rate", "blocks_saved", "computed_tokens", "device_calls",
                       "speedup_vs_off", "speedup_vs_orca",
                       "paper_vs_orca"]))
    return payload


def _speedups(rows: list[dict]) -> None:
    """Throughput ratios of each run to 'caching off' and to Orca (Oracle), same workload."""
    by = {(r["workload"], r["run"]): r["output_tokens_per_s"] for r in rows}
    for r in rows:
        off, orca = by.get((r["workload"], "caching off")), by.get((r["workload"], "orca-oracle"))
        r["speedup_vs_off"] = r["output_tokens_per_s"] / off if off else None
        r["speedup_vs_orca"] = r["output_tokens_per_s"] / orca if orca else None
        r["paper_vs_orca"] = PAPER_SPEEDUP.get(r["workload"]) if r["run"] == "caching on" else None


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    runs = list(dict.fromkeys(r["run"] for r in rows))
    x, w = np.arange(len(workloads)), 0.8 / len(runs)
    for j, run in enumerate(runs):
        get = {r["workload"]: r for r in rows if r["run"] == run}
        for ax, key in zip(axes, ("output_tokens_per_s", "ttft"), strict=True):
            ax.bar(x + j * w, [get[wl][key] if wl in get else 0 for wl in workloads], w,
                   label=run)
    for ax, title in zip(axes, ("throughput (output tok/s)", "mean TTFT (s)"), strict=True):
        ax.set_xticks(x + w * (len(runs) - 1) / 2, workloads)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.suptitle("Prefix caching: shared few-shot prefixes and multi-turn chat")
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M instead of the tiny model")
    ap.add_argument("--no-orca", dest="orca", action="store_false")
    main(**vars(ap.parse_args()))
