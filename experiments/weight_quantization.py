"""Weight-only quantization: float32, bfloat16, int8 and int4 weights on the paged engine,
beside llama.cpp on the same GGUF, in one run.

    python -m experiments.weight_quantization [--models smollm2 qwen2.5-coder-1.5b]
                                              [--batches 1 16 64] [--rounds 3] [--quick]

Sides per model (paged-jax with bench.py's limits, prefix caching off):
  float32    the C++ matmul kernel on float32 panels (the default on CPU)
  bfloat16   weights, activations and KV in bfloat16 (XLA's dot: the kernel is float32)
  int8       quantization="int8": int8 codes, a float16 scale per column and 32 inputs; a
             tensor whose every group of 32 lies on a 4-bit grid (the GGUF's Q4 tensors)
             keeps that grid as 4-bit codes with float16 scales and mins instead; on CPU
             activations as int8 codes per 32 too (W8A8 / W4A8, kernels/cpu_matmul.py)
  int4       quantization="int4": 4-bit codes per 32 inputs on each group's best 4-bit grid,
             its scale and min as 8-bit codes against float16 units per column and up to 8
             groups; activations as int8 codes per 32 (llama.cpp's Q8)
  llama.cpp  the GGUF's own tensor types and kernels (where `make peers` built it)

Per model and side: weight bytes per parameter (what the side holds; for llama.cpp the
GGUF's tensor data); decode tok/s per batch (chat prompts x 64 greedy tokens, EOS ignored;
every side once per round in a rotating order, median of the rounds +- spread), with the
batch-1 bandwidth roofline of the side's own bytes; perplexity of experiments/prompts.PASSAGE
(teacher-forced, one sequence); greedy agreement with float32 on 16 chat prompts x 32 tokens
(identical sequences, and each differing one's first differing position). Then the issue's
targets, each with its measured value. Writes results/weight_quantization.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys

import numpy as np

from experiments import bench, common
from experiments.prompts import PASSAGE, prompt_ids

QUANT = {"int8": dict(quantization="int8"), "int4": dict(quantization="int4")}
TOKENS, AGREE = 64, (16, 32)  # tokens per speed run; agreement prompts x tokens
DEFAULT_BATCHES = {"smollm2": [1, 16, 64], "qwen2.5-coder-1.5b": [1, 16]}
BF16_UP_TO = 1e9  # parameters: past this the bfloat16 side is left out (NO_BF16 says why)
NO_BF16 = ("left out above 1B parameters: on XLA:CPU it decodes at about a third of float32's "
           "speed (SmolLM2's rows), and its copy beside the other sides' brings this 24 GB "
           "machine close to its limit")


def make_sides(model: str, parts, bf16: bool) -> list:
    """Every side of one model (bfloat16 where `bf16`). The float32 side is built last, by
    packing `parts`' runtime-form weights in place: the 1.5B's 7 GB are then never held twice
    (with a packed copy beside them, the run was killed for memory)."""
    import jax
    import jax.numpy as jnp

    from kernels import cpu_matmul
    from paged_jax.models.llama import PROJECTIONS

    config, params, tok = parts
    sides = [bench.Ours(parts, False, name=q, **kw) for q, kw in QUANT.items()]
    if bf16:
        half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        sides.append(bench.Ours((config, half, tok), False, name="bfloat16", dtype="bfloat16"))
    peer = bench.make_sides(["llamacpp"], model, parts)
    for layer in params["layers"]:  # each float weight dropped as soon as it is packed
        for k in PROJECTIONS:
            if k in layer:  # a dense layer has no shared expert
                layer[k] = cpu_matmul.pack(layer[k])
    head = "lm_head" if "lm_head" in params else "embed"
    params[head] = cpu_matmul.pack(params[head])
    sides.insert(0, bench.Ours(parts, False, name="float32"))
    for s in peer:
        s.name = "llama.cpp"
    return sides + peer


def weight_bytes(side, model: str) -> tuple[int, int]:
    """(bytes a side holds for the model's weights, bytes it reads per decoded token): an
    untied embedding table is held but only its rows are read."""
    from paged_jax.study.metrics import weight_bytes as nbytes

    if isinstance(side, bench.Ours):
        params = side.llm.llm_engine.runner.params
        held = nbytes(params)
        return held, held - (nbytes(params["embed"]) if "lm_head" in params else 0)
    import gguf

    from paged_jax.models import model_path

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(model_path(model))).tensors}
    held = sum(tensors.values())
    return held, held - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def quantizes_x(side) -> bool:
    """Whether any of a side's packed weights has the kernel quantize its activations (x as
    int8 codes per 32 inputs: W8A8 / W4A8); never for a peer."""
    import jax

    from kernels.cpu_matmul import Packed

    if not isinstance(side, bench.Ours):
        return False
    leaves = jax.tree.leaves(side.llm.llm_engine.runner.params,
                             is_leaf=lambda x: isinstance(x, Packed))
    return any(isinstance(x, Packed) and x.quantize_x for x in leaves)


def perplexity(side, ids: list[int]) -> float:
    """exp(mean -log p) of each next token of `ids`, teacher-forced."""
    if isinstance(side, bench.Ours):
        from paged_jax import SamplingParams

        out = side.llm.generate([{"prompt_token_ids": ids}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0]
        nll = [-d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    else:
        nll = side.worker.call("score", ids=ids)["nll"]
    return float(np.exp(np.mean(nll)))


def agreement(runs: dict[str, list[list[int]]]) -> dict:
    """Per side, against float32's greedy tokens: identical sequences, first differences."""
    ref = runs["float32"]
    out = {}
    for name, toks in runs.items():
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                 for x, y in zip(toks, ref, strict=True)]
        out[name] = dict(identical=sum(f is None for f in first), of=len(ref),
                         first_difference=[f for f in first if f is not None])
    return out


def speed(sides: list, tok, batches: list[int], rounds: int) -> tuple[dict, dict]:
    """({row: {side: tok/s per round}}, {row: its prompts})."""
    rows = {f"batch {b}": (b, TOKENS, False) for b in batches}
    m = bench.measure(sides, rows, tok, rounds)
    return {r: {s: [n * t / x["seconds"] for x in runs] for s, runs in m["runs"][r].items()}
            for r, (n, t, _) in rows.items()}, m["work"]


def summarize(model: str, sides: list, config, n_params: int, measured: dict) -> dict:
    """One model's table: a row per side."""
    from paged_jax.study.metrics import kv_bytes_per_token, measure_bandwidth

    (tps, work), ppl, agree = measured["speed"], measured["ppl"], measured["agree"]
    bw, rows = measure_bandwidth(), []
    ctx = len(work["batch 1"][0]) + TOKENS / 2 if "batch 1" in work else 0
    kv = kv_bytes_per_token(config, np.float32) * ctx
    for s in sides:
        wb, read = measured["weights"][s.name]
        row = dict(side=s.name, settings=s.settings, weight_bytes=wb, bytes_read_per_token=read,
                   bytes_per_param=wb / n_params, perplexity=ppl[s.name], **agree[s.name],
                   activations_quantized=measured["quantized_x"][s.name])
        for r, by_side in tps.items():
            runs = by_side[s.name]
            row[r] = dict(tok_s=statistics.median(runs), spread=common.spread(runs), runs=runs,
                          vs_float32=common.compare(runs, by_side["float32"]))
        row["batch_1_roofline_tok_s"] = bw / (read + kv) if "batch 1" in tps else None
        rows.append(row)
    return dict(model=model, parameters=n_params, bandwidth_bytes_s=bw, sides=rows)


def run_model(model: str, batches: list[int], rounds: int) -> dict:
    import jax

    from paged_jax.models import load_model
    from paged_jax.models.llama import prepare_params

    config, params, tok = load_model(model)  # not serving.real_model: it keeps what it loads
    n_params = sum(x.size for x in jax.tree.leaves(params))
    # The runtime form once, shared: each side's own form is built from it without a copy
    # of the float32 weights per side (the 1.5B's are 6 GB).
    parts = (config, prepare_params(params), tok)
    del params
    sides = make_sides(model, parts, bf16=n_params <= BF16_UP_TO)
    del parts  # each side holds its own weights: the float32 ones would double the memory
    try:
        ids = tok.encode(PASSAGE)
        ppl = {s.name: perplexity(s, ids) for s in sides}
        prompts = prompt_ids(tok, AGREE[0])
        agree = agreement({s.name: s.run(prompts, AGREE[1])["tokens"] for s in sides})
        measured = dict(speed=speed(sides, tok, batches, rounds), ppl=ppl, agree=agree,
                        weights={s.name: weight_bytes(s, model) for s in sides},
                        quantized_x={s.name: quantizes_x(s) for s in sides})
        # (read before close: a side lets go of its engine there)
    finally:
        for s in sides:
            s.close()
    res = summarize(model, sides, config, n_params, measured)
    if n_params > BF16_UP_TO:
        res["left_out"] = {"bfloat16": NO_BF16}
    return res


def _side(res: dict, name: str) -> dict | None:
    return next((s for s in res["sides"] if s["side"] == name), None)


def _kept_codes(res: dict) -> bool:
    """Whether "int8" kept every tensor's own GGUF codes (the file's bytes a parameter) and
    multiplied float activations: its quality is then the float32 side's by construction (the
    float32 side is the file dequantized), so a quality target on it cannot fail. With its
    activations quantized (W4A8 on the kept codes, the CPU kernel's way) it can."""
    int8, gguf = _side(res, "int8"), _side(res, "llama.cpp")
    return bool(int8 and gguf and int8["bytes_per_param"] == gguf["bytes_per_param"]
                and not int8.get("activations_quantized", False))


def _quality(target: str, value: float, met: bool, cannot_fail: bool) -> dict:
    if cannot_fail:
        return dict(target=target, value=value, met=None,
                    verdict="cannot fail: int8 kept the file's own codes (lossless)")
    return dict(target=target, value=value, met=met, verdict="met" if met else "not met")


def targets(results: list[dict]) -> list[dict]:
    """The issue's targets on the largest model measured (speed, memory) and on each model
    (quality), each with its measured value and a verdict that can fail."""
    big = max(results, key=lambda r: r["parameters"])
    f32, out = _side(big, "float32"), []

    def speedup(name: str, bar: float, base: str) -> None:
        s, b = _side(big, name), _side(big, base)
        if s is None or b is None or "batch 1" not in s:
            return
        ours, theirs = s["batch 1"]["runs"], b["batch 1"]["runs"]
        v = common.target_verdict(common.round_ratios(ours, theirs), bar)  # the one rule
        out.append(dict(target=f"{big['model']} batch 1: {name} >= {bar}x {base}",
                        value=common.compare(ours, theirs)["ratio"], verdict=v["verdict"],
                        met=v["verdict"] == "met"))

    speedup("int8", 2.0, "float32")
    speedup("int4", 3.0, "float32")
    speedup("int4", 0.8, "llama.cpp")
    for res in results:
        int8 = _side(res, "int8")
        if "batch 64" in int8:
            f32_runs = _side(res, "float32")["batch 64"]["runs"]
            c = common.not_slower(int8["batch 64"]["runs"], f32_runs)
            out.append(dict(target=f"{res['model']} batch 64: int8 >= {common.NOT_SLOWER}x "
                                   "float32", value=int8["batch 64"]["vs_float32"]["ratio"],
                            verdict=c["verdict"], met=c["verdict"] == "met"))
        base = _side(res, "float32")["perplexity"]
        kept = _kept_codes(res)
        for name, bar in (("int8", 0.01), ("int4", 0.05)):
            change = _side(res, name)["perplexity"] / base - 1
            out.append(_quality(f"{res['model']} perplexity: {name} within {bar:.0%}",
                                change, abs(change) <= bar, kept and name == "int8"))
        out.append(_quality(f"{res['model']} greedy: int8 identical on >= 12 / 16",
                            int8["identical"], int8["identical"] >= 12, kept))
    for name, bar in (("int8", 0.27), ("int4", 0.15)):
        ratio = _side(big, name)["weight_bytes"] / f32["weight_bytes"]
        out.append(dict(target=f"{big['model']} weight bytes: {name} <= {bar}x float32",
                        value=ratio, met=ratio <= bar, verdict="met" if ratio <= bar else
                        "not met", bytes_per_param=_side(big, name)["bytes_per_param"]))
    return out


def report(results: list[dict], goals: list[dict]) -> str:
    lines = []
    for res in results:
        batches = [k for k in res["sides"][0] if k.startswith("batch ")]
        lines += [f"\n{res['model']} ({res['parameters'] / 1e6:.0f}M parameters)",
                  "| side | bytes/param | " + " | ".join(f"{b} tok/s (x float32)" for b in batches)
                  + " | batch 1 roofline | perplexity | greedy = float32 |",
                  "|---" * (5 + len(batches)) + "|"]
        for s in res["sides"]:
            cells = [f"{s[b]['tok_s']:.1f} +-{s[b]['spread']:.1f} "
                     f"({s[b]['vs_float32']['ratio']:.2f}x)" for b in batches]
            lines.append(f"| {s['side']} | {s['bytes_per_param']:.3f} | " + " | ".join(cells)
                         + f" | {s['batch_1_roofline_tok_s'] or 0:.0f} | {s['perplexity']:.3f}"
                         f" | {s['identical']} / {s['of']} |")
    lines.append("\nTargets:")
    lines += [f"  {g['verdict']}: {g['target']} (measured {g['value']:.3g})" for g in goals]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-1.5b"])
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="decode batches (default: 1 16 64 on SmolLM2, 1 16 on larger models)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="SmolLM2, batch 1, one round")
    a = ap.parse_args(argv)
    if a.quick:
        a.models, a.batches, a.rounds = ["smollm2"], [1], 1
    results = []
    spawn = multiprocessing.get_context("spawn")
    for m in a.models:  # each model in a process of its own: all its memory goes back after
        with spawn.Pool(1) as pool:
            results.append(pool.apply(run_model, (m, a.batches or DEFAULT_BATCHES.get(
                m, [1, 16]), a.rounds)))
    goals = targets(results)
    payload = dict(config=dict(models=a.models, rounds=a.rounds, tokens=TOKENS,
                               agreement=dict(prompts=AGREE[0], tokens=AGREE[1]),
                               limits=bench.LIMITS, greedy=True, ignore_eos=True),
                   models=results, targets=goals)
    payload["json"] = str(common.save_json(
        "weight_quantization" + ("_quick" if a.quick else ""), payload))
    print(report(results, goals))
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
