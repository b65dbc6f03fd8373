"""Offline throughput of the engine on the default model (like `vllm bench throughput`).

    python -m experiments.bench_throughput [--prompts 64] [--input-len 128] [--output-len 128]
                                           [--dtype float32|bfloat16] [--max-num-seqs 64]

N prompts of real text with a fixed input length, greedy, exactly `output-len` tokens each
(ignore_eos). A first, smaller run warms up (compiles) the shapes; the measured run then
reports requests/s, output and total tokens/s, TTFT and TPOT (mean / p50 / p99), the share of
engine time spent on the host (scheduling, batch building, detokenizing) rather than inside
the jitted device calls, and how many programs compiled after warm-up (should be 0).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from experiments.common import save_json
from paged_jax import LLM, SamplingParams
from paged_jax import step as step_lib
from paged_jax.workloads import text_prompt


def compiled() -> int:
    return step_lib.run_step._cache_size() + step_lib.decode_window._cache_size()


def run(llm: LLM, n: int, input_len: int, output_len: int, seed: int) -> dict:
    tok = llm.get_tokenizer()
    base = text_prompt(input_len + n, tok)
    # Distinct prompts (shifted windows of the text) so nothing is shared between requests.
    prompts = [{"prompt_token_ids": base[i:i + input_len]} for i in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, seed=seed)
    engine = llm.llm_engine
    first = len(engine.stats)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    wall = time.perf_counter() - t0
    stats = engine.stats[first:]
    ttft = np.array([o.metrics.first_token_time - o.metrics.arrival_time for o in outs])
    tpot = np.array([(o.metrics.finished_time - o.metrics.first_token_time) / (output_len - 1)
                     for o in outs])
    busy = sum(s.duration for s in stats)
    device = sum(s.device for s in stats)
    pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    return dict(
        requests=n, input_len=input_len, output_len=output_len, wall_s=wall,
        requests_per_s=n / wall, output_tokens_per_s=n * output_len / wall,
        total_tokens_per_s=n * (input_len + output_len) / wall,
        ttft_mean_s=float(ttft.mean()), ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
        tpot_mean_ms=1e3 * float(tpot.mean()), tpot_p50_ms=1e3 * pct(tpot, 50),
        tpot_p99_ms=1e3 * pct(tpot, 99), host_overhead_share=1 - device / busy,
        engine_calls=len(stats), preemptions=sum(s.preempted for s in stats),
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--decode-window", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len + args.output_len + 16,
              decode_window=args.decode_window, seed=args.seed)
    run(llm, min(args.prompts, args.max_num_seqs), args.input_len, 2 * args.decode_window + 2,
        args.seed)  # warm-up: compiles every shape the measured run uses
    before = compiled()
    res = run(llm, args.prompts, args.input_len, args.output_len, args.seed)
    res["compilations_after_warmup"] = compiled() - before
    res["config"] = vars(args)
    name = args.name or f"bench_throughput_{args.dtype}"
    path = save_json(name, res)
    print(f"{args.prompts} prompts x ({args.input_len} in, {args.output_len} out), {args.dtype}:")
    for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_mean_s",
              "ttft_p50_s", "ttft_p99_s", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms",
              "host_overhead_share", "compilations_after_warmup", "preemptions"):
        print(f"  {k:28s} {res[k]:.3f}" if isinstance(res[k], float) else f"  {k:28s} {res[k]}")
    print(f"saved {path}")
    return res


if __name__ == "__main__":
    main()
