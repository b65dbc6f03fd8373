"""Fair prefill: one long prompt arrives while short requests decode. Do the short requests'
tokens keep coming, and at what cost to the long prompt's first token?

    python -m experiments.long_prompt [--caps 0 64] [--long 8000] [--shorts 16] [--rounds 1]

The default model (float32, async scheduling as the server runs it, prefix caching off), 32
sequence slots and a 256-token budget per step (the server's default). `--shorts` chat
prompts decode `--short-tokens` tokens each (greedy); once each has 16 tokens, a prompt of
`--long` tokens arrives (chat prompts joined, cut to length) asking for 8 tokens. Each side
sets `long_prefill_token_threshold` (the most tokens one prompt prefills per step; 0 = what
budget the decodes leave). Each side runs once to compile its shapes, then `--rounds` times,
alternating. Per side (medians over rounds):
  itl_p50 / itl_p99     the short requests' inter-token latency over their whole run (ms)
  p99_over_p50          the issue's target: under 3 (a cap can meet it by raising the p50:
                        read it beside itl_during / itl_before)
  itl_during            median ITL while the long prompt prefills (ms)
  itl_before            median ITL before it arrived (the shorts' own prefill, then decodes)
  long_ttft             the long prompt's time to first token (s)
  max_preemptions       the most times any request was preempted (target: at most 1)
and whether the short requests' tokens equal the first side's (the cap changes timing only).
Writes results/long_prompt.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from experiments import common
from experiments.prompts import prompt_ids

LIMITS = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=8192, block_size=16,
              kv_cache_memory=1 << 30, enable_prefix_caching=False, async_scheduling=True)
ARRIVE_AFTER = 16  # short-request tokens before the long prompt arrives


def long_prompt(tok, n: int, skip: int) -> list[int]:
    """n tokens of real chat prompts joined, from prompt `skip` on (the short requests are
    the first `skip`: no shared prefix with them)."""
    ids: list[int] = []
    k = 64
    while len(ids) < n:
        ids = [t for p in prompt_ids(tok, skip + k)[skip:] for t in p]
        k *= 2
    return ids[:n]


def scenario(llm, shorts: list[list[int]], long: list[int], short_tokens: int) -> dict:
    """Runs the shorts, adds the long prompt after ARRIVE_AFTER tokens each; token times."""
    from paged_jax import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=short_tokens, ignore_eos=True)
    for i, p in enumerate(shorts):
        eng.add_request(f"s{i}", {"prompt_token_ids": p}, sp)
    stamps: dict[str, list[float]] = {f"s{i}": [] for i in range(len(shorts))}
    final, arrive, first = {}, None, None
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            final[o.request_id] = o
            if o.request_id == "long":
                first = first or (now if o.outputs[0].token_ids else None)
                continue
            new = len(o.outputs[0].token_ids) - len(stamps[o.request_id])
            stamps[o.request_id] += [now] * new
        if arrive is None and min(len(s) for s in stamps.values()) >= ARRIVE_AFTER:
            eng.add_request("long", {"prompt_token_ids": long},
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            arrive = time.perf_counter()
    gaps = [(b - a, b) for s in stamps.values() for a, b in zip(s[:-1], s[1:], strict=True)]
    itl = np.array([g for g, _ in gaps]) * 1e3
    during = [g * 1e3 for g, t in gaps if arrive < t <= first]
    before = [g * 1e3 for g, t in gaps if t <= arrive]
    return dict(itl_p50=float(np.percentile(itl, 50)), itl_p99=float(np.percentile(itl, 99)),
                itl_during=statistics.median(during) if during else float("nan"),
                itl_before=statistics.median(before), long_ttft=first - arrive,
                max_preemptions=max(o.num_preemptions for o in final.values()),
                tokens=[final[f"s{i}"].outputs[0].token_ids for i in range(len(shorts))])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[0, 64])
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--shorts", type=int, default=16)
    ap.add_argument("--short-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    a = ap.parse_args(argv)
    if a.short_tokens <= ARRIVE_AFTER:
        ap.error(f"--short-tokens must exceed {ARRIVE_AFTER} (the long prompt arrives then)")
    from paged_jax import LLM
    from paged_jax.models import load_model

    parts = load_model(a.model)
    limits = dict(LIMITS, max_model_len=min(LIMITS["max_model_len"],
                                            parts[0].max_position_embeddings))
    llms = {c: LLM(model_parts=parts, long_prefill_token_threshold=c, **limits) for c in a.caps}
    long_len = min(a.long, limits["max_model_len"] - 8)
    shorts, long = prompt_ids(parts[2], a.shorts), long_prompt(parts[2], long_len, a.shorts)
    for llm in llms.values():
        scenario(llm, shorts, long, a.short_tokens)  # compiles every shape the run meets
    runs = {c: [] for c in a.caps}
    for r in range(a.rounds):
        for c in a.caps[r % len(a.caps):] + a.caps[:r % len(a.caps)]:
            runs[c].append(scenario(llms[c], shorts, long, a.short_tokens))
    rows, ref = [], runs[a.caps[0]][0]["tokens"]
    keys = ["itl_p50", "itl_p99", "itl_during", "itl_before", "long_ttft"]
    for c, rs in runs.items():
        row = dict(cap=c, **{k: statistics.median(x[k] for x in rs) for k in keys})
        row["p99_over_p50"] = row["itl_p99"] / row["itl_p50"]
        row["p99_over_p50_runs"] = [x["itl_p99"] / x["itl_p50"] for x in rs]
        row["max_preemptions"] = max(x["max_preemptions"] for x in rs)
        row["same_tokens"] = all(x["tokens"] == ref for x in rs)
        # What the short requests feel while the long prompt prefills (an earlier target, p99
        # under 3x p50, could not fail: the cap raises the p50 with the p99).
        row["itl_during_over_before_runs"] = [x["itl_during"] / x["itl_before"] for x in rs]
        row["itl_during_over_before"] = statistics.median(row["itl_during_over_before_runs"])
        rows.append(row)
    print(common.table(rows, ["cap", "itl_p50", "itl_p99", "p99_over_p50", "itl_during",
                              "itl_before", "itl_during_over_before", "long_ttft",
                              "max_preemptions", "same_tokens"]))
    out = dict(limits=limits, long_tokens=len(long), shorts=a.shorts,
               short_tokens=a.short_tokens, arrive_after=ARRIVE_AFTER, rounds=a.rounds,
               rows=rows)
    out["json"] = str(common.save_json("long_prompt", out))
    return out


if __name__ == "__main__":
    main()
