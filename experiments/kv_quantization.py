"""KV-cache quantization on SmolLM2-135M: memory, quality and speed per kv_cache_dtype.

    python -m experiments.kv_quantization [--quick]

1. memory: blocks in a fixed KV budget, and the mean / peak number of sequences running when
   a burst of requests is served in it, per dtype (float32, bfloat16, int8, fp8);
2. quality against the float32 cache: greedy agreement on 16 chat prompts x 32 tokens (and
   the first position where each differs); teacher-forced on the float32 cache's tokens, the
   max |logit difference| and the mean KL(fp32 || dtype) per token; perplexity of a fixed
   text, prefilled in chunks of 64 tokens (each chunk reads the cache the ones before wrote);
3. speed: batch-64 generation tok/s per dtype on this machine (same requests, same engine
   shape; median of three rounds taken in turn);
4. the granularity check behind the design (a scale per 32 values of a token and KV head,
   per token, or per block);
5. the seed's claim: "INT8 KV halves memory vs 16-bit with negligible quality loss", and the
   issue's targets, each with its measured value.
Writes results/kv_quantization.json.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from experiments import common
from experiments.common import pyplot, save_json, save_plot, table
from experiments.prompts import chat_ids
from paged_jax import LLM, SamplingParams
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.kv_cache import gather_sequence, kv_cache_bytes
from paged_jax.cache.kv_quant import measure_granularity, storage_dtype
from paged_jax.models import load_model
from paged_jax.models.reference_loop import PagedLoop
from paged_jax.study.workloads import TEXT

BLOCK = 16
DTYPES = ("float32", "bfloat16", "int8", "fp8")


SHAPE = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512,
             enable_prefix_caching=False)  # one engine shape for every run here; LLM's
# default scheduling (async: a decode_window would turn it off, LLM refuses both at once)


def memory(parts, budget: int, requests: int, prompt: int, out: int) -> list[dict]:
    """Blocks in `budget` bytes and the batch a burst of requests gets, per dtype."""
    config, _, tok = parts
    ids = [(tok.encode(TEXT) * 8)[i:i + prompt] for i in range(requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    rows = []
    for name in DTYPES:
        llm = LLM(model_parts=parts, kv_cache_memory=budget, kv_cache_dtype=name, **SHAPE)
        llm.llm_engine.recorder = steps = []
        llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False)
        run = [s.running for s in steps if s.num_steps]
        rows.append(dict(dtype=name, blocks=llm.engine_config.num_kv_blocks - 1,
                         bytes_per_block=kv_cache_bytes(config.num_layers, config.num_kv_heads,
                                                        BLOCK, config.head_dim,
                                                        storage_dtype(name, np.float32)),
                         mean_running=float(np.mean(run)), peak_running=int(max(run))))
    return rows


def agreement(llms: dict, prompts: list[list[int]], tokens: int) -> tuple[list[dict], list]:
    """Greedy tokens per dtype vs the float32 cache's."""
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = {}
    for name, llm in llms.items():
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        outs[name] = [r.outputs[0].token_ids for r in res]
    rows = []
    for name in DTYPES:
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                 for x, y in zip(outs[name], outs["float32"], strict=True)]
        rows.append(dict(dtype=name, identical=sum(f is None for f in first),
                         prompts=len(prompts), first_divergence=[f for f in first if f]))
    return rows, outs["float32"]


def logits_and_ppl(parts, prompts, fp32_tokens, chunk: int = 64) -> list[dict]:
    """Teacher-forced logit error / KL on the fp32 cache's tokens; perplexity of TEXT."""
    config, params, tok = parts
    text = tok.encode(TEXT * 3)[:512]
    runs = {name: _forced(parts, name, prompts, fp32_tokens) for name in DTYPES}
    rows = []
    for name in DTYPES:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(runs[name], runs["float32"],
                                                                  strict=True))
        kl = np.mean([_kl(b, a) for a, b in zip(runs[name], runs["float32"], strict=True)])
        rows.append(dict(dtype=name, max_abs_logit_diff=diff, mean_kl=float(kl),
                         perplexity=_perplexity(config, params, name, text, chunk)))
    return rows


def _forced(parts, name, prompts, outs) -> list[np.ndarray]:
    """Logits after every generated position, feeding the given tokens, one sequence each."""
    config, params, _ = parts
    res = []
    for p, o in zip(prompts, outs, strict=True):
        n = len(p) + len(o)
        r = PagedLoop(config, params, CacheConfig(-(-n // BLOCK) + 2, BLOCK, 1, -(-n // BLOCK) + 1),
                   backend="reference", kv_dtype=name)
        steps = [r.step([p])[0]] + [r.step([[t]])[0] for t in o[:-1]]
        res.append(np.stack(steps))
    return res


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp = p_logits - np.logaddexp.reduce(p_logits, -1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, -1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _perplexity(config, params, name, ids, chunk) -> float:
    r = PagedLoop(config, params, CacheConfig(-(-len(ids) // BLOCK) + 2, BLOCK, 1,
                                           -(-len(ids) // BLOCK) + 1),
               backend="reference", kv_dtype=name)
    nll = []
    for a in range(0, len(ids) - 1, chunk):
        piece = ids[a:a + chunk]
        logits = r.step([piece], all_logits=True)
        lp = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
        nxt = ids[a + 1:a + 1 + len(piece)]
        nll += [-lp[i, t] for i, t in enumerate(nxt)]
    return float(np.exp(np.mean(nll)))


def speed(llms: dict, tok, batch: int, tokens: int, repeats: int = 3) -> list[dict]:
    """Batch-`batch` generation tok/s per dtype: a warm-up run each (no compile timed), then
    `repeats` rounds that take the dtypes in turn, so slow spells of a shared machine hit
    every dtype alike; the median is reported."""
    ids = chat_ids(tok, 2 * batch)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    runs = {name: [] for name in llms}
    for llm in llms.values():
        llm.generate([{"prompt_token_ids": p} for p in ids[batch:]], sp, use_tqdm=False)
    for _ in range(repeats):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in ids[:batch]], sp, use_tqdm=False)
            runs[name].append(batch * tokens / (time.perf_counter() - t0))
    return [dict(dtype=name, backend=llm.llm_engine.runner.cfg.backend,
                 tok_s=float(np.median(runs[name])), runs=[round(x, 1) for x in runs[name]])
            for name, llm in llms.items()]


def granularity(parts, tokens: int = 256) -> list[dict]:
    """Scales per group, token or block on real K/V (paged_jax/kv_quant.measure_granularity),
    the sequence's own keys as queries (a proxy: the runner does not expose queries)."""
    config, params, tok = parts
    ids = (tok.encode(TEXT) * 8)[:tokens]
    runner = PagedLoop(config, params, CacheConfig(tokens // BLOCK + 2, BLOCK, 1,
                                                tokens // BLOCK + 1))
    runner.step([ids])
    per_layer = []
    for layer in range(config.num_layers):
        k, v = (np.asarray(x) for x in gather_sequence(runner.cache, layer, runner.table, 0))
        q = np.repeat(k, config.num_heads // config.num_kv_heads, axis=1)
        per_layer.append(measure_granularity(k, v, q, BLOCK))
    rows = []
    for i, row in enumerate(per_layer[0]):
        vals = [layer[i] for layer in per_layer]
        rows.append({"dtype": row["dtype"], "granularity": row["granularity"],
                     **{m: float(np.mean([x[m] for x in vals]))
                        for m in ("k_rel_err", "v_rel_err", "attn_rel_err")}})
    return rows


def claim(mem: list[dict], agree: list[dict], quality: list[dict]) -> dict:
    by = {r["dtype"]: r for r in mem}
    q = {r["dtype"]: r for r in quality}
    a = {r["dtype"]: r for r in agree}
    ratio = by["bfloat16"]["bytes_per_block"] / by["int8"]["bytes_per_block"]
    ppl = q["int8"]["perplexity"] / q["float32"]["perplexity"] - 1
    return dict(int8_vs_16bit_bytes=ratio, int8_identical=a["int8"]["identical"],
                int8_perplexity_change=ppl,
                holds=bool(ratio >= 1.8 and abs(ppl) < 0.01
                           and a["int8"]["identical"] >= 0.75 * a["int8"]["prompts"]))


def plot(res: dict, name: str):
    """Blocks in the budget, greedy agreement, KL to float32 and speed, per dtype."""
    plt = pyplot()
    fig, ax = plt.subplots(1, 4, figsize=(15, 3.2))
    panels = [("memory", "blocks", "blocks in the KV budget"),
              ("agreement", "identical", "prompts identical to float32"),
              ("quality", "mean_kl", "mean KL(float32 || dtype)"),
              ("speed", "tok_s", "generation tok/s")]
    for a, (key, col, title) in zip(ax, panels, strict=True):
        rows = res[key]
        a.bar([r["dtype"] for r in rows], [r[col] for r in rows])
        a.set_title(title, fontsize=10)
        a.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return save_plot(name, fig)


def targets(res: dict) -> list[dict]:
    """The issue's targets, each with the measured value."""
    mem = {r["dtype"]: r for r in res["memory"]}
    agree = {r["dtype"]: r for r in res["agreement"]}
    q = {r["dtype"]: r for r in res["quality"]}
    runs = {r["dtype"]: r["runs"] for r in res["speed"]}
    ratio = min(mem[d]["blocks"] for d in ("int8", "fp8")) / mem["float32"]["blocks"]
    ppl = q["int8"]["perplexity"] / q["float32"]["perplexity"] - 1
    return [
        dict(target="int8 / fp8 blocks >= 3.5x float32", measured=f"{ratio:.2f}x",
             met=ratio >= 3.5),
        dict(target="int8 greedy identical on >= 75% of prompts",
             measured=f"{agree['int8']['identical']} / {agree['int8']['prompts']}",
             met=agree["int8"]["identical"] >= 0.75 * agree["int8"]["prompts"]),
        dict(target="int8 perplexity within 1% of float32", measured=f"{ppl:+.3%}",
             met=abs(ppl) <= 0.01),
        speed_target(runs["int8"], runs["float32"]),
    ]


def speed_target(int8: list[float], fp32: list[float]) -> dict:
    """int8 not slower than float32: met when int8's median is at least float32's, unless
    the difference is inside the rounds' spread (then the two are not separable)."""
    cmp = common.compare(int8, fp32)
    met = ("not separable" if cmp["verdict"] == "not separable"
           else "met" if cmp["verdict"] == "higher" else "not met")
    return dict(target="int8 decode not slower than float32 (medians of rounds)",
                measured=f"{cmp['ours']:.0f} vs {cmp['theirs']:.0f} tok/s "
                         f"(spread {cmp['spread']:.0f})", met=met)


def main(argv: list[str] | None = None, name: str = "kv_quantization") -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    q = ap.parse_args(argv).quick
    parts = load_model()
    prompts = chat_ids(parts[2], 4 if q else 16)
    # fp32 holds about a quarter of the burst in 96 MiB (SmolLM2: 737 KiB per fp32 block).
    res = dict(memory=memory(parts, 24 << 20 if q else 96 << 20, 8 if q else 64, 64, 64))
    _show(res, "memory")
    llms = {d: LLM(model_parts=parts, kv_cache_dtype=d, **SHAPE) for d in DTYPES}
    res["agreement"], fp32 = agreement(llms, prompts, 8 if q else 32)
    _show(res, "agreement")
    res["quality"] = logits_and_ppl(parts, prompts[:2] if q else prompts[:4],
                                    fp32[:2] if q else fp32[:4])
    _show(res, "quality")
    res["speed"] = speed(llms, parts[2], 8 if q else 64, 8 if q else 64)
    _show(res, "speed")
    res["granularity"] = granularity(parts, 64 if q else 256)
    _show(res, "granularity")
    res["claim"] = claim(res["memory"], res["agreement"], res["quality"])
    res["targets"] = targets(res)
    _show(res, "targets")
    res["png"] = str(plot(res, name))
    res["json"] = str(save_json(name, res))
    print("\nclaim:", res["claim"])
    return res


COLUMNS = dict(memory=["dtype", "blocks", "bytes_per_block", "mean_running", "peak_running"],
               agreement=["dtype", "identical", "prompts", "first_divergence"],
               quality=["dtype", "max_abs_logit_diff", "mean_kl", "perplexity"],
               speed=["dtype", "backend", "tok_s", "runs"],
               targets=["target", "measured", "met"],
               granularity=["dtype", "granularity", "k_rel_err", "v_rel_err", "attn_rel_err"])


def _show(res: dict, key: str) -> None:
    """Prints one section as soon as it is measured (a full run takes long on a CPU)."""
    print(f"\n{key}\n" + table(res[key], COLUMNS[key]), flush=True)


if __name__ == "__main__":
    main()
