"""`make bench`: paged-jax beside what a user would pick instead, every side in one run, on
the same terms, with the machine's limit on every row.

    python -m experiments.bench [--model smollm2] [--rounds 3]
                                [--sides ours ours-xla hf vllm llamacpp]
                                [--rows "batch 1" "batch 64"] [--hf-dtypes float32]
                                [--quick]

Sides (each where installed; `make peers` builds vLLM's and llama.cpp's venvs):
  ours        paged-jax `LLM.generate`, float32 (its "auto" dtype on CPU)
  ours-xla    the same with matmul_backend="xla" (XLA's dot instead of the C++ kernel)
  ours-bf16   paged-jax with bfloat16 weights (the float32 weights rounded: bfloat16 panels
              in the C++ kernel, float32 activations, bfloat16 K/V)
  ours-int8   paged-jax, quantization="int8" (W8A8 on CPU; a 4-bit GGUF tensor keeps its
              codes: W4A8), over the K/V pages dtype="auto" picks beside int8 (bfloat16
              where their perplexity holds and they are faster: paged_jax/precision.py)
  ours-int4   paged-jax, quantization="int4" (W4A8), over the same pages
  hf          transformers `generate()`, float32 and bfloat16, one static batch per run
  vllm        vLLM's CPU build (offline `LLM.generate`), float32 and bfloat16
  llamacpp    llama.cpp (llama-cpp-python) on the same GGUF, computing with its own weight
              types; every prompt of a run is a parallel sequence of one context

Rows (chat prompts through the model's template, greedy, exactly T tokens each, EOS ignored):
  batch 1     1 prompt x 64 tokens        limit: bandwidth roofline (weights + K/V per token;
                                          llama.cpp's: its GGUF file's own bytes)
  batch 16    16 prompts x 64 tokens      limit: the model's matmul chain at batch 16 (the
                                          faster of XLA's dot and the C++ kernel)
  batch 64    64 prompts x 64 tokens      limit: the matmul chain at batch 64
  prefix      16 prompts sharing a system prompt x 64 tokens, prefix caching on for paged-jax
              and vLLM (a warm-up run fills the cache; HF has none)

Same terms: at most 64 sequences and 512 tokens per step, 512-token context, 32-token
blocks, 1 GiB of KV cache, prefix caching off except in the prefix row. Every side runs every
row once per round, in an order that rotates each round (a warm-up run first compiles or
loads what it needs: the whole row for paged-jax, whose programs are compiled per shape, and
a few tokens for the peers); each reports the median of its rounds and their spread (half the
range). A side against ours is "higher" / "lower" only when it is so in every round, "not
separable" otherwise (the one rule: experiments/common.py). Writes results/bench[_MODEL].json
with provenance.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments import common, hf
from experiments.peer_protocol import Worker
from experiments.prompts import SYSTEM, prompt_ids

ROOT = Path(__file__).resolve().parents[1]
LIMITS = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512, block_size=32,
              kv_cache_gib=1)
# name: (prompts, tokens each, prefix caching). 64 new tokens per prompt: decode-dominated
# (the chat prompts are 30-90 tokens), and a full run of every side stays under an hour here.
ROWS = {"batch 1": (1, 64, False), "batch 16": (16, 64, False), "batch 64": (64, 64, False),
        "prefix": (16, 64, True)}
EXTRA_ROWS = {"batch 8": (8, 32, False)}  # `make run`'s short comparison
QUANTIZED = ("int8", "int4")  # our integer sides' weight types (their limits: their codes')
WARMUP_TOKENS = 4  # a peer's warm-up run: loads, allocates, fills its prefix cache
QUICK_ROWS = {"batch 1": (1, 8, False), "batch 16": (4, 8, False), "prefix": (4, 8, True)}



class Ours:
    """paged-jax, float32, with the shared limits (prefix caching per `caching`); `matmul`
    "xla" runs the projections on XLA's dot instead of the default C++ kernel (the kernel's
    gain, measured in the same run). `name` and `llm_kw` (dtype, quantization: other LLM
    options) make the other sides of experiments/weight_quantization.py."""

    def __init__(self, parts, caching: bool, matmul: str | None = None,
                 name: str | None = None, **llm_kw):
        from paged_jax import LLM

        self.name = name or ("paged-jax float32" + (" +prefix cache" if caching else "")
                             + (", XLA matmuls" if matmul == "xla" else ""))
        self.llm = LLM(model_parts=parts, enable_prefix_caching=caching, matmul_backend=matmul,
                       kv_cache_memory=LIMITS["kv_cache_gib"] << 30,
                       **{k: v for k, v in LIMITS.items() if k != "kv_cache_gib"}, **llm_kw)
        runner = self.llm.llm_engine.runner
        self.settings = dict(dtype=llm_kw.get("dtype", "float32"),
                             quantization=llm_kw.get("quantization"),
                             kv_cache_dtype=llm_kw.get("kv_cache_dtype", "auto"),
                             enable_prefix_caching=caching,
                             decode_window=self.llm.engine_config.decode_window,
                             async_scheduling=self.llm.engine_config.async_scheduling,
                             attention_backend=runner.cfg.backend, matmul_backend=runner.matmul,
                             **LIMITS)
        self.versions = {}

    def run(self, prompts: list[list[int]], tokens: int) -> dict:
        from paged_jax import SamplingParams

        eng = self.llm.llm_engine
        eng.recorder = steps = []
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        # The host's share: the caller thread's time not blocked reading the device, per
        # step wall time (under async scheduling a step's send-to-read interval spans the
        # next step's, so 1 - that / wall went negative: results before this fix).
        busy, wait = sum(s.duration for s in steps), sum(s.wait for s in steps)
        return dict(seconds=seconds, tokens=[o.outputs[0].token_ids for o in outs],
                    host_share=1 - wait / busy if busy else 0.0)

    def close(self) -> None:
        # The limits load the model again after the rounds: a 1.5B's engines held through
        # them ran 24 GB out (the kernel killed the run before it saved anything).
        self.llm = None


class HF:
    """transformers `generate()`: all prompts as one left-padded static batch."""

    def __init__(self, model: str, dtype: str, pad: int):
        import torch
        import transformers

        self.name, self.pad = f"HF generate() {dtype}", pad
        self.model = hf.model(dtype, model)
        self.settings = dict(dtype=dtype, batching="one static batch per run",
                             threads=torch.get_num_threads())
        self.versions = dict(torch=torch.__version__, transformers=transformers.__version__)

    def run(self, prompts: list[list[int]], tokens: int) -> dict:
        t0 = time.perf_counter()
        out = hf.generate(self.model, prompts, tokens, self.pad)
        return dict(seconds=time.perf_counter() - t0, tokens=out)

    def close(self) -> None:
        pass


class Peer:
    """A side in its own venv (experiments/peer_protocol.py)."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.worker = Worker(argv, env=env, cwd=str(ROOT))
        self.settings, self.versions = self.worker.settings, self.worker.versions

    def run(self, prompts: list[list[int]], tokens: int) -> dict:
        return self.worker.run(prompts, tokens)

    def close(self) -> None:
        self.worker.close()


def make_sides(names: list[str], model: str, parts, caching: bool = True,
               hf_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
               integer_pages: str = "auto") -> list:
    """The sides asked for that are installed here (a missing peer is reported, not fatal);
    the prefix-caching ones only when a row caches (`caching`: each holds its own copy of the
    model, which a 1.5B's float32 weights make 7 GB). Our integer sides run `integer_pages`
    (their kv_cache_dtype: main passes the pages `LLM()`'s check chose beside int8)."""
    import jax
    import jax.numpy as jnp

    sides, py = [], lambda venv: ROOT / venv / "bin" / "python"
    if "ours" in names:
        sides += [Ours(parts, False)] + ([Ours(parts, True)] if caching else [])
    if "ours-xla" in names:
        sides.append(Ours(parts, False, matmul="xla"))
    if "ours-bf16" in names:
        bf16 = (parts[0], jax.tree.map(lambda x: x.astype(jnp.bfloat16), parts[1]), parts[2])
        sides.append(Ours(bf16, False, name="paged-jax bfloat16", dtype="bfloat16"))
    for q in ("int8", "int4"):
        if f"ours-{q}" in names:
            sides.append(Ours(parts, False, name=f"paged-jax {q}", quantization=q,
                              kv_cache_dtype=integer_pages))
    if "hf" in names:
        pad = parts[2].eos_token_ids[0]
        sides += [HF(model, d, pad) for d in hf_dtypes]
    if "vllm" in names and _installed(py(".venv-vllm"), "vllm"):
        base = [str(py(".venv-vllm")), str(ROOT / "experiments/peer_vllm.py"), "--model",
                model, "--kv-gib", str(LIMITS["kv_cache_gib"]), "--block-size",
                str(LIMITS["block_size"]), "--max-seqs", str(LIMITS["max_num_seqs"]),
                "--max-tokens-per-step", str(LIMITS["max_num_batched_tokens"]),
                "--max-len", str(LIMITS["max_model_len"])]
        sides += [Peer(f"vLLM {d}", base + ["--dtype", d]) for d in ("float32", "bfloat16")]
        if caching:
            sides.append(Peer("vLLM float32 +prefix cache",
                              base + ["--dtype", "float32", "--prefix-caching"]))
    if "llamacpp" in names and _installed(py(".venv-llama"), "llama_cpp"):
        from paged_jax.models import model_path

        sides.append(Peer("llama.cpp (GGUF weights)", [
            str(py(".venv-llama")), str(ROOT / "experiments/peer_llamacpp.py"),
            str(model_path(model)), "--max-seqs", str(LIMITS["max_num_seqs"]),
            "--max-len", str(LIMITS["max_model_len"])]))
    return sides


def _installed(python: Path, module: str) -> bool:
    import subprocess

    if not python.exists():
        print(f"(no {python.parent.parent.name}: `make peers` builds it)", flush=True)
        return False
    ok = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode
    return ok == 0


def applies(side, caching: bool) -> bool:
    """Which sides run a row: the prefix row is for the caching sides, plus HF (which has no
    prefix cache) as the reference; the other rows for every side without caching."""
    if "+prefix cache" in side.name:
        return caching
    return side.name.startswith("HF") or not caching


def measure(sides: list, rows: dict, tok, rounds: int) -> dict:
    """Every side on every row it applies to, `rounds` times, in a rotating order."""
    runs: dict = {r: {s.name: [] for s in sides if applies(s, rows[r][2])} for r in rows}
    firsts: dict = {r: {} for r in rows}
    work = {r: _workload(tok, n, caching) for r, (n, _, caching) in rows.items()}
    for r, (_n, tokens, caching) in rows.items():  # warm-up: compile, load, fill caches
        for s in sides:
            if applies(s, caching):  # ours compiles per shape: the whole row; peers: a taste
                s.run(work[r], tokens if isinstance(s, Ours) else min(tokens, WARMUP_TOKENS))
                if caching and isinstance(s, Ours):  # the first run filled the cache: the
                    s.run(work[r], tokens)  # rounds' hits take shapes of their own
    for k in range(rounds):
        order = common.rotated(sides, k)
        for r, (_n, tokens, caching) in rows.items():
            for s in (s for s in order if applies(s, caching)):
                res = s.run(work[r], tokens)
                res["mem_available_mib"] = mem_available_mib()  # after the run, every side loaded
                runs[r][s.name].append(res)
                firsts[r].setdefault(s.name, [t[:16] for t in res["tokens"]])
                print(f"round {k} {r:8s} {s.name:28s} {res['seconds']:7.2f} s", flush=True)
    return dict(runs=runs, firsts=firsts, work=work)


MEM_FLOOR_MIB = 1024  # below this, a peer's memory-mapped weights were seen read from disk again


def mem_available_mib() -> int | None:
    """The kernel's MemAvailable in MiB (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) // 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_check(m: dict) -> dict:
    """The least memory left free after any run of the rounds, and whether it fell under
    MEM_FLOOR_MIB: with every side of `make bench` loaded, a 24 GB machine kept 237 MiB and
    llama.cpp's batch-1 speed halved (its weights, a mapped file, read from disk again), so
    such a run's ratios say more about the machine than about the sides (a warning, and the
    results file says so)."""
    seen = [x["mem_available_mib"] for by in m["runs"].values() for rs in by.values()
            for x in rs if x.get("mem_available_mib") is not None]
    low = min(seen, default=None)
    starved = low is not None and low < MEM_FLOOR_MIB
    if starved:
        print(f"WARNING: as little as {low} MiB of memory was left free during the rounds: "
              "mapped weights may have been read from disk again; run fewer sides at once "
              "(--sides) before trusting these ratios", flush=True)
    return dict(min_available_mib=low, floor_mib=MEM_FLOOR_MIB, starved=starved)


def _workload(tok, n: int, caching: bool) -> list[list[int]]:
    return prompt_ids(tok, n, SYSTEM if caching else None)


def limits(parts, rows: dict, work: dict, dtype: str = "float32", model: str = "") -> dict:
    """Each row's machine limit in tok/s for `dtype` weights: the bandwidth roofline for
    batch 1, else the model's matmul chain at the row's batch, on the faster of XLA's dot and
    the C++ kernel (where it runs `dtype`). `parts` holds the float32 model; other precisions
    are cast from it (the values do not change a matmul's time), or for "int8" / "int4"
    packed as those codes (the roofline then counts the codes' bytes, scales included).
    "gguf": llama.cpp's own batch-1 roofline, `model`'s file's bytes (`gguf_roofline`)."""
    from paged_jax.study.metrics import (
        kv_bytes_per_token,
        measure_bandwidth,
        streamed_weight_bytes,
    )

    config, params = parts[0], parts[1]
    bw = measure_bandwidth()
    if dtype == "gguf":
        return gguf_roofline(model, config, rows, work, bw)
    quant = dtype in QUANTIZED  # int8 / int4 codes: float32 compute and pages
    item = 1.0 if quant else np.dtype(dtype).itemsize / params["embed"].dtype.itemsize
    batches = sorted({n for n, *_ in rows.values() if n > 1})
    steps: dict[int, dict] = {n: {} for n in batches}  # batch 16 and its prefix row share one
    for kind, form in runtime_forms(params, dtype):
        for n in batches:
            steps[n][kind] = chain_seconds(form, n)
        if quant:  # the codes' own bytes (scales and mins included) over the float weights'
            item = streamed_weight_bytes(form) / streamed_weight_bytes(params)
        del form
    dtype = "float32" if quant else dtype
    out = {}
    for r, (n, _, _) in rows.items():
        if n == 1:
            ctx = len(work[r][0]) + rows[r][1] / 2
            per_token = (item * streamed_weight_bytes(params)
                         + ctx * kv_bytes_per_token(config, dtype))
            out[r] = dict(kind="bandwidth roofline", tok_s=bw / per_token,
                          bytes_per_s=bw, bytes_per_token=per_token)
        else:
            step = min(steps[n].values())
            out[r] = dict(kind="matmul chain", tok_s=n / step, step_ms=1e3 * step,
                          step_ms_by_matmul={k: 1e3 * v for k, v in steps[n].items()})
    return out


def gguf_roofline(model: str, config, rows: dict, work: dict, bw: float) -> dict:
    """llama.cpp's batch-1 roofline from its own bytes: every matrix of the GGUF file in its
    type (a Q4_K_M file keeps its output matrix and some down / value projections in Q6_K,
    where our int8 packing of them reads a byte and more per weight) and a float16 K/V cache
    (its default)."""
    from paged_jax.models import model_path
    from paged_jax.study.metrics import gguf_streamed_bytes, kv_bytes_per_token

    weights = gguf_streamed_bytes(model_path(model))
    out = {}
    for r, (n, tokens, _) in rows.items():
        if n == 1:
            per_token = weights + (len(work[r][0]) + tokens / 2) * kv_bytes_per_token(
                config, np.float16)
            out[r] = dict(kind="bandwidth roofline", tok_s=bw / per_token, bytes_per_s=bw,
                          bytes_per_token=per_token)
    return out


def higher(before: dict, after: dict) -> dict:
    """Each row's limit measured before and after the rounds (`limits`), the higher one kept
    with both named: the machine can slow for a while, and a limit measured slow made a
    share-of-limit bar pass (a float32 chain of 304 tok/s at batch 16 where the run before
    measured 515 put float32 at 83% of it)."""
    out = {}
    for r, b in before.items():
        a = after[r]
        out[r] = {**max(b, a, key=lambda e: e["tok_s"]), "measured_tok_s": [b["tok_s"],
                                                                              a["tok_s"]]}
    return out


def runtime_forms(params, weights: str):
    """Yield ("xla", runtime form) then, where the C++ kernel runs `weights`, ("cpu", its
    packed panels), both in `weights` ("int8" / "int4": the packed codes only, XLA's dot runs
    no codes): the panels are packed from XLA's form a layer at a time, each float layer let
    go once packed, so one form is held beside `params` (all three float32 copies of the 1.5B
    at once peaked at 20 GB of 24, and the bfloat16 model loaded beside them ran out)."""
    import jax
    import jax.numpy as jnp

    from paged_jax.engine.runner import matmul_backend
    from paged_jax.models.llama import pack_params, prepare_params

    dtype = "float32" if weights in QUANTIZED else weights
    cast = lambda t: jax.tree.map(lambda a: a.astype(dtype), t)  # noqa: E731
    stacked = params["layers"]
    one = lambda i: prepare_params({"layers": {k: v[i:i + 1] for k, v in stacked.items()}})  # noqa: E731
    form = {**cast({k: v for k, v in params.items() if k != "layers"}),  # a layer at a time
            "layers": [cast(one(i)["layers"][0]) for i in range(len(stacked["wq"]))]}
    if weights not in QUANTIZED:
        yield "xla", form
    if matmul_backend(None, jnp.dtype(dtype)) != "cpu":
        return
    layers, packed = form.pop("layers"), []
    head = pack_params({**form, "layers": []}, weights)
    form.clear()
    while layers:
        packed.append(pack_params({**head, "layers": [layers.pop(0)]}, weights)["layers"][0])
    yield "cpu", {**head, "layers": packed}


def matmul_chain(params, dot=None):
    """(jitted chain(layers, head, x), head): the forward's matmuls alone (no attention, norms
    or sampling) over runtime-form params; `dot(x, w)` runs each projection (default: the
    runtime form's `linear`; experiments/weight_layout.py passes the other layout's)."""
    import jax
    import jax.numpy as jnp

    from paged_jax.models.llama import linear

    dot = dot or linear
    qd = params["layers"][0]["wo"].shape[1]  # the o projection's input width, Q * D
    head = params.get("lm_head", params["embed"])  # [V, E] either way, as the forward runs it

    def chain(layers, head, x):
        for p in layers:
            qkv = dot(x, p["w_qkv"])
            x = x + dot(qkv[:, :qd], p["wo"])
            x = x + dot(jnp.split(dot(x, p["w_gate_up"]), 2, axis=-1)[0], p["w_down"])
        return linear(x, head)

    return jax.jit(chain), head


def chain_seconds(params, batch: int, repeats: int = 10) -> float:
    """The model's matmuls alone at `batch` rows (`matmul_chain`: XLA's dot, or the C++
    kernel on packed params), best of `repeats`: what no engine with those matmuls can beat."""
    import jax.numpy as jnp

    from paged_jax.precision import best_of

    f, head = matmul_chain(params)
    layers, embed = params["layers"], params["embed"]
    return best_of(f, (layers, head, jnp.full((batch, embed.shape[1]), 0.01, embed.dtype)),
                   repeats)


def reference_side(runs: dict, caching: bool) -> str:
    """The side a row's "ours / side" ratios divide by: paged-jax float32, or where a run
    leaves it out (the 1.5B's bfloat16 / int4 run: make bench) our first side there."""
    name = "paged-jax float32" + (" +prefix cache" if caching else "")
    return name if name in runs else next(n for n in runs if n.startswith("paged-jax"))


def summarize(sides: list, rows: dict, m: dict, lims: dict) -> list[dict]:
    """One entry per row and side: median tok/s, spread, ratio to ours, agreement, and the
    limit of the side's precision (`lims` by weight type: bfloat16 sides beside bfloat16's,
    our int8 / int4 sides beside their codes' own where measured, else float32's, named so)."""
    table = []
    for r, (n, tokens, caching) in rows.items():
        ours_name = reference_side(m["runs"][r], caching)
        ours_tps = [n * tokens / x["seconds"] for x in m["runs"][r][ours_name]]
        for s in sides:
            if s.name not in m["runs"][r]:
                continue
            tps = [n * tokens / x["seconds"] for x in m["runs"][r][s.name]]
            own = next((w for w in lims if s.name.startswith("paged-jax") and w in s.name), None)
            own = "gguf" if s.name.startswith("llama.cpp") and r in lims.get("gguf", {}) else own
            precision = own or ("bfloat16" if "bfloat16" in s.name and "bfloat16" in lims
                                else "float32")
            lim = lims[precision]
            entry = dict(row=r, side=s.name, batch=n, tokens=tokens, limit_precision=precision,
                         tok_s=statistics.median(tps), spread=common.spread(tps), runs=tps,
                         limit_tok_s=lim[r]["tok_s"], limit=lim[r]["kind"],
                         share_of_limit=statistics.median(tps) / lim[r]["tok_s"],
                         agree_first16_with_ours=sum(
                             a == b for a, b in zip(m["firsts"][r][s.name],
                                                    m["firsts"][r][ours_name], strict=True)))
            if s.name != ours_name:
                cmp = common.compare(ours_tps, tps)
                entry.update(ours_over_side=cmp["ratio"], verdict=cmp["verdict"])
            if "host_share" in m["runs"][r][s.name][0]:
                entry["host_share"] = statistics.median(
                    x["host_share"] for x in m["runs"][r][s.name])
            table.append(entry)
    return table


PEERS = {"vLLM": ("vLLM float32", "vLLM bfloat16"), "llama.cpp": ("llama.cpp (GGUF weights)",),
         "HF": ("HF generate() float32", "HF generate() bfloat16")}
PEER_DEFAULTS = {"vLLM": "vLLM bfloat16", "llama.cpp": "llama.cpp (GGUF weights)",
                 "HF": "HF generate() float32"}  # what each runs when a user sets nothing


def default_choice(model: str, parts) -> dict:
    """What `LLM(model)` with nothing set runs on this machine (paged_jax/precision.py: the
    fastest of float32, bfloat16 and the checkpoint's own 4-bit codes, "int8", each over
    float32 or bfloat16 pages, whose quality holds)."""
    from paged_jax import precision
    from paged_jax.models import model_path

    key = precision.checkpoint_key(model_path(model), model)
    return precision.choose(parts[0], parts[1], parts[2], key)


def default_side(choice: dict) -> str:
    """The side that runs `choice`: its weights' (an integer side runs the check's pages
    for int8: make_sides)."""
    return f"paged-jax {choice['weights']}"


def versus(table: list[dict], ours_default: str) -> list[dict]:
    """Per row (prefix caching off), our fastest side against each peer's fastest, and our
    default against the peer's default: the ratio of medians and the one rule's verdict on
    the paired rounds (each round ran every side)."""
    out = []
    for r in dict.fromkeys(e["row"] for e in table if e["row"] != "prefix"):
        got = {e["side"]: e for e in table if e["row"] == r}
        ours = [e for n, e in got.items() if n.startswith("paged-jax") and "prefix" not in n]
        for peer, names in PEERS.items():
            theirs = [got[n] for n in names if n in got]
            if not ours or not theirs:
                continue
            pairs = {"best": (max(ours, key=lambda e: e["tok_s"]),
                              max(theirs, key=lambda e: e["tok_s"]))}
            if ours_default in got and PEER_DEFAULTS[peer] in got:
                pairs["default"] = (got[ours_default], got[PEER_DEFAULTS[peer]])
            for kind, (a, b) in pairs.items():
                cmp = common.compare(a["runs"], b["runs"])
                out.append(dict(row=r, peer=peer, kind=kind, ours=a["side"], theirs=b["side"],
                                ratio=cmp["ratio"], round_ratios=cmp["round_ratios"],
                                verdict=cmp["verdict"]))
    return out


# Issue 56's bars, judged where a run holds both sides (experiments/common.py's rule on the
# per-round values): (row, peer) -> how many times the peer's default our default must run.
DEFAULT_BARS = {"smollm2": {("batch 16", "vLLM"): 1.2, ("batch 64", "vLLM"): 1.2,
                            ("batch 1", "llama.cpp"): 1.1},
                "qwen2.5-coder-1.5b": {("batch 1", "llama.cpp"): 1.0,
                                       ("batch 16", "llama.cpp"): 1.0}}
CHAIN_SHARE = 0.7  # float32's tok/s over its own matmul chain's, batch 16 and 64
BF16_OVER_F32 = 1.5  # at batch 16, on a CPU whose kernel holds bfloat16 dot products
INT8_OVER_F32 = 1.2  # at batch 16, on the 1.5B


STARVED = "not a test: the machine ran out of free memory during the rounds"


def targets(model: str, table: list[dict], default: str, bf16_dot: bool,
            starved: bool = False) -> list[dict]:
    """The bars above that this run's sides can be judged on, each with its per-round values
    and the one rule's verdict (a bar with a side missing from the run is left out). A
    `starved` run (memory_check) judges none: its ratios measured the machine's paging (one
    such run turned a bar 'met' on llama.cpp's halved speed)."""
    got = {(e["row"], e["side"]): e for e in table}
    out = []

    def bar(name: str, values: list[float], target: float) -> None:
        judged = common.target_verdict(values, target)
        judged["bar"] = judged.pop("target")  # "target" names the bar, as in other files
        if starved:
            judged["verdict"] = STARVED
        out.append(dict(target=name, value=float(np.median(values)), **judged))

    for (row, peer), x in DEFAULT_BARS.get(model, {}).items():
        ours, theirs = got.get((row, default)), got.get((row, PEER_DEFAULTS[peer]))
        if ours and theirs:
            bar(f"{model} {row}: default ({default}) >= {x}x {peer}'s default",
                common.round_ratios(ours["runs"], theirs["runs"]), x)
    for row in ("batch 16", "batch 64"):
        if (f32 := got.get((row, "paged-jax float32"))) is not None:
            bar(f"{model} {row}: float32 >= {CHAIN_SHARE:.0%} of its matmul chain",
                [v / f32["limit_tok_s"] for v in f32["runs"]], CHAIN_SHARE)
    f32, bf16 = got.get(("batch 16", "paged-jax float32")), got.get(("batch 16",
                                                                     "paged-jax bfloat16"))
    if f32 and bf16:
        x = BF16_OVER_F32 if bf16_dot else common.NOT_SLOWER
        bar(f"{model} batch 16: bfloat16 >= {x}x float32",
            common.round_ratios(bf16["runs"], f32["runs"]), x)
    int8 = got.get(("batch 16", "paged-jax int8"))
    if f32 and int8 and model == "qwen2.5-coder-1.5b":
        bar(f"{model} batch 16: int8 >= {INT8_OVER_F32}x float32",
            common.round_ratios(int8["runs"], f32["runs"]), INT8_OVER_F32)
    return out


def add_targets(path: Path) -> list[dict]:
    """`python -m experiments.bench --targets FILE`: a results file's bars judged again from
    its stored rounds (the bars came after some runs)."""
    import json

    from paged_jax import precision

    data = json.loads(path.read_text())
    model = data["config"]["model"]
    dot = data["config"].setdefault("bf16_dot", precision.bf16_dot_here())  # the run's CPU
    data["targets"] = targets(model, data["rows"], data["default"], dot,
                              data.get("memory", {}).get("starved", False))
    path.write_text(json.dumps(data, indent=1, default=common._plain) + "\n")
    return data["targets"]


def report(rows: list[dict], sides: list) -> str:
    lines = ["| row | side | tok/s (median, +-spread) | ours / side | limit | share of limit |",
             "|---|---|---|---|---|---|"]
    for e in rows:
        ratio = (f"{e['ours_over_side']:.2f}x ({e['verdict']})" if "ours_over_side" in e
                 else "")
        lines.append(f"| {e['row']} | {e['side']} | {e['tok_s']:.1f} +-{e['spread']:.1f} | "
                     f"{ratio} | {e['limit']} ({e['limit_precision']}) {e['limit_tok_s']:.0f} | "
                     f"{e['share_of_limit']:.0%} |")
    lines.append("\nSettings per side:")
    lines += [f"  {s.name}: {s.settings}" for s in sides]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=["ours", "ours-xla", "ours-bf16", "ours-int8",
                                                    "ours-int4", "hf", "vllm", "llamacpp"])
    ap.add_argument("--rows", nargs="+", default=list(ROWS),
                    help=f"rows to run, of {list(ROWS) + list(EXTRA_ROWS)}")
    ap.add_argument("--name", default=None, help="results file name (default: bench[_MODEL])")
    ap.add_argument("--hf-dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="HF generate()'s sides (a 1.5B in both does not fit beside the rest)")
    ap.add_argument("--quick", action="store_true", help="tiny rows (a smoke test)")
    ap.add_argument("--targets", type=Path, metavar="FILE",
                    help="judge a results file's bars again from its rounds, run nothing")
    a = ap.parse_args(argv)
    if a.targets:
        for t in add_targets(a.targets):
            print(f"{t['target']}: {t['verdict']} (worst {t['worst']:.2f}, best {t['best']:.2f})")
        return {"targets": a.targets}
    from experiments import serving as sv

    parts = sv.real_model("float32", a.model)
    rows = QUICK_ROWS if a.quick else {r: {**ROWS, **EXTRA_ROWS}[r] for r in a.rows}
    # The limits before any side holds its copy of the model (measured while the 1.5B's
    # engines were held, its limits ran 24 GB out and the rounds were lost), and again once
    # every side has let its copy go (`higher`).
    work = {r: _workload(parts[2], n, caching) for r, (n, _, caching) in rows.items()}
    weights = ["float32"] + ["bfloat16"] * ("ours-bf16" in a.sides or "vllm" in a.sides or (
        "hf" in a.sides and "bfloat16" in a.hf_dtypes)) + [q for q in QUANTIZED
                                                          if f"ours-{q}" in a.sides]
    weights += ["gguf"] * ("llamacpp" in a.sides and any(n == 1 for n, *_ in rows.values()))
    lim = {w: limits(parts, rows, work, w, a.model) for w in weights}  # each side's own
    gc.collect()
    choice = default_choice(a.model, parts)
    sides = make_sides(a.sides, a.model, parts, any(c for *_, c in rows.values()),
                       tuple(a.hf_dtypes), integer_pages=choice["kv_cache_dtype"]
                       if choice["weights"] == "int8" else "auto")
    try:
        m = measure(sides, rows, parts[2], a.rounds)
    finally:
        for s in sides:
            s.close()
        gc.collect()
    lim = {w: higher(lim[w], limits(parts, rows, work, w, a.model)) for w in weights}
    table = summarize(sides, rows, m, lim)
    extra = {k: v for s in sides for k, v in s.versions.items()}
    from paged_jax import precision

    default, dot = default_side(choice), precision.bf16_dot_here()
    payload = dict(config=dict(model=a.model, rounds=a.rounds, rows={r: dict(
        batch=n, tokens=t, prefix_caching=c) for r, (n, t, c) in rows.items()},
        limits=LIMITS, greedy=True, ignore_eos=True, bf16_dot=dot),
        sides={s.name: s.settings for s in sides}, limits=lim["float32"], limits_by_precision=lim,
        rows=table, memory=(memory := memory_check(m)),
        default=default, default_choice={k: choice[k] for k in ("side", "kv_cache_dtype")},
        versus=versus(table, default),
        targets=targets(a.model, table, default, dot, memory["starved"]))
    name = a.name or ("bench" + ("" if a.model == "smollm2" else f"_{a.model}")
                      + ("_quick" if a.quick else ""))
    payload["json"] = str(common.save_json(name, payload, extra))
    print(report(table, sides))
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
