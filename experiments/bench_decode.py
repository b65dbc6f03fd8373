"""Decode throughput of the default model (SmolLM2-135M, fp32) on the paged cache, and load times.

    python -m experiments.bench_decode [--batches 1 32] [--prompt-len 64] [--steps 32]

Load: cold = GGUF parse + dequantize + params-cache write into a fresh cache dir; cached = its read.
Decode: after a prefill and one warm-up step (compile), `--steps` decode steps of the whole
batch, each a full host round trip (models/runner.py: jitted paging plan + jitted forward +
host argmax). Bandwidth counts the bytes a decode step must read at least (all params + the
batch's live KV) against a measured host memory copy bandwidth.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np

from experiments.common import save_json
from paged_jax.attention import default_backend
from paged_jax.models import load_model
from paged_jax.models.runner import runner_for


def timed_load() -> tuple[float, float, tuple]:
    """(cold s, cached s, loaded model) through a fresh params cache."""
    times = []
    with tempfile.TemporaryDirectory() as tmp, _env("PAGED_JAX_CACHE", tmp):
        for _ in range(2):
            t0 = time.perf_counter()
            model = jax.block_until_ready(load_model())
            times.append(time.perf_counter() - t0)
    return times[0], times[1], model


class _env:
    """Temporarily sets an environment variable."""

    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value

    def __enter__(self) -> None:
        import os

        self.old = os.environ.get(self.key)
        os.environ[self.key] = self.value

    def __exit__(self, *exc: object) -> None:
        import os

        if self.old is None:
            os.environ.pop(self.key, None)
        else:
            os.environ[self.key] = self.old


def copy_bandwidth_gbs(mib: int = 512) -> float:
    """Host memory bandwidth: bytes read + written per second by a large numpy copy."""
    a = np.ones(mib << 18, np.float32)
    b = np.empty_like(a)
    best = min(_time(lambda: np.copyto(b, a)) for _ in range(3))
    return 2 * a.nbytes / best / 1e9


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_batch(model: tuple, batch: int, prompt_len: int, steps: int) -> dict:
    config, params, _ = model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    runner = runner_for(config, params, batch, prompt_len + steps + 2,
                        backend=default_backend(), shuffle_seed=0)
    t0 = time.perf_counter()
    last = runner.step(prompts).argmax(-1)
    prefill_s = time.perf_counter() - t0  # includes compile
    last = runner.step([[int(t)] for t in last]).argmax(-1)  # compile the decode step
    t0 = time.perf_counter()
    for _ in range(steps):
        last = runner.step([[int(t)] for t in last]).argmax(-1)
    dt = (time.perf_counter() - t0) / steps
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    ctx = prompt_len + 1 + steps / 2
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * ctx * batch
    return dict(batch=batch, prompt_len=prompt_len, steps=steps,
                prefill_with_compile_s=round(prefill_s, 3), step_ms=round(dt * 1e3, 2),
                tokens_per_s=round(batch / dt, 1),
                achieved_gbs=round((param_bytes + kv_bytes) / dt / 1e9, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    cold, cached, model = timed_load()
    print(f"load: cold {cold:.2f}s, cached {cached:.2f}s")
    bw = copy_bandwidth_gbs()
    print(f"host copy bandwidth: {bw:.1f} GB/s")
    rows = []
    for b in args.batches:
        rows.append(bench_batch(model, b, args.prompt_len, args.steps))
        print(rows[-1])
    path = save_json("bench_decode", dict(
        model="SmolLM2-135M-Instruct.Q4_1 (dequantized, fp32)", backend=default_backend(),
        load_cold_s=round(cold, 2), load_cached_s=round(cached, 2),
        host_copy_gbs=round(bw, 1), decode=rows,
    ))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
