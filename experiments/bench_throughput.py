"""paged-jax against its peer and its limits, from one run on one machine (`make bench`).

    python -m experiments.bench_throughput [--quick] [--model gemma3]

Everything is SmolLM2-135M-Instruct fp32 (or Gemma 3 270M with --model gemma3: parts 1 and 2
only, on plain-text prompts, since the base model has no chat template), greedy, exactly the
asked tokens (ignore_eos), on the CPU, measured in this one process so the ratios compare
like with like:

  1. batch 64: 64 chat prompts x 128 tokens. paged-jax `LLM(max_num_seqs=64)` against
     transformers `generate()` in one static batch of 64 (runs alternate, best of two each),
     and against the XLA matmul-chain ceiling: the model's matmuls alone (no attention,
     norms or sampling) at batch 64, timed in XLA. Also the share of engine time spent on
     the host, and the programs compiled by the measured runs (0 expected: a warm-up with
     other prompts of the same shape compiles them first).
  2. batch 1: one chat prompt x 64 tokens with `LLM()` defaults against `generate()` at
     batch 1, and against the memory-bandwidth roofline: every decode step reads all weights
     and the sequence's K/V, so tokens/s <= measured bytes/s / bytes per token.
  3. ShareGPT-like lengths (the paper's distribution scaled to fit a CPU): N requests at once,
     paged-jax (continuous batching, at most 64 running) against static batches of 64 with
     transformers (each batch runs to its longest output: the shorter ones are padding).
  4. a fresh Python process: import, `LLM()` and one 64-token answer, with the compile cache
     warm (the measured second of two runs).
  5. vLLM's CPU build on the batch-64 workload, if `make peers BATCH=64` has measured it here
     (results/peers_vllm.json).
  6. bf16 on XLA:CPU: the matmul chain with bf16 weights and math, and with bf16 storage
     upcast to fp32 inside the program, against fp32 (why dtype="auto" is fp32 on CPU).

Writes results/bench_throughput.json (bench_throughput_gemma3.json) and prints the table
README.md quotes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from experiments import common, hf
from experiments.peers import prompt_ids
from paged_jax import LLM, SamplingParams
from paged_jax.engine import step as step_lib
from paged_jax.engine import window as window_lib
from paged_jax.models import load_model
from paged_jax.models.llama import prepare_params
from paged_jax.study.metrics import kv_bytes_per_token, measure_bandwidth, weight_bytes
from paged_jax.study.workloads import make_workload

FRESH = """
import time; t0 = time.perf_counter()
from paged_jax import LLM, SamplingParams
out = LLM().chat([{"role": "user", "content": "Write a haiku about paging."}],
                 SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
print(time.perf_counter() - t0)
"""


def compiled() -> int:
    return step_lib.run_step._cache_size() + window_lib.decode_window._cache_size()


def chain_seconds(params, batch: int, repeats: int = 10, compute=None) -> float:
    """The model's matmul chain at `batch` rows in XLA (best of repeats): the ceiling.

    `compute`: cast the weights to this dtype inside the program (bf16 storage, fp32 math).
    """
    import jax
    import jax.numpy as jnp

    layers, embed = params["layers"], params["embed"]
    dtype = compute or embed.dtype
    up = lambda w: w.astype(dtype)  # noqa: E731

    def chain(layers, embed, x):
        for p in layers:
            qkv = x @ up(p["w_qkv"])
            x = x + qkv[:, :p["wo"].shape[0]] @ up(p["wo"])
            x = x + jnp.split(x @ up(p["w_gate_up"]), 2, axis=-1)[0] @ up(p["w_down"])
        return jnp.einsum("te,ve->tv", x, up(embed))  # the tied lm_head

    f = jax.jit(chain)
    x = jnp.full((batch, embed.shape[1]), 0.01, dtype)
    f(layers, embed, x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(layers, embed, x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def ours(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    """One generate() call: seconds, engine host share, programs compiled, first 16 tokens."""
    eng, before = llm.llm_engine, compiled()
    eng.recorder = steps = []
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    busy = sum(s.duration for s in steps)
    device = sum(s.device for s in steps)
    return dict(seconds=seconds, host_share=1 - device / busy, compiled=compiled() - before,
                first16=[o.outputs[0].token_ids[:16] for o in outs])


def batch64(parts, hf_model, pad: int, n: int, tokens: int, rounds: int) -> dict:
    tok = parts[2]
    ids = prompt_ids(tok, 2 * n)
    warm, meas = ids[n:], ids[:n]
    llm = LLM(model_parts=parts, max_num_seqs=n, max_num_batched_tokens=512, decode_window=16,
              max_model_len=512)
    ours(llm, warm, tokens)  # compiles every program the measured runs use
    hf.generate(hf_model, warm[:2], 2, pad)
    runs, hfs = [], []
    for _ in range(rounds):  # alternating, so both see the machine in the same state
        runs.append(ours(llm, meas, tokens))
        hfs.append(hf.static_batches(hf_model, meas, [tokens] * n, n, pad))
    best, hf_best = min(runs, key=lambda r: r["seconds"]), min(hfs, key=lambda r: r["seconds"])
    agree = sum(a == b for a, b in zip(best["first16"], hf_best["first16"], strict=True))
    ceiling = chain_seconds(llm.llm_engine.params, n)
    return dict(
        requests=n, tokens=tokens, paged_tok_s=n * tokens / best["seconds"],
        hf_tok_s=n * tokens / hf_best["seconds"], ceiling_tok_s=n / ceiling,
        host_share=best["host_share"], compiled_after_warmup=sum(r["compiled"] for r in runs),
        agree_first16=agree, runs_s=[r["seconds"] for r in runs],
        hf_runs_s=[r["seconds"] for r in hfs], chain_step_ms=1e3 * ceiling)


def batch1(parts, hf_model, pad: int, tokens: int, bandwidth: float, rounds: int) -> dict:
    tok, config, params = parts[2], parts[0], parts[1]
    llm = LLM(model_parts=parts)  # the defaults a new user gets
    prompt = prompt_ids(tok, 3)
    ours(llm, prompt[2:], tokens)  # warm-up
    hf.generate(hf_model, prompt[2:], 2, pad)
    mine = min(ours(llm, prompt[:1], tokens)["seconds"] for _ in range(rounds))
    theirs = min(hf.static_batches(hf_model, prompt[:1], [tokens], 1, pad)["seconds"]
                 for _ in range(rounds))
    context = len(prompt[0]) + tokens / 2
    per_token = weight_bytes(params) + context * kv_bytes_per_token(config, np.float32)
    return dict(tokens=tokens, paged_tok_s=tokens / mine, hf_tok_s=tokens / theirs,
                roofline_tok_s=bandwidth / per_token, bytes_per_token=per_token)


def sharegpt(parts, hf_model, pad: int, n: int, scale: float, batch: int) -> dict:
    items = make_workload("sharegpt", n, float("inf"), parts[2], seed=0, scale=scale,
                          max_model_len=512)
    prompts, lens = [w.prompt_token_ids for w in items], [w.output_len for w in items]
    # The synthetic prompts all open with the same text: no prefix caching on either side.
    llm = LLM(model_parts=parts, max_num_seqs=batch, max_num_batched_tokens=512,
              decode_window=16, max_model_len=512, enable_prefix_caching=False)

    def run() -> dict:
        before = compiled()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     [w.params() for w in items], use_tqdm=False)
        return dict(seconds=time.perf_counter() - t0, compiled=compiled() - before)

    run()  # warm-up: the same workload compiles every bucket it meets
    mine = run()
    theirs = hf.static_batches(hf_model, prompts, lens, batch, pad)
    useful = sum(lens)
    return dict(requests=n, scale=scale, output_tokens=useful, paged_tok_s=useful / mine["seconds"],
                hf_tok_s=useful / theirs["seconds"],
                hf_padding_share=1 - useful / theirs["generated_tokens"],
                compiled_after_warmup=mine["compiled"])


def bf16_on_cpu(params) -> dict:
    """Why "auto" is float32 on CPU: the matmul chain per dtype plan, ms per step."""
    import jax
    import jax.numpy as jnp

    bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out = {}
    for batch in (1, 64):
        out[f"batch{batch}"] = dict(
            float32=1e3 * chain_seconds(params, batch, 5),
            bfloat16=1e3 * chain_seconds(bf, batch, 5),
            bf16_storage_fp32_compute=1e3 * chain_seconds(bf, batch, 5, jnp.float32))
    return out


def fresh_process() -> float:
    """Seconds for import + LLM() + one 64-token answer in a new process (second of two)."""
    times = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                             check=True)
        times.append(float(res.stdout.strip().splitlines()[-1]))
    return times[-1]


def vllm_peer(batch: int, tokens: int) -> float | None:
    """vLLM CPU's fp32 tok/s from `make peers`, if it measured this workload on this machine."""
    path = common.RESULTS / "peers_vllm.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    cfg = data.get("config", {})
    if cfg.get("batch") != batch or cfg.get("tokens") != tokens:
        return None  # another workload: not comparable
    return next((r.get("vllm_tok_s") for r in data.get("rows", [])
                 if r.get("dtype") == "float32"), None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    args = ap.parse_args(argv)
    q, default = args.quick, args.model == "smollm2"
    parts = load_model(args.model)
    parts = (parts[0], prepare_params(parts[1]), parts[2])
    hf_model, pad = hf.model("float32", args.model), parts[2].eos_token_ids[0]
    bandwidth = measure_bandwidth()
    res = dict(model=args.model, bandwidth_GBps=bandwidth / 1e9)
    res["batch64"] = batch64(parts, hf_model, pad, 8 if q else 64, 8 if q else 128, 1 if q else 2)
    res["batch1"] = batch1(parts, hf_model, pad, 8 if q else 64, bandwidth, 1 if q else 2)
    if default:  # the rest is the default model's story (README)
        res["sharegpt"] = sharegpt(parts, hf_model, pad, 8 if q else 200, 0.1, 64)
        res["fresh_process_s"] = None if q else fresh_process()
        res["bf16_chain_ms"] = bf16_on_cpu(parts[1])
        res["vllm_cpu_tok_s"] = vllm_peer(res["batch64"]["requests"], res["batch64"]["tokens"])
    path = common.save_json("bench_throughput" + ("" if default else f"_{args.model}"), res)
    print(report(res))
    print(f"saved {path}")
    return res


def report(res: dict) -> str:
    b64, b1 = res["batch64"], res["batch1"]
    rows = _rows(res) if "sharegpt" in res else [_rows(res)[0], *_rows(res)[2:5]]
    lines = ["| workload | paged-jax | peer | limit |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    if bf := res.get("bf16_chain_ms"):
        lines.append("\nmatmul chain per dtype plan, ms/step (batch 1 / batch 64): " + ", ".join(
            f"{k} {bf['batch1'][k]:.0f} / {bf['batch64'][k]:.0f}" for k in bf["batch1"]))
    lines.append(f"model {res.get('model', 'smollm2')}; measured copy bandwidth "
                 f"{res['bandwidth_GBps']:.1f} GB/s; batch-{b64['requests']} matmul chain "
                 f"{b64['chain_step_ms']:.0f} ms/step; greedy agreement with HF (first 16 "
                 f"tokens) {b64['agree_first16']}/{b64['requests']}; batch 1 bytes/token "
                 f"{b1['bytes_per_token'] / 1e6:.0f} MB")
    return "\n".join(lines)


def _rows(res: dict) -> list[tuple[str, ...]]:
    b64, b1, sg = res["batch64"], res["batch1"], res.get("sharegpt")
    vllm = res.get("vllm_cpu_tok_s")
    kind = "chat" if "sharegpt" in res else "plain-text"
    rows = [
        (f"batch {b64['requests']}: {b64['requests']} {kind} prompts x {b64['tokens']} tokens",
         f"{b64['paged_tok_s']:.0f} tok/s",
         f"HF generate() {b64['hf_tok_s']:.0f}: {b64['paged_tok_s'] / b64['hf_tok_s']:.2f}x",
         f"matmul chain {b64['ceiling_tok_s']:.0f}: "
         f"{b64['paged_tok_s'] / b64['ceiling_tok_s']:.0%}"),
        ("  vLLM CPU (make peers BATCH=64)", "",
         f"{vllm:.0f} tok/s: {b64['paged_tok_s'] / vllm:.2f}x" if vllm else "not measured here",
         ""),
        ("  host share of engine time", f"{b64['host_share']:.1%}", "", ""),
        ("  programs compiled after warm-up", str(b64["compiled_after_warmup"]), "", ""),
        (f"batch 1: LLM() defaults, {b1['tokens']} tokens", f"{b1['paged_tok_s']:.1f} tok/s",
         f"HF generate() {b1['hf_tok_s']:.1f}: {b1['paged_tok_s'] / b1['hf_tok_s']:.2f}x",
         f"bandwidth roofline {b1['roofline_tok_s']:.1f}: "
         f"{b1['paged_tok_s'] / b1['roofline_tok_s']:.0%}"),
    ]
    if sg:
        rows += [
            (f"ShareGPT-like, {sg['requests']} requests", f"{sg['paged_tok_s']:.0f} tok/s",
             f"HF static batches {sg['hf_tok_s']:.0f}: {sg['paged_tok_s'] / sg['hf_tok_s']:.2f}x",
             f"HF padding {sg['hf_padding_share']:.0%}"),
            ("fresh process: LLM() + 64-token answer",
             f"{res['fresh_process_s']:.1f} s" if res["fresh_process_s"] else "skipped", "", ""),
        ]
    return rows


if __name__ == "__main__":
    main()
