"""Where a step's time goes: `python -m experiments.step_profile [--model smollm2]`.

For batch 1, 16 and 64 and each of float32 and bfloat16 weights, `LLM`'s engine (async
scheduling; on CPU the C++ matmul kernel, bfloat16 panels for bfloat16 weights) runs its
requests once to compile, then again with jax.profiler tracing: the prefill steps (every
request's prompt and first token) and, separately, a run of decode steps. XLA's optimized
programs, dumped by this process, name every operation a traced thunk ran and the named
scope it came from (models/llama.py, models/rope.py, engine/step.py), so device time splits
by kind:

    matmul       XLA's dots and the C++ matmul kernel (projections and the LM head)
    attention    the attention kernel (and the reference's ops, on that backend)
    norm, rope, kv_write, activation, sampling, bookkeeping (the allocator's ops,
                 admissions, settle and report)
    other        the rest the device ran (embedding, residual adds, copies, ...)

beside the step's wall time and the device's busy time (the union of its thunks' intervals:
what is left is the host's, and the gaps between launches). The limits are bench.py's: the
bandwidth roofline at batch 1, the model's matmul chain at larger batches. Writes
results/step_profile.json with provenance.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from pathlib import Path

DUMP = Path(tempfile.gettempdir()) / "step_profile_hlo_unset"  # dump_programs sets it


def dump_programs() -> None:
    """Has XLA dump the engine's optimized programs into a fresh folder, and the compile cache
    off (a program loaded from it is not compiled, so XLA would dump nothing for it; compile_
    cache.py reads the switch when an engine starts). XLA reads its flags when the backend
    starts: main calls this before anything runs on a device (not at import, so that
    experiments.run_all can import this module beside the others)."""
    global DUMP
    DUMP = Path(tempfile.mkdtemp(prefix="step_profile_hlo_"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                               " --xla_dump_hlo_module_re=.*(run_step|decode_window).*")
    os.environ["PAGED_JAX_COMPILE_CACHE"] = "0"

KINDS = ("matmul", "attention", "norm", "rope", "kv_write", "activation", "sampling",
         "bookkeeping")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16", "int8", "int4"],
                    help="weight types: int8 / int4 are LLM(quantization=...) on the float32 "
                         "model (float32 activations and pages)")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps traced")
    ap.add_argument("--quick", action="store_true",
                    help="float32 at batch 1 and 4, 4 decode steps")
    return ap.parse_args(argv)


def kind_of(op_name: str, target: str, op: str, body: str) -> str:
    """An operation's kind: by the kernel it calls, by the named scope it came from, or by
    a dot inside the fusion."""
    if "matmul" in target or op == "dot" or " dot(" in body:
        return "matmul"
    if "attention" in target:
        return "attention"
    scopes = op_name.split("/")
    for kind in KINDS:
        if kind in scopes:
            return kind
    return "other"


def instruction_kinds(module_text: str) -> dict[str, str]:
    """{instruction name: kind} of one optimized HLO module; a fusion's kind reads its
    fused computation (a dot inside makes it a matmul)."""
    bodies = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", module_text, re.S | re.M))
    out = {}
    for line in module_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^=]*? ([a-z\-]+)\(", line)
        if not m:
            continue
        name, op = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = bodies.get(called.group(1), "") if called else ""
        out[name] = kind_of(op_name.group(1) if op_name else "", target.group(1) if target
                            else "", op, " " + body)
    return out


def modules(since: float = 0.0) -> dict[str, dict[str, str]]:
    """{dumped module file: its instruction kinds}, optimized modules dumped at or after
    `since` (time.time()) only: thunk names such as loop_fusion.12 recur in every program, so
    only the engine being profiled may offer its programs."""
    return {p.name: instruction_kinds(p.read_text())
            for p in DUMP.glob("*after_optimizations.txt") if p.stat().st_mtime >= since}


def trace_events(trace_dir: str) -> list[dict]:
    import glob
    import gzip
    import json

    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))
    return [e for e in (events["traceEvents"] if isinstance(events, dict) else events)
            if e.get("ph") == "X"]


def attribute(events: list[dict], mods: dict[str, dict[str, str]]) -> dict:
    """Device time by kind: each thunk event is read against the dumped module that names the
    most of the traced events (one program runs a phase's steps)."""
    if not mods:
        raise RuntimeError(f"XLA dumped no programs into {DUMP}: the backend started before "
                           "dump_programs() set its flags")
    names = [e["name"].removeprefix("end: ") for e in events]
    best = max(mods.values(), key=lambda m: sum(n in m for n in names), default={})
    by_kind: dict[str, float] = {}
    spans = []
    for e, n in zip(events, names, strict=True):
        if n in best:
            by_kind[best[n]] = by_kind.get(best[n], 0.0) + e.get("dur", 0.0)
            spans.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    return dict(us_by_kind=by_kind, busy_us=_union(spans), thunks=len(spans))


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def traced(fn, trace_dir: str) -> tuple[float, object]:
    import jax

    with jax.profiler.trace(trace_dir):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def phase_row(phase: str, batch: int, wall: float, steps: int, att: dict) -> dict:
    ms = {k: v / 1e3 / steps for k, v in att["us_by_kind"].items()}
    step_ms = 1e3 * wall / steps
    busy = att["busy_us"] / 1e3 / steps
    return dict(phase=phase, batch=batch, steps=steps, step_ms=step_ms, device_busy_ms=busy,
                host_and_gaps_ms=step_ms - busy, ms_by_kind=ms,
                share_by_kind={k: v / sum(ms.values()) for k, v in ms.items()} if ms else {},
                matmul_share_of_step=ms.get("matmul", 0.0) / step_ms)


def run_batch(llm, prompts: list[list[int]], decode_steps: int, since: float) -> list[dict]:
    """The prefill row (every prompt and its first token) and the decode row (decode_steps
    steps of the whole batch), each after an untraced pass of the same shapes."""
    from paged_jax import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Long enough that the first prompts still run when the last one is admitted (a prefill
    # step holds at least one prompt's tokens) and for decode_steps more.
    many = SamplingParams(temperature=0.0, max_tokens=decode_steps + 4 + len(prompts),
                          ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, many, use_tqdm=False)  # compiles every program both rows run
    eng, rows, b = llm.llm_engine, [], len(prompts)
    with tempfile.TemporaryDirectory() as d:
        eng.recorder = steps = []
        wall, _ = traced(lambda: llm.generate(reqs, one, use_tqdm=False), d)
        n = sum(1 for s in steps if s.num_tokens)
        rows.append(phase_row("prefill", b, wall, n, attribute(trace_events(d), modules(since))))
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", {"prompt_token_ids": p}, many)
    eng.recorder = steps = []
    while not any(s.num_tokens == b and s.running == b for s in steps):
        if not eng.has_unfinished():
            raise RuntimeError(f"batch {b}: the requests ended before all {b} decoded at once")
        eng.step()  # the prefills, untraced, up to the first all-decode step
    with tempfile.TemporaryDirectory() as d:
        n0 = len(steps)
        wall, _ = traced(lambda: [eng.step() for _ in range(decode_steps)], d)
        n = sum(max(1, s.num_steps) for s in steps[n0:])
        rows.append(phase_row("decode", b, wall, n, attribute(trace_events(d), modules(since))))
    while eng.has_unfinished():
        eng.step()
    return rows


def main(argv: list[str] | None = None) -> dict:
    from experiments import common
    from experiments.bench import QUANTIZED, limits
    from experiments.prompts import prompt_ids
    from experiments.serving import real_model
    from paged_jax import LLM

    a = parse_args(argv)
    dump_programs()
    if a.quick:
        a.batches, a.decode_steps, a.dtypes = [1, 4], 4, ["float32"]
    rows, lim, backends = [], {}, {}
    for dtype in a.dtypes:
        quant = dtype if dtype in QUANTIZED else None
        parts = real_model("float32" if quant else dtype, a.model)
        since = time.time() - 1  # file times are coarser than the clock on some file systems
        llm = LLM(model_parts=parts, max_num_seqs=max(a.batches), enable_prefix_caching=False,
                  quantization=quant)
        backends[dtype] = llm.llm_engine.runner.matmul
        tok = parts[2]
        for b in a.batches:
            rows += [dict(r, dtype=dtype) for r in run_batch(llm, prompt_ids(tok, b),
                                                            a.decode_steps, since)]
            print(common.table(rows[-2:], ["dtype", "phase", "batch", "step_ms",
                                           "device_busy_ms", "host_and_gaps_ms",
                                           "matmul_share_of_step"]), flush=True)
        del llm  # one engine's weights and pages at a time
        work = {f"batch {b}": prompt_ids(tok, b) for b in a.batches}
        lim[dtype] = limits(parts, {f"batch {b}": (b, a.decode_steps, False)
                                    for b in a.batches}, work, dtype)  # its own precision's
    payload = dict(model=a.model, batches=a.batches, decode_steps=a.decode_steps,
                   dtypes=a.dtypes, matmul_backend=backends, rows=rows, limits=lim)
    payload["json"] = str(common.save_json("step_profile", payload))
    return payload


if __name__ == "__main__":
    main()
