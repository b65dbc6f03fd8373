"""`make experiments`: every experiment the README quotes, at full scale (hours on 2 CPU
cores; `--skip NAME ...` leaves some out). The benchmarks against vLLM and llama.cpp include
them where `make peers` installed them."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from experiments import (
    async_scheduling,
    batch_under_budget,
    bench,
    bench_serving,
    block_size,
    kv_quantization,
    latency_vs_rate,
    long_prompt,
    lora,
    memory_breakdown,
    moe,
    nnx_step,
    preemption,
    routing,
    routing_bounds,
    sampling_sharing,
    scaling,
    shared_prefix,
    sliding_window_kv,
    snapshot,
    speculative,
    speculative_draft,
    step_profile,
    structured_outputs,
    test_times,
    weight_layout,
    weight_quantization,
)

VLLM = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"

FULL = [
    (memory_breakdown, dict(requests=96)),
    (latency_vs_rate, dict(requests=200, measured_requests=96, real_requests=12)),
    (batch_under_budget, dict(requests=96, budgets=(65, 129, 257))),
    # Block sizes 1 and 2 abort XLA:CPU here (LLVM: "Unable to allocate section memory").
    (block_size, dict(sizes=(4, 8, 16, 32, 64, 128, 256), requests=48)),
    (sampling_sharing, dict(requests=32)),
    (preemption, dict(sizes=(8, 16, 32, 64, 128, 256), requests=32)),
    (shared_prefix, dict(real=True)),
    (sliding_window_kv, dict()),
    (kv_quantization, dict(argv=[])),
    (routing, dict(argv=[])),
    (routing_bounds, dict(argv=[])),  # reads what routing labelled
    (scaling, dict(argv=[])),
    (weight_layout, dict(argv=[])),
    (weight_quantization, dict(argv=[])),
    (step_profile, dict(argv=[])),
    (bench, dict(argv=[])),
    (async_scheduling, dict(argv=[])),
    (long_prompt, dict(argv=[])),
    (speculative, dict(argv=[])),
    (speculative_draft, dict(argv=[])),
    (structured_outputs, dict(argv=[])),
    (moe, dict(argv=[])),
    (lora, dict(argv=[])),
    (nnx_step, dict(argv=[])),
    (snapshot, dict(argv=[])),
    (bench_serving, dict(argv=["--requests", "32", "--rates", "1", "2", "inf", "--offline"]
                          + (["--vllm-python", str(VLLM)] if VLLM.exists() else []))),
    (test_times, dict(argv=[])),  # `make test` cold and warm, last: it runs the suite twice
]


def main(skip: tuple[str, ...] = (), only: str | None = None) -> None:
    """Runs each experiment in a child process of its own, so an abort inside XLA (block size 1
    makes LLVM run out of JIT section memory) does not take the others down, and each starts
    with a clean JIT cache. Exits non-zero if any failed."""
    failed = []
    for mod, kwargs in FULL:
        name = mod.__name__.split(".")[-1]
        if only is not None:
            if name == only:
                mod.main(**kwargs)
            continue
        if name in skip:
            print(f"\n=== {mod.__name__}: skipped", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"\n=== {mod.__name__} {kwargs}", flush=True)
        cmd = [sys.executable, "-m", "experiments.run_all", "--only", name]
        rc = subprocess.run(cmd).returncode
        print(f"--- {mod.__name__}: {time.perf_counter() - t0:.0f} s"
              + (f", FAILED (exit status {rc})" if rc else ""), flush=True)
        if rc:
            failed.append(name)
    if failed:  # the others still ran; the run as a whole fails
        sys.exit(f"failed: {' '.join(failed)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", nargs="*", default=[], help="experiment names to leave out")
    ap.add_argument("--only", help="run just this experiment, in this process")
    args = ap.parse_args()
    main(tuple(args.skip), args.only)
