"""Serving benchmark over HTTP, in the manner of `vllm bench serve`.

    python -m experiments.bench_serving [--url URL] [--rates 1 2 4 inf] [--requests 64]

Requests with ShareGPT-like lengths (paged_jax/study/workloads.py, scaled to a CPU) arrive as a
Poisson process (`--cv` != 1: gamma gaps) at each rate and stream their tokens back from
/v1/completions. Per rate it prints and saves request throughput, output tok/s, TTFT / TPOT /
ITL (mean, p50, p99), TTFT split into queueing and prefill (means, from the server's /metrics
histograms, which vLLM exports under the same names) and tokens per streamed chunk, and counts
every request's fate: done, refused with 503, failed, so that none can vanish. Without --url it
starts `python -m paged_jax.serve` on a free port (prefix caching off: the workload's prompts
share their text) and stops it afterwards. `--offline` also runs the same requests through
`LLM.generate` in this process, after the server has stopped, and prints the server's throughput
against it (the HTTP + async-loop overhead). `--vllm-python PY` runs the same client against
vLLM's OpenAI server started with that interpreter (`make peers` does, with its .venv-vllm).
`--eager-too` also runs our server with `--plan-eagerly` (each step planned as soon as the one
before is sent, so an arrival waits for one more step) as a third server, between the two.
Writes results/bench_serving.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.study.workloads import make_workload

# The same engine limits on both servers (and the offline run): batch, token budget, context,
# block size (32: vLLM's CPU attention takes multiples of 32), KV bytes, no prefix caching.
LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512, block_size=32,
              kv_cache_gib=1)
ENGINE_FLAGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--max-model-len",
                "512", "--block-size", "32", "--kv-cache-memory", str(1 << 30),
                "--no-enable-prefix-caching"]


async def one(client, url: str, model: str, item, t0: float, timeout: float) -> dict:
    """Sends one request at its arrival time; records its token times."""
    import httpx

    await asyncio.sleep(max(0.0, t0 + item.arrival - time.perf_counter()))
    prompt = getattr(item, "prompt", None) or item.prompt_token_ids  # text, else token ids
    body = dict(model=model, prompt=prompt, max_tokens=item.output_len,
                temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    sent, times, tokens = time.perf_counter(), [], 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                return dict(status=r.status_code, sent=sent)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
    except (TimeoutError, httpx.HTTPError) as e:
        return dict(status="error", error=repr(e), sent=sent)
    return dict(status=200, sent=sent, times=times, tokens=tokens,
                prompt=len(item.prompt_token_ids))


async def run_rate(url: str, model: str, items, timeout: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(client, url, model, it, t0, timeout) for it in items))


def summarize(rate: float, res: list[dict], wall: float) -> dict:
    done = [r for r in res if r["status"] == 200 and r["times"]]
    ttft = np.array([r["times"][0] - r["sent"] for r in done])
    tpot = np.array([(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1)
                     for r in done if r["tokens"] > 1])
    itl = np.concatenate([np.diff(r["times"]) for r in done if len(r["times"]) > 1] or [[]])

    def stats(x, name):
        if not len(x):
            return {f"{name}_mean_ms": None, f"{name}_p50_ms": None, f"{name}_p99_ms": None}
        return {f"{name}_mean_ms": 1e3 * float(x.mean()),
                f"{name}_p50_ms": 1e3 * float(np.percentile(x, 50)),
                f"{name}_p99_ms": 1e3 * float(np.percentile(x, 99))}

    # Tokens per streamed chunk, per request (1.0: every token reached the client on its own).
    chunk = np.array([r["tokens"] / len(r["times"]) for r in done])
    out_tokens = sum(r["tokens"] for r in done)
    refused = sum(r["status"] == 503 for r in res)
    failed = sum(r["status"] not in (200, 503) for r in res)
    return dict(rate=rate, sent=len(res), done=len(done), refused_503=refused, failed=failed,
                lost=len(res) - len(done) - refused - failed,
                wall_s=wall, request_throughput=len(done) / wall,
                output_tok_s=out_tokens / wall, **stats(ttft, "ttft"), **stats(tpot, "tpot"),
                **stats(itl, "itl"),
                chunk_tokens_mean=float(chunk.mean()) if len(chunk) else None,
                chunk_tokens_max=float(chunk.max()) if len(chunk) else None)


SPLIT = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds"}
BUILDS = ("paged_jax:xla_programs_built", "paged_jax:xla_build_seconds")  # paged-jax only


def scrape(url: str) -> dict[str, float]:
    """The _sum and _count of the TTFT-split histograms on the server's /metrics (vLLM and
    paged-jax export them under the same names), summed over labels, and paged-jax's count
    of XLA programs built (a program built while measuring is a compile in the timings)."""
    import httpx

    got: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return got  # no split for this rate, the run goes on
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUILDS or any(name in (h + "_sum", h + "_count") for h in SPLIT.values()):
            got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


def server_split(before: dict, after: dict) -> dict:
    """Mean queueing and prefill time (ms) of the requests finished between two scrapes,
    as the server measured them, and the XLA programs paged-jax built meanwhile (None for
    vLLM)."""
    built = (after[BUILDS[0]] - before[BUILDS[0]]) if BUILDS[0] in after else None
    out: dict = dict(programs_built=built)
    for key, h in SPLIT.items():
        n = after.get(h + "_count", 0) - before.get(h + "_count", 0)
        total = after.get(h + "_sum", 0) - before.get(h + "_sum", 0)
        out[f"{key}_mean_ms"] = 1e3 * total / n if n else None
    return out


def start_server(model: str | None, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`python -m paged_jax.serve` on a free port, once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "paged_jax.serve", *([model] if model else []),
           "--port", str(port), *flags]
    return _wait(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()}), port)


def start_vllm(python: str, name: str) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server (its CPU build, in its own venv: `make peers`) on the default
    model exported to a Hugging Face folder, with the same engine limits as ours."""
    from experiments.peer_vllm import export_hf_folder

    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(export_hf_folder()), "--served-model-name", name, "--port", str(port),
           "--dtype", "float32", "--max-num-seqs", "16", "--max-model-len", "512",
           "--max-num-batched-tokens", "512", "--block-size", "32",
           "--no-enable-prefix-caching"]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1"}
    return _wait(subprocess.Popen(cmd, env=env), port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, port: int) -> tuple[subprocess.Popen, str]:
    import httpx

    url, deadline = f"http://127.0.0.1:{port}", time.time() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server did not come up in 10 minutes")
        time.sleep(1)


def offline(model: str | None, items) -> dict:
    """The same requests through LLM.generate (all at once), with the server's engine flags."""
    from paged_jax import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512,
              block_size=32, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    sps = [SamplingParams(temperature=0.0, max_tokens=it.output_len, ignore_eos=True)
           for it in items]
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    llm.generate(prompts, sps, use_tqdm=False)  # warm-up: compiles every shape it meets
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, output_tok_s=sum(len(o.outputs[0].token_ids) for o in outs) / wall)


def sweep(proc, url: str, model: str, tok, a, server: str) -> list[dict]:
    """Warm-up passes (the whole workload at once, then up to 16 others arriving one by one
    at 2 per second: caches and allocators warm on both servers; paged-jax's programs were
    built before its /health said ready, and the passes count any it still builds: the
    first row's `warm_up_pass_programs_built`), then each rate; stops `proc` (if any) at
    the end."""
    rows, pass_built = [], 0
    try:
        for n, rate, seed in ((a.requests, float("inf"), a.seed),
                              (min(16, a.requests), 2.0, a.seed + 1)):
            warm = make_workload("sharegpt", n, rate, tok, seed=seed, scale=a.scale,
                                 max_model_len=512)
            before = scrape(url)
            asyncio.run(run_rate(url, model, warm, a.timeout))
            pass_built += server_split(before, scrape(url))["programs_built"] or 0
        for rate in a.rates:
            items = make_workload("sharegpt", a.requests, rate, tok, seed=a.seed,
                                  scale=a.scale, max_model_len=512, cv=a.cv)
            before, t0 = scrape(url), time.perf_counter()
            res = asyncio.run(run_rate(url, model, items, a.timeout))
            wall = time.perf_counter() - t0
            rows.append(dict(server=server, **summarize(rate, res, wall),
                             **server_split(before, scrape(url))))
            print(table(rows[-1:], COLUMNS), flush=True)
        if rows:
            rows[0]["warm_up_pass_programs_built"] = pass_built
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    return rows


def plot(rows: list[dict], name: str):
    """p50 / p99 TTFT and TPOT, and output tok/s, against the rate, one line per server."""
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.4))
    finite = [r["rate"] for r in rows if np.isfinite(r["rate"])] or [1.0]
    for server in dict.fromkeys(r["server"] for r in rows):
        sel = [r for r in rows if r["server"] == server]
        xs = [r["rate"] if np.isfinite(r["rate"]) else 2 * max(finite) for r in sel]
        for key in ("ttft", "tpot"):
            for q, style in (("p50", "o-"), ("p99", "o--")):
                ax[0].plot(xs, [r[f"{key}_{q}_ms"] for r in sel], style,
                           label=f"{server} {key} {q}")
        ax[1].plot(xs, [r["output_tok_s"] for r in sel], "o-", label=server)
    ax[0].set_xlabel("request rate (req/s; the last point: all at once)")
    ax[0].set_ylabel("ms")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("request rate (req/s)")
    ax[1].set_ylabel("output tok/s")
    ax[1].legend(fontsize=8)
    return save_plot(name, fig)


def main(argv: list[str] | None = None, name: str = "bench_serving") -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (else one is started)")
    ap.add_argument("--model", default=None, help="model path for the started server")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, float("inf")])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.25, help="ShareGPT length scale")
    ap.add_argument("--cv", type=float, default=1.0, help="arrival gaps' coefficient of "
                    "variation (1 = Poisson)")
    ap.add_argument("--max-pending", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--offline", action="store_true", help="compare with LLM.generate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None,
                    help="also run the same client against vLLM's server, started with this "
                    "interpreter (`make peers`: .venv-vllm/bin/python)")
    ap.add_argument("--eager-too", action="store_true",
                    help="also run our server with --plan-eagerly (label 'paged-jax eager')")
    ap.add_argument("--bytes", action="store_true",
                    help="prompts as UTF-8 bytes (any vocabulary of >= 256), not the model's "
                    "tokens")
    a = ap.parse_args(argv)
    from paged_jax.models import load_model
    from paged_jax.serve.cli import default_name

    tok = None if a.bytes else load_model(a.model)[2]
    model = a.served_model_name or default_name(a.model)
    proc, url = (None, a.url) if a.url else start_server(
        a.model, ENGINE_FLAGS + ["--max-pending", str(a.max_pending)])
    rows = sweep(proc, url, model, tok, a, "paged-jax")
    if a.eager_too and not a.url:
        flags = ENGINE_FLAGS + ["--max-pending", str(a.max_pending), "--plan-eagerly"]
        rows += sweep(*start_server(a.model, flags), model, tok, a, "paged-jax eager")
    if a.vllm_python:
        rows += sweep(*start_vllm(a.vllm_python, model), model, tok, a, "vllm")
    out = dict(requests=a.requests, scale=a.scale, cv=a.cv, limits=LIMITS, rows=rows)
    if a.offline:
        items = make_workload("sharegpt", a.requests, float("inf"), tok, seed=a.seed,
                              scale=a.scale, max_model_len=512)
        out["offline"] = offline(a.model, items)
        burst = [r for r in rows if not np.isfinite(r["rate"]) and r["server"] == "paged-jax"]
        if burst:
            out["server_vs_offline"] = burst[0]["output_tok_s"] / out["offline"]["output_tok_s"]
        print("offline LLM.generate:", out["offline"], "| server / offline:",
              out.get("server_vs_offline"))
    out["programs_built_after_ready"] = built_after_ready(rows)
    out["png"] = str(plot(rows, name))
    out["json"] = str(save_json(name, out))
    if not a.url:  # servers this run started, with their warm-up (serve --warmup auto)
        late = {k: v for k, v in out["programs_built_after_ready"].items() if v}
        assert not late, f"programs built after the server said ready: {late}"
    return out


def built_after_ready(rows: list[dict]) -> dict[str, int]:
    """{paged-jax server: XLA programs it built after /health said ready} (warm-up passes
    and timed rates): 0 when warm-up built every program the workload meets."""
    out: dict[str, int] = {}
    for r in rows:
        if r.get("programs_built") is not None:
            out[r["server"]] = (out.get(r["server"], 0) + int(r["programs_built"])
                                + int(r.get("warm_up_pass_programs_built", 0)))
    return out


COLUMNS = ["server", "rate", "sent", "done", "refused_503", "failed", "lost", "request_throughput",
           "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
           "queue_mean_ms", "prefill_mean_ms", "itl_p50_ms", "itl_p99_ms", "chunk_tokens_mean",
           "programs_built"]

if __name__ == "__main__":
    main()
