"""Async scheduling offline: `LLM.generate` with every step delivered (async, the host one step
ahead) against today's decode windows and plain synchronous steps, alternating in one run.

    python -m experiments.async_scheduling [--rounds 3] [--tokens 64] [--batches 1 16]

Sides, on the default model (float32, prefix caching off, bench.py's limits):
  window 8     synchronous, decode windows of 8 steps per device call (the default so far)
  sync         synchronous, one step per call (every token delivered, the host in series)
  async        async scheduling: the host plans step n+1 while the device runs step n

Per batch (chat prompts, greedy, exactly T tokens each): tok/s (median of the rounds, spread,
a verdict against window 8), the host's share of a step (1 - the time blocked reading the
device / the step's time) and greedy agreement with window 8. Writes
results/async_scheduling.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from experiments import common
from experiments.bench import LIMITS
from experiments.prompts import prompt_ids

SIDES = {"window 8": dict(decode_window=8, async_scheduling=False),
         "sync": dict(decode_window=1, async_scheduling=False),
         "async": dict(async_scheduling=True)}


def make(parts, **kw):
    from paged_jax import LLM

    return LLM(model_parts=parts, enable_prefix_caching=False,
               kv_cache_memory=LIMITS["kv_cache_gib"] << 30,
               **{k: v for k, v in LIMITS.items() if k != "kv_cache_gib"}, **kw)


def run(llm, prompts: list[list[int]], tokens: int) -> dict:
    from paged_jax import SamplingParams

    eng = llm.llm_engine
    eng.recorder = steps = []
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    busy, wait = sum(s.duration for s in steps), sum(s.wait for s in steps)
    return dict(tok_s=len(prompts) * tokens / seconds, host_share=1 - wait / busy,
                tokens=[o.outputs[0].token_ids for o in outs])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args(argv)
    from paged_jax.models import load_model

    parts = load_model(None)
    llms = {name: make(parts, **kw) for name, kw in SIDES.items()}
    rows = []
    for b in a.batches:
        prompts = prompt_ids(parts[2], b)
        for llm in llms.values():
            run(llm, prompts, a.tokens)  # warm-up: compiles every shape the row meets
        runs = {name: [] for name in llms}
        for r in range(a.rounds):
            names = list(llms)[r % len(llms):] + list(llms)[:r % len(llms)]
            for name in names:
                runs[name].append(run(llms[name], prompts, a.tokens))
        ref = runs["window 8"][0]["tokens"]
        for name, rs in runs.items():
            tps = [x["tok_s"] for x in rs]
            rows.append(dict(
                batch=b, side=name, tok_s=statistics.median(tps), spread=common.spread(tps),
                vs_window=common.compare(tps, [x["tok_s"] for x in runs["window 8"]]),
                host_share=statistics.median(x["host_share"] for x in rs),
                greedy_agree=sum(x == y for x, y in zip(rs[0]["tokens"], ref, strict=True))
                / len(ref), runs=tps))
            print(common.table(rows[-1:], ["batch", "side", "tok_s", "spread", "host_share",
                                           "greedy_agree"]),
                  rows[-1]["vs_window"]["ratio"], rows[-1]["vs_window"]["verdict"], flush=True)
    out = dict(rounds=a.rounds, tokens=a.tokens, limits=LIMITS, sides=SIDES, rows=rows)
    out["json"] = str(common.save_json("async_scheduling", out))
    return out


if __name__ == "__main__":
    main()
