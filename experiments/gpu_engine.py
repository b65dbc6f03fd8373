"""The engine half of `make gpu-check`: a Llama-3.2-1B-shaped model (random weights of its real
shapes, no checkpoint) served by the engine on the Pallas kernels of one GPU.

    agreement   greedy tokens of 8 requests (prompts of 5 to 511 tokens, so chunked prefill,
                page boundaries and decode all run) from the Pallas backends against the
                reference attention backend (jnp) on the same weights: float32 must agree
                token for token; in bfloat16 a one-ulp difference in an attention output can
                flip a near-tie of random logits, so the agreement is reported, and Triton is
                compared with Mosaic GPU as well
    batch 1     one request decoding: the step time against its bandwidth roofline (the bf16
                weights and the cached K/V read once a token, over the measured copy
                bandwidth)
    batch 64    64 requests of 512 prompt tokens and 128 output tokens: output tok/s with the
                prefills, and the decode step at batch 64 against its roofline

Every timed pass runs after a pass of the same shapes (which compiles its programs).
Needs only jax, numpy and jaxtyping.
"""

from __future__ import annotations

import os
import statistics
import time

from experiments.gpu_bench import LLAMA_1B, engine_for, random_model

AGREE = dict(block_size=16, num_kv_blocks=8 * 40 + 1, max_num_seqs=8,
             max_num_batched_tokens=512, max_model_len=640, decode_window=8,
             enable_prefix_caching=False, static_shapes=True)
AGREE_PROMPTS = (5, 16, 17, 64, 100, 255, 300, 511)
AGREE_TOKENS = 24
B1 = dict(block_size=16, num_kv_blocks=65, max_num_seqs=1, max_num_batched_tokens=256,
          max_model_len=1024, decode_window=16, enable_prefix_caching=False)
B1_RUN = dict(prompt=128, tokens=384)
B64 = dict(block_size=16, num_kv_blocks=64 * 40 + 1, max_num_seqs=64,
           max_num_batched_tokens=2048, max_model_len=640, decode_window=16,
           enable_prefix_caching=False)
B64_RUN = dict(prompt=512, tokens=128)
B64_BATCH = 64
MODEL = LLAMA_1B


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """A deterministic prompt of n token ids."""
    return [1 + (seed * 7919 + j * 104729) % (vocab - 2) for j in range(n)]


def generate(eng, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (all queued at once) and the wall time."""
    from paged_jax.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        detokenize=False)
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": ids}, sp)
    done, t0 = {}, time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))], time.perf_counter() - t0


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token agreement of two runs: equal sequences, equal tokens, first divergences."""
    first = [next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None)
             for s, t in zip(a, b, strict=True)]
    same = sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True))
    return dict(sequences_equal=sum(f is None for f in first), sequences=len(a),
                tokens_equal=same, tokens=sum(len(s) for s in a), first_divergence=first)


def agreement(config, params, backends: tuple[str, ...], log=print) -> dict:
    """Each backend's greedy tokens on the AGREE engine, compared with the first one's."""
    prompts = [prompt_ids(n, i, config.vocab_size) for i, n in enumerate(AGREE_PROMPTS)]
    runs, out = {}, {}
    for backend in backends:
        t0 = time.perf_counter()
        try:
            runs[backend], wall = generate(engine_for(config, params, AGREE, "paged", backend),
                                           prompts, AGREE_TOKENS)
        except Exception as e:  # a backend that fails is a failed comparison, reported
            out[backend] = dict(error=f"{type(e).__name__}: {e}"[:500])
            log(f"agreement {backend}: {out[backend]['error']}")
            continue
        out[backend] = dict(wall_s=time.perf_counter() - t0, run_s=wall)
    base = backends[0]
    for backend in backends[1:]:
        if base in runs and backend in runs:
            out[backend] |= compare(runs[base], runs[backend])
            log(f"agreement {backend} vs {base}: {out[backend]['sequences_equal']}/"
                f"{out[backend]['sequences']} sequences, {out[backend]['tokens_equal']}/"
                f"{out[backend]['tokens']} tokens")
    return dict(reference=base, prompts=list(AGREE_PROMPTS), tokens_each=AGREE_TOKENS,
                backends=out)


def _timed_pass(config, params, ec: dict, backend: str, run: dict, batch: int) -> dict:
    """A compiling pass, then a timed one: wall, output tokens, window steps at full batch."""
    prompts = [prompt_ids(run["prompt"], i, config.vocab_size) for i in range(batch)]
    t0 = time.perf_counter()
    generate(engine_for(config, params, ec, "paged", backend), prompts, run["tokens"])
    warm = time.perf_counter() - t0
    eng = engine_for(config, params, ec, "paged", backend)
    eng.recorder = steps = []
    toks, wall = generate(eng, prompts, run["tokens"])
    windows = [s for s in steps if s.kind == "window" and s.running == batch and s.num_steps]
    return dict(warm_pass_s=warm, wall_s=wall, output_tokens=sum(map(len, toks)),
                windows=[(s.duration, s.num_steps) for s in windows], engine=eng)


def decode_roofline(config, params, ec: dict, backend: str, run: dict, batch: int,
                    bandwidth: float) -> dict:
    """Step time of the decode windows at `batch` rows against (weights + the K/V of the
    batch's mean context) / bandwidth; per-window ratios give the spread."""
    from paged_jax.study.metrics import kv_bytes_per_token, weight_bytes

    res = _timed_pass(config, params, ec, backend, run, batch)
    eng = res.pop("engine")
    wins = res.pop("windows")[1:]  # the first window after the prefills may pay a transfer
    if not wins:
        return res | dict(error="no decode window ran at full batch")
    ctx = run["prompt"] + run["tokens"] / 2
    kv = batch * ctx * kv_bytes_per_token(config, eng.state.cache.dtype)
    roof = (weight_bytes(params) + kv) / bandwidth
    per = [roof / (d / n) for d, n in wins]  # share of the roofline, per window
    step = sum(d for d, _ in wins) / sum(n for _, n in wins)
    return res | dict(
        batch=batch, context=ctx, step_ms=step * 1e3, roofline_ms=roof * 1e3,
        share=statistics.median(per), share_spread=(max(per) - min(per)) / 2,
        share_per_window=per, output_tok_s=res["output_tokens"] / res["wall_s"],
        weight_bytes=weight_bytes(params), kv_bytes=kv)


def run_engine(bandwidth: float, parts: tuple[str, ...], deadline: float, log=print,
               model: dict | None = None, on_part=None) -> dict:
    """The named parts ("agree_f32", "agree_bf16", "batch1", "batch64", each optionally
    ":backend") in order until the deadline; a part that fails records its error."""
    import jax.numpy as jnp

    model = model or MODEL
    config, params = random_model(model, "bfloat16")
    f32 = None
    out = dict(model=dict(model), parts={})
    for part in parts:
        if time.perf_counter() > deadline:
            out["parts"][part] = dict(skipped="time budget")
            continue
        name, _, backend = part.partition(":")
        backend = backend or "pallas"
        t0 = time.perf_counter()
        try:
            if name == "agree_f32":
                f32 = f32 or __import__("jax").tree.map(lambda x: x.astype(jnp.float32), params)
                res = agreement(config, f32, ("reference", backend), log)
            elif name == "agree_bf16":
                mosaic = () if os.environ.get("PAGED_JAX_SKIP_MOSAIC") == "1" else (
                    "pallas-mosaic",)
                res = agreement(config, params, ("reference", "pallas-triton", *mosaic), log)
            elif name == "batch1":
                res = decode_roofline(config, params, B1, backend, B1_RUN, 1, bandwidth)
            elif name == "batch64":
                res = decode_roofline(config, params, B64, backend, B64_RUN, B64_BATCH,
                                      bandwidth)
            else:
                raise ValueError(f"unknown engine part {part!r}")
        except Exception as e:  # keep the other parts' numbers whatever happens here
            res = dict(error=f"{type(e).__name__}: {e}"[:800])
        res["part_s"] = time.perf_counter() - t0
        out["parts"][part] = res
        log(f"engine {part}: " + ", ".join(f"{k}={_short(v)}" for k, v in res.items()
                                           if not isinstance(v, (list, dict))))
        if on_part:
            on_part(out)
    return out


def _short(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def profile(bandwidth: float, log=print, out_dir: str | None = None) -> dict:
    """One decode window at batch 1 and at batch B64_BATCH under jax.profiler: the device's
    time by kernel (name, calls, total) beside the window's wall time, so a step's time can be
    placed (matmuls, attention, sampling, bookkeeping, or the device idle between launches).
    The Perfetto trace of each is kept in `out_dir` when given."""
    out = {}
    config, params = random_model(MODEL, "bfloat16")
    for name, ec, run, batch in (("batch1", B1, B1_RUN, 1), ("batch64", B64, B64_RUN, B64_BATCH)):
        try:
            out[name] = _profile_window(config, params, ec, run, batch, out_dir, name)
        except Exception as e:  # the other batch's profile still runs
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
        log(f"profile {name}: " + ", ".join(f"{k}={_short(v)}" for k, v in out[name].items()
                                            if not isinstance(v, (list, dict))))
    return out


def _profile_window(config, params, ec: dict, run: dict, batch: int, out_dir, name) -> dict:
    import glob
    import shutil
    import tempfile

    import jax

    prompts = [prompt_ids(run["prompt"], i, config.vocab_size) for i in range(batch)]
    generate(engine_for(config, params, ec, "paged", "pallas"), prompts, run["tokens"])
    eng = engine_for(config, params, ec, "paged", "pallas")
    from paged_jax.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=run["tokens"], ignore_eos=True,
                        detokenize=False)
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": ids}, sp)
    eng.recorder = steps = []
    while eng.has_unfinished() and sum(s.kind == "window" for s in steps) < 1:
        eng.step()  # the prefills and a first window, untraced
    trace_dir = tempfile.mkdtemp()
    n0 = len(steps)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        while eng.has_unfinished() and sum(s.kind == "window" for s in steps[n0:]) < 2:
            eng.step()
    traced = [s for s in steps[n0:] if s.kind == "window"]
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    res = summarize_trace(path)
    if out_dir:
        shutil.copy(path, f"{out_dir}/profile_{name}.trace.json.gz")
    wall = sum(s.duration for s in traced)
    n = sum(s.num_steps for s in traced)
    return dict(res, windows=len(traced), steps=n, wall_ms_per_step=1e3 * wall / n,
                device_ms_per_step=res["device_us"] / 1e3 / n)


def kernel_kind(name: str) -> str:
    """What a device kernel of the engine's step does, by XLA's or our kernel's name."""
    if "paged" in name or "mosaic" in name or "ragged" in name:
        return "attention"  # before "dot": the Triton decode variants are named *_dot
    if "gemm" in name or "dot" in name or "cublas" in name.lower():
        return "matmul"
    if "memcpy" in name.lower():
        return "copies"
    return "other fusions"


def summarize_trace(path: str, top: int = 25) -> dict:
    """Device (GPU) time by kernel name and the host's busiest events, from a Perfetto trace
    that jax.profiler wrote."""
    import collections
    import gzip
    import json

    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev, host = collections.defaultdict(lambda: [0, 0.0]), collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        where = procs.get(e["pid"], "")
        if "GPU" in where or "device" in where.lower():
            k = dev[e["name"][:90]]
            k[0] += 1
            k[1] += e.get("dur", 0.0)
        else:
            host[e["name"][:90]] += e.get("dur", 0.0)
    ranked = sorted(dev.items(), key=lambda kv: -kv[1][1])
    by_kind = collections.Counter()
    for name, (_, us) in dev.items():
        by_kind[kernel_kind(name)] += us
    total = sum(by_kind.values()) or 1.0
    return dict(device_us=sum(v[1] for v in dev.values()),
                share_by_kind={k: round(us / total, 4) for k, us in by_kind.most_common()},
                device_events=sum(v[0] for v in dev.values()),
                kernels=[dict(name=k, calls=c, us=round(us, 1)) for k, (c, us) in ranked[:top]],
                host=[dict(name=k, us=round(us, 1)) for k, us in host.most_common(12)],
                processes=sorted(set(procs.values())))
