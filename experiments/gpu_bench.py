"""One GPU, one command (`make gpu-bench`): the paper's batching policies and MoE, < 5 min.

    PYTHONPATH=. python3 -m experiments.gpu_bench [--out DIR] [--budget-s 270] [--dry-run]

(The kernels, checked and timed, and the engine's roofline and token checks are
`make gpu-check`: experiments/gpu_check.py.)
1. the device's copy bandwidth (kernels/gpu_timing.py);
2. the engine (Pallas backend): a Llama-3.2-1B-shaped model with random bf16 weights (no
   checkpoint), ShareGPT-like requests all arriving at once; output tok/s and mean batch for
   paged KV vs static batching vs Orca-style max reservation under the same KV pool; and the
   decode step at batch 64 vs its roofline (weights + cached K/V bytes / copy bandwidth).
3. one mixture-of-experts MLP of OLMoE-1B-7B's shape (hidden 2048, 64 experts of 1024, top
   8), random bf16 weights: ms per expert path (models/moe.py: grouped, dense, ragged_dot)
   at 1, 16 and 256 tokens, and grouped over dense.

Writes gpu_bench.json and gpu_bench.png (when matplotlib imports) to --out ($OUT, else
results/). Without a GPU it prints the plan and exits with status 2. Needs only jax, numpy
and jaxtyping (the GPU machine's own python3): no tokenizer, no checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
                eos_token_ids=(128001,))  # Llama-3.2-1B's shapes; llama3 RoPE scaling left out
ENGINE = dict(block_size=16, num_kv_blocks=4097, max_num_seqs=128, max_num_batched_tokens=2048,
              max_model_len=2048, decode_window=16, enable_prefix_caching=False)
WORKLOAD = dict(dataset="sharegpt", requests=96, scale=0.5, seed=0)
POLICIES = ("paged", "orca-max", "static")
DECODE = dict(batch=64, prompt=512, tokens=128)  # the decode-step roofline point
OLMOE_MLP = dict(hidden_size=2048, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=1024)  # OLMoE-1B-7B's MLP
MOE_TOKENS = (1, 16, 256)


@dataclasses.dataclass
class Plan:
    """What a run will do: model, engine, workload, policies, time budgets."""

    model: dict
    engine: dict
    workload: dict
    policies: tuple[str, ...]
    decode: dict
    engine_budget_s: float
    moe_budget_s: float = 0.0

    def describe(self) -> str:
        m = self.model
        return (f"engine: {m['num_layers']} layers, hidden {m['hidden_size']}, heads "
                f"{m['num_heads']}/{m['num_kv_heads']} x {m['head_dim']}, vocab "
                f"{m['vocab_size']}; pool {self.engine['num_kv_blocks'] - 1} blocks of "
                f"{self.engine['block_size']}; {self.workload['requests']} "
                f"{self.workload['dataset']}-like requests (scale {self.workload['scale']}); "
                f"policies {', '.join(self.policies)}; decode roofline at batch "
                f"{self.decode['batch']}, context {self.decode['prompt']}; budgets: engine "
                f"{self.engine_budget_s:.0f} s, MoE {self.moe_budget_s:.0f} s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--budget-s", type=float, default=270.0, help="whole run, MoE 15%%")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, touch no device")
    return ap.parse_args(argv)


def make_plan(budget_s: float, model: dict | None = None, engine: dict | None = None,
              workload: dict | None = None, decode: dict | None = None) -> Plan:
    return Plan(model or LLAMA_1B, engine or ENGINE, workload or WORKLOAD, POLICIES,
                decode or DECODE, 0.85 * budget_s, 0.15 * budget_s)


# ------------------------------------------------------------------------------- the engine
def random_model(model: dict, dtype="bfloat16", seed: int = 0):
    """(ModelConfig, params) with Gaussian weights drawn on the device, in the layout of
    models.params.build_params (layer weights stacked [L, in, out])."""
    import jax
    import jax.numpy as jnp

    from paged_jax.models.config import ModelConfig
    from paged_jax.models.params import LAYER_WEIGHTS, expected_shapes

    config = ModelConfig(**model)
    shapes, dt = expected_shapes(config), jnp.dtype(dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

    def weight(shape, stack=True):
        out_dim, in_dim = shape
        full = (config.num_layers, in_dim, out_dim) if stack else (out_dim, in_dim)
        return (jax.random.normal(next(keys), full, jnp.float32) * in_dim**-0.5).astype(dt)

    ones = lambda n: jnp.ones((config.num_layers, n), dt)  # noqa: E731
    layers = {b: weight(shapes[b]) for b in LAYER_WEIGHTS}
    layers |= {"attn_norm": ones(config.hidden_size), "mlp_norm": ones(config.hidden_size)}
    params = {"embed": weight(shapes["embed"], stack=False),
              "final_norm": jnp.ones((config.hidden_size,), dt), "layers": layers}
    if not config.tie_word_embeddings:
        params["lm_head"] = weight(shapes["lm_head"], stack=False)
    return config, params


def engine_for(config, params, engine: dict, policy: str, backend: str | None = None):
    """An Engine without a tokenizer (token-id prompts, detokenize=False)."""
    from paged_jax.engine import Engine, EngineConfig
    from paged_jax.study.reservation import policy_for

    ec = EngineConfig(**engine, backend=backend)
    return Engine(config, params, None, ec, policy=policy_for(policy, ec))


def workload_items(plan: Plan):
    from paged_jax.study.workloads import make_workload

    w = plan.workload
    return make_workload(w["dataset"], w["requests"], float("inf"), None, w["seed"], w["scale"],
                         plan.engine["max_model_len"])


def serve(eng, items, deadline: float) -> dict:
    """All items at once, greedy, exactly their output lengths; stops at `deadline`."""
    from paged_jax.sampling_params import SamplingParams

    for w in items:
        eng.add_request(w.request_id, {"prompt_token_ids": w.prompt_token_ids},
                        SamplingParams(temperature=0.0, max_tokens=w.output_len,
                                       ignore_eos=True, detokenize=False))
    t0, tokens, done = time.perf_counter(), 0, 0
    eng.recorder = steps = []
    while eng.has_unfinished() and time.perf_counter() < deadline:
        for out in eng.step():
            if out.finished:
                done += 1
                tokens += sum(len(c.token_ids) for c in out.outputs)
    wall = time.perf_counter() - t0
    busy = [(s.duration, s.running) for s in steps if s.num_steps]
    total = sum(d for d, _ in busy)
    return dict(finished=done, requests=len(items), output_tokens=tokens, wall_s=wall,
                output_tokens_per_s=tokens / wall if wall else 0.0,
                mean_batch=sum(d * r for d, r in busy) / total if total else 0.0,
                # per step, not per second: a shared CPU's noise moves step durations, not batches
                mean_batch_per_step=sum(r for _, r in busy) / len(busy) if busy else 0.0,
                complete=not eng.has_unfinished())


def decode_roofline(config, params, plan: Plan, bandwidth: float, deadline: float) -> dict:
    """Decode step time at batch B and context C vs (weight + K/V bytes) / copy bandwidth."""
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.study.metrics import kv_bytes_per_token, streamed_weight_bytes

    d = plan.decode
    sp = SamplingParams(temperature=0.0, max_tokens=d["tokens"], ignore_eos=True,
                        detokenize=False)
    for _ in range(2):  # the first pass compiles every program the second one runs
        eng = engine_for(config, params, plan.engine, "paged")
        eng.recorder = steps = []
        for i in range(d["batch"]):
            ids = [1 + (i + j) % 250 for j in range(d["prompt"])]
            eng.add_request(f"d{i}", {"prompt_token_ids": ids}, sp)
        while eng.has_unfinished() and time.perf_counter() < deadline:
            eng.step()
    full = [s for s in steps if s.kind == "window" and s.running == d["batch"]]
    if not full or eng.has_unfinished():
        return dict(error="the measured pass did not finish before the deadline")
    step = sum(s.duration for s in full) / sum(s.num_steps for s in full)
    ctx = d["prompt"] + d["tokens"] / 2
    moved = streamed_weight_bytes(params) + d["batch"] * ctx * kv_bytes_per_token(
        config, eng.state.cache.dtype)
    return dict(batch=d["batch"], context=ctx, step_ms=step * 1e3,
                roofline_ms=moved / bandwidth * 1e3, ratio=step * bandwidth / moved)


def run_engine(plan: Plan, bandwidth: float, budget_s: float, backend: str | None = None
               ) -> dict:
    """Section 2: every policy on the same workload and pool, then the decode roofline."""
    from paged_jax.study.workloads import describe

    t0 = time.perf_counter()
    config, params = random_model(plan.model)
    items = workload_items(plan)
    per = budget_s / (len(plan.policies) + 1)
    rows = []
    for i, policy in enumerate(plan.policies):
        # A first pass compiles the policy's shapes (in-process jit cache); the second is timed.
        deadline = t0 + per * (i + 1)
        serve(engine_for(config, params, plan.engine, policy, backend), items, deadline)
        eng = engine_for(config, params, plan.engine, policy, backend)
        rows.append(dict(policy=policy, **serve(eng, items, deadline)))
        print(f"engine {policy:9} {rows[-1]}", flush=True)
    roof = decode_roofline(config, params, plan, bandwidth, t0 + budget_s)
    print(f"decode roofline {roof}", flush=True)
    return dict(policies=rows, decode=roof, workload=describe(items))


# ------------------------------------------------------------------------------- MoE
def moe_mlp(budget_s: float, shape: dict = OLMOE_MLP, tokens: tuple[int, ...] = MOE_TOKENS,
            dtype: str = "bfloat16") -> dict:
    """Section 3: one MoE MLP (random weights drawn on the device) per expert path and token
    count: median ms of 10 calls after a compiling one; paths left out past the budget."""
    import jax
    import jax.numpy as jnp

    from paged_jax.models import moe
    from paged_jax.models.testing import tiny_moe_config

    cfg, dt, deadline = tiny_moe_config(**shape), jnp.dtype(dtype), time.perf_counter() + budget_s
    e, x, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 8))
    draw = lambda *s: (jax.random.normal(next(keys), s) * s[-1] ** -0.5).astype(dt)  # noqa: E731
    p = {"router": draw(x, e), "e_gate_up": draw(x, 2 * f, e), "e_down": draw(x, e, f)}
    rows = []
    for t in tokens:
        h = draw(t, e)
        for impl in moe.IMPLS:
            if time.perf_counter() > deadline:
                rows.append(dict(tokens=t, impl=impl, skipped="budget"))
                continue
            c = dataclasses.replace(cfg, moe_impl=impl)
            fn = jax.jit(lambda p, h, c=c: moe.moe_block(p, h, c, jnp.ones(h.shape[0], bool))[0])
            fn(p, h).block_until_ready()
            ms = []
            for _ in range(10):
                t0 = time.perf_counter()
                fn(p, h).block_until_ready()
                ms.append(1e3 * (time.perf_counter() - t0))
            rows.append(dict(tokens=t, impl=impl, ms=sorted(ms)[5]))
            print(f"moe {t:4d} tokens {impl:10s} {rows[-1]['ms']:.3f} ms", flush=True)
    ms = {(r["tokens"], r["impl"]): r["ms"] for r in rows if "ms" in r}
    speed = {str(t): ms[(t, "dense")] / ms[(t, "grouped")] for t in tokens
             if (t, "dense") in ms and (t, "grouped") in ms}
    return dict(shape=shape, dtype=dtype, rows=rows, grouped_over_dense=speed)


# ------------------------------------------------------------------------------- output
def write(result: dict, out: Path) -> list[Path]:
    """gpu_bench.json, and gpu_bench.png when matplotlib is there."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "gpu_bench.json"]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return paths
    fig, ax_e = plt.subplots(figsize=(6, 4))
    rows = result.get("engine", {}).get("policies", [])
    ax_e.bar([r["policy"] for r in rows], [r["output_tokens_per_s"] for r in rows])
    ax_e.set(ylabel="output tok/s", title="engine, ShareGPT-like, same KV pool")
    fig.tight_layout()
    fig.savefig(out / "gpu_bench.png", dpi=120)
    plt.close(fig)
    return paths + [out / "gpu_bench.png"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args.budget_s)
    print("gpu-bench plan:", plan.describe())
    from kernels.gpu_check import has_gpu
    from kernels.gpu_timing import copy_bandwidth

    if args.dry_run:
        return 0
    if not has_gpu():
        print("gpu_bench: no GPU visible to JAX (jax.devices('gpu') is empty); nothing to run. "
              "Run `make gpu-bench` on a CUDA machine.", file=sys.stderr)
        return 2
    import jax

    copy = copy_bandwidth()
    bandwidth = copy["gbps"] * 1e9
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  plan=dataclasses.asdict(plan), copy=copy)
    try:
        result["engine"] = run_engine(plan, bandwidth, plan.engine_budget_s)
    except Exception as e:  # keep the kernel numbers whatever happens to the engine
        result["engine"] = dict(error=f"{type(e).__name__}: {e}"[:500])
    try:
        result["moe"] = moe_mlp(plan.moe_budget_s)
    except Exception as e:
        result["moe"] = dict(error=f"{type(e).__name__}: {e}"[:500])
    for p in write(result, Path(args.out)):
        print("wrote", p)
    return 0 if "error" not in result["engine"] else 1


if __name__ == "__main__":
    sys.exit(main())
