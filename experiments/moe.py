"""Mixture of experts: the grouped expert path against the dense all-experts one, the router's
load, and token-level routing beside request-level routing.

    python -m experiments.moe [--rounds 5] [--batch 16] [--tokens 48]

Model: random weights of a small MoE decoder (hidden 512, 4 layers, 8 query / 2 KV heads of
64, 8 experts of width 1024 in every layer, top 2, Mixtral's routing) over a byte
vocabulary: its experts hold 94% of its weights, as in real MoE models (Mixtral 8x7B: 97%),
so the expert path decides a step's time. No MoE checkpoint ships on PyPI; the tokens are
the random model's, checked equal across the paths.
Parts:
  decode   --batch greedy requests through LLM.generate, one LLM per expert path (grouped,
           dense, ragged_dot: config.moe_impl), built and warmed once, alternated round by
           round (common.rotated); output tok/s per path and the per-round speedup of
           grouped over dense against the issue's bar, (experts / top-k) / 2.
  layer    one MoE MLP alone on --batch tokens per path (median ms of 50 calls per round).
  load     tokens per expert per layer of every step of a batched greedy run (the forward's
           router_load through reference_loop.PagedLoop): imbalance = the busiest expert's
           tokens over the mean; experts a step touches. A random router spreads tokens
           evenly; a trained one need not.
  routing  token-level routing (MoE) beside request-level routing (experiments.routing):
           total and active parameters of real MoE shapes (Mixtral 8x7B, Qwen1.5-MoE-A2.7B,
           OLMoE-1B-7B), and the modeled GPU clock's decode seconds per token at batch 1, 8
           and 64 (an H200 roofline, fp16: 4.8 TB/s, 989 TFLOP/s; a step reads the experts
           its batch touches, expected under uniform routing) beside a dense model of the
           same total and of the same active parameters; results/routing.json's request-level
           costs beside them (paged_jax/study/moe_cost.py).
Writes results/moe.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import numpy as np

from experiments import common
from paged_jax.serve.metrics import compiles

SHAPE = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
             intermediate_size=1024)
IMPLS = ("grouped", "dense", "ragged_dot")


def model_parts(impl: str):
    from paged_jax.models.testing import byte_tokenizer, random_params, tiny_moe_config

    cfg = tiny_moe_config(**SHAPE, moe_impl=impl)
    return cfg, random_params(cfg, seed=0), byte_tokenizer()


def request_prompts(n: int) -> list[str]:
    return [f"request {i}: tell me about experts number {i % 7} and {i % 5}" for i in range(n)]


def warm(llms: dict, prompts: list[str], sp, most: int = 4) -> int:
    """Untimed passes until one builds no XLA program (at most `most`): the second pass over
    the same prompts hits the prefix cache, a shape the first did not run. Returns passes."""
    for i in range(most):
        before = compiles().count
        for llm in llms.values():
            llm.generate(prompts, sp, use_tqdm=False)
        if compiles().count == before:
            return i + 1
    return most


def decode(rounds: int, batch: int, tokens: int) -> dict:
    """Output tok/s of each expert path, alternated; tokens checked equal across paths."""
    from paged_jax import LLM, SamplingParams

    base = model_parts("grouped")
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = request_prompts(batch)
    llms = {impl: LLM(model_parts=(dataclasses.replace(base[0], moe_impl=impl), *base[1:]),
                      max_num_seqs=batch, max_model_len=256) for impl in IMPLS}
    outs = {impl: llm.generate(prompts, sp, use_tqdm=False) for impl, llm in llms.items()}
    ids = {impl: [o.outputs[0].token_ids for o in out] for impl, out in outs.items()}
    passes = warm(llms, prompts, sp)
    built = compiles().count
    runs = common.alternated({impl: functools.partial(
        llms[impl].generate, prompts, sp, use_tqdm=False) for impl in IMPLS}, rounds,
        batch * tokens)
    speedups = [g / d for g, d in zip(runs["grouped"], runs["dense"], strict=True)]
    bar = SHAPE["num_experts"] / SHAPE["num_experts_per_tok"] / 2
    return dict(batch=batch, tokens=tokens, rounds=rounds, warm_up_passes=passes,
                programs_built_timed=compiles().count - built,
                same_tokens=all(ids[impl] == ids["dense"] for impl in IMPLS),
                tok_s={impl: dict(median=statistics.median(v), spread=common.spread(v),
                                  runs=v) for impl, v in runs.items()},
                grouped_over_dense=common.target_verdict(speedups, bar),
                ragged_dot_vs_dense=common.compare(runs["ragged_dot"], runs["dense"]))


def layer(rounds: int, batch: int) -> dict:
    """Milliseconds of one MoE MLP on `batch` tokens per path."""
    import jax
    import jax.numpy as jnp

    from paged_jax.models import moe
    from paged_jax.models.llama import prepare_params

    cfg, params, _ = model_parts("grouped")
    p = prepare_params(params)["layers"][0]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, cfg.hidden_size)),
                    jnp.float32)
    valid = jnp.ones(batch, bool)
    def path(impl: str):
        c = dataclasses.replace(cfg, moe_impl=impl)
        return jax.jit(lambda p, x: moe.moe_block(p, x, c, valid)[0])
    fns = {impl: path(impl) for impl in IMPLS}
    ref = fns["dense"](p, x)
    err = {impl: float(jnp.abs(f(p, x) - ref).max()) for impl, f in fns.items()}
    runs: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(rounds):
        for impl in common.rotated(list(IMPLS), r):
            t0 = time.perf_counter()
            for _ in range(50):
                fns[impl](p, x).block_until_ready()
            runs[impl].append((time.perf_counter() - t0) / 50 * 1e3)
    return dict(tokens=batch, max_abs_diff_vs_dense=err,
                ms={impl: dict(median=statistics.median(v), spread=common.spread(v), runs=v)
                    for impl, v in runs.items()})


def load(batch: int, tokens: int) -> dict:
    """The router's tokens per expert, step by step, of a batched greedy run."""
    from paged_jax.models.reference_loop import paged_loop

    cfg, params, tok = model_parts("grouped")
    runner = paged_loop(cfg, params, num_seqs=batch, max_len=128, block_size=16)
    logits = runner.step([tok.encode(p) for p in request_prompts(batch)])
    loads = [runner.last_load]
    for _ in range(tokens - 1):  # greedy decode, one token per sequence per step
        logits = runner.step([[int(t)] for t in logits.argmax(-1)])
        loads.append(runner.last_load)
    arr = np.stack(loads)  # [steps, L, X]
    per = arr.astype(float)
    imbalance = per.max(-1) / per.mean(-1)
    k = cfg.num_experts_per_tok
    return dict(steps=len(loads), prefill_tokens=int(arr[0, 0].sum()) // k,
                tokens_per_expert_prefill=arr[0].tolist(),
                tokens_per_expert_decode_mean=per[1:].mean(0).tolist(),
                imbalance_prefill=float(imbalance[0].mean()),
                imbalance_decode_mean=float(imbalance[1:].mean()),
                imbalance_decode_max=float(imbalance[1:].max()),
                experts_touched_per_decode_step=float((arr[1:] > 0).sum(-1).mean()),
                conserved=bool(np.all(arr.sum(-1) == arr[:, :1].sum(-1))))


def routing() -> dict:
    """Token-level routing's active parameters and modeled costs (study/moe_cost.py) beside
    the request-level router's (results/routing.json): per request at the size of that
    experiment's requests when its file is there."""
    from paged_jax.study import moe_cost

    path = common.RESULTS / "routing.json"
    request, size = None, (128, 128)
    if path.is_file():
        r = json.loads(path.read_text())
        out = r["cost"]["output_tokens"]  # per model
        size = (round(r["cost"]["prompt_tokens"]), max(1, round(max(out.values()))))
        request = dict(models=r["models"], modeled_gpu_s_per_request=r["cost"]["modeled_gpu"],
                       cost_saved_at_95_modeled_gpu=r.get("cost_saved_at_95_modeled_gpu"),
                       source="results/routing.json", commit=r["provenance"]["commit"])
    return dict(gpu=moe_cost.H200, request_tokens=size, request_level=request,
                token_level={name: moe_cost.compare(shape, request=size)
                             for name, shape in moe_cost.REAL.items()})


def report(payload: dict) -> None:
    d = payload["decode"]
    print(f"decode, batch {d['batch']} x {d['tokens']} tokens, {d['rounds']} rounds "
          f"(same tokens on every path: {d['same_tokens']})")
    for impl, v in d["tok_s"].items():
        print(f"  {impl:10s} {v['median']:8.1f} tok/s  (spread {v['spread']:.1f})")
    g = d["grouped_over_dense"]
    print(f"  grouped / dense {g['median']:.2f}x, bar {g['target']:.1f}x: {g['verdict']}")
    for impl, v in payload["layer"]["ms"].items():
        print(f"  layer alone {impl:10s} {v['median']:.3f} ms")
    ld = payload["load"]
    print(f"load: imbalance prefill {ld['imbalance_prefill']:.2f}, decode mean "
          f"{ld['imbalance_decode_mean']:.2f} (max {ld['imbalance_decode_max']:.2f}); experts "
          f"touched per decode step {ld['experts_touched_per_decode_step']:.1f}")
    for name, m in payload["routing"]["token_level"].items():
        per = m["decode_s_per_token"]
        print(f"{name}: {m['total_params'] / 1e9:.1f}B total, {m['active_params'] / 1e9:.1f}B "
              f"active; MoE / dense of the same total per token at batch 1/8/64: "
              + " / ".join(f"{per[b]['moe_over_dense_same_total']:.2f}" for b in per))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    payload = dict(shape=SHAPE, decode=decode(args.rounds, args.batch, args.tokens),
                   layer=layer(args.rounds, args.batch), load=load(args.batch, args.tokens),
                   routing=routing())
    payload["targets"] = {f"grouped over dense at batch {args.batch}": dict(
        bar=payload["decode"]["grouped_over_dense"]["target"],
        speedup=payload["decode"]["grouped_over_dense"]["median"],
        verdict=payload["decode"]["grouped_over_dense"]["verdict"]
        if payload["decode"]["same_tokens"] else "tokens differ")}
    report(payload)
    payload["json"] = str(common.save_json("moe", payload))
    print(payload["json"])
    return payload


if __name__ == "__main__":
    main()
