"""Driving the engine through a timed workload, shared by the serving experiments.

Clock. Experiments run on a virtual clock: it advances by each engine step's measured wall
duration, and when nothing runs it jumps to the next arrival. So latencies are real compute
times, but a 2-core CPU does not sit idle waiting for requests (equivalent to real time with
instant idle periods). Requests join between steps, as in a real server loop. With
`cost=GpuCostModel()` the clock advances instead by the step's modeled time on the paper's
GPU (paged_jax/study/cost_model.py); the engine still runs every step for real.

Compilation. The first steps of a configuration compile (seconds on CPU); `warm_up` runs a
short mixed workload first so no measured step compiles, and the persistent XLA cache
(paged_jax/compile_cache.py) makes reruns fast.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from paged_jax.engine import Engine, EngineConfig
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from paged_jax.sampling_params import SamplingParams
from paged_jax.study.cost_model import GpuCostModel
from paged_jax.study.metrics import Timing, kv_snapshot
from paged_jax.study.reservation import policy_for
from paged_jax.study.workloads import WorkItem, text_prompt

POLICIES = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
# One engine shape for the tiny-model experiments (compiled once, reused everywhere).
# Prefix caching is off: the paper's experiments have none, and our synthetic prompts share
# their text's opening, which would turn every run into a prefix-cache benchmark.
TINY = dict(block_size=16, num_kv_blocks=129, max_num_seqs=32, max_num_batched_tokens=256,
            max_model_len=512, decode_window=8, enable_prefix_caching=False)
# The real model (SmolLM2-135M) at CPU scale.
REAL = dict(block_size=16, num_kv_blocks=257, max_num_seqs=16, max_num_batched_tokens=256,
            max_model_len=512, decode_window=8, enable_prefix_caching=False)


@functools.cache
def tiny_model():
    """(config, params, tokenizer) of the 2-layer random byte-level model."""
    c = tiny_config()
    return c, random_params(c), byte_tokenizer()


@functools.cache
def real_model(dtype: str = "float32", name: str = "smollm2"):
    """(config, params, tokenizer) of a shipped model (the default SmolLM2-135M-Instruct)."""
    import jax.numpy as jnp

    from paged_jax.models import load_model
    return load_model(name, {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype])


def make_engine(parts, reservation: str = "paged", **config) -> Engine:
    """An engine on `parts` admitting under a reservation policy (study/reservation.py)."""
    ec = EngineConfig(**config)
    return Engine(*parts, ec, policy=policy_for(reservation, ec))


@dataclasses.dataclass
class Run:
    """What one served workload produced."""

    timings: list[Timing]
    snapshots: list[dict]
    stats: list
    span: float  # virtual seconds from the first arrival to the last finish
    outputs: dict


def warm_up(parts, config: dict, n: int | None = None, items=None) -> float:
    """Compiles the shapes a run will use: a burst of mixed prompts, then decode windows;
    then `items` served once under paging (its large batches need shapes of their own)."""
    t0 = time.perf_counter()
    if items:
        burst = [dataclasses.replace(w, arrival=0.0) for w in items]
        serve(make_engine(parts, **{**config, "reservation": "paged"}), burst)
    eng = make_engine(parts, **config)
    n = n or min(12, config["max_num_seqs"])
    tok = parts[2]
    lens = [1 + (i * 37) % max(2, config["max_model_len"] // 2) for i in range(n)]
    for i, m in enumerate(lens):
        out = min(12, config["max_model_len"] - m)
        eng.add_request(f"w{i}", {"prompt_token_ids": text_prompt(m, tok)},
                        SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True))
        if i % 3 == 2:
            eng.step()  # admissions mixed with decodes: ragged steps of several sizes
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def serve(engine: Engine, items: list[WorkItem], params=None, on_step=None,
          cost: GpuCostModel | None = None) -> Run:
    """Serves `items` at their arrival times on the virtual clock (module docstring).

    Args:
      engine: a fresh engine.
      items: the workload.
      params: item -> SamplingParams (default: greedy, exactly output_len tokens).
      on_step: called after each step (progress bars).
      cost: advance the clock by this model's modeled step time instead of the measured one.
    """
    pending = sorted(items, key=lambda w: w.arrival)
    if engine.recorder is None:  # kept across calls on one engine (multi-turn runs)
        engine.recorder = []
    timings = {w.request_id: Timing(w.arrival) for w in items}
    snaps, outputs, clock, i = [], {}, pending[0].arrival if pending else 0.0, 0
    while i < len(pending) or engine.has_unfinished():
        while i < len(pending) and pending[i].arrival <= clock:
            w = pending[i]
            engine.add_request(w.request_id, {"prompt_token_ids": w.prompt_token_ids},
                               params(w) if params else w.params(), arrival_time=w.arrival)
            i += 1
        if not engine.has_unfinished():
            clock = pending[i].arrival
            continue
        t0 = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        snaps.append(kv_snapshot(engine))
        clock += wall if cost is None else cost.last_step_seconds(engine,
                                                                  snaps[-1]["token_states"])
        for o in outs:
            _record(timings[o.request_id], o, clock)
            if o.finished:
                outputs[o.request_id] = o
        if on_step:
            on_step()
    span = clock - (pending[0].arrival if pending else 0.0)
    return Run(list(timings.values()), snaps, list(engine.recorder), span, outputs)


def _record(t: Timing, out, clock: float) -> None:
    n = sum(len(c.token_ids) for c in out.outputs)
    if n and t.first_token is None:
        t.first_token = clock
    if out.finished:
        t.finished, t.output_tokens = clock, n


def step_weights(run: Run) -> list[float]:
    """Decode iterations of each step (windows count W): snapshots are averaged per iteration,
    which, unlike wall time, does not depend on machine load."""
    return [float(s.num_steps) for s in run.stats]


def mean_running(run: Run) -> float:
    """Time-averaged number of running requests."""
    busy = [(s.duration, s.running) for s in run.stats if s.num_steps]
    tot = sum(d for d, _ in busy)
    return sum(d * r for d, r in busy) / tot if tot else 0.0


def roof(run: Run, parts) -> dict:
    """The roofline line of a run: achieved GB/s (weights + cached K/V read per step) and its
    share of the copy bandwidth measured in this run (a cached figure from another machine
    would be the wrong limit)."""
    from paged_jax.study.metrics import measure_bandwidth, roofline

    bandwidth = measure_bandwidth()
    r = roofline(run.stats, run.snapshots, parts[1], parts[0], bandwidth)
    return dict(achieved_GBps=r["achieved_bytes_per_s"] / 1e9,
                fraction_of_bandwidth=r["fraction_of_bandwidth"],
                bandwidth_GBps=bandwidth / 1e9)
