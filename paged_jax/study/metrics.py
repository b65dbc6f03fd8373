"""Serving measurements: request latencies, KV memory breakdown, throughput, roofline.

Latency (per request, the paper's Sec. 6.1 metric first):
    normalized latency = (finish - arrival) / output tokens        seconds per token
    TTFT = first token - arrival;  TPOT = (finish - first token) / (output tokens - 1)

KV memory breakdown (paper Fig. 2), counted in token positions after each step and averaged
(weighted by iterations: a decode window counts W) over the steps where something runs.
For each running sequence with `stored` tokens whose K/V are in the cache, final length
`final` = prompt + output, and a reservation of `r` blocks made at admission (0 if paging):
    allocated = ceil(stored / block_size) blocks;  held = max(r, allocated) blocks
    token states          stored                               positions holding real K/V
    reserved (future)     min(held * bs, final) - allocated * bs   positions reserved now that
                                                                   this request fills later
    internal fragmentation  held * bs - stored - future        unused positions of the allocated
                          last block + reserved positions no token will ever fill (over-reservation)
    external fragmentation  free positions in contiguous holes too small for the reservation of
                          the request at the head of the queue (baselines' first-fit arena);
                          0 under paging, where any free block is usable.
The paper reports these as shares of the KV memory in use (their sum).

Roofline: a decode step must read all weights and the K/V of every cached token, so
    achieved bandwidth = (weight bytes + KV bytes read) per step / step time
is compared with the machine's memory bandwidth, measured in the same run by reading a large
array on every core (`measure_bandwidth`), and only weights a step reads count: an untied
embedding table is looked up a row per token (`streamed_weight_bytes`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from paged_jax.engine.sequence import Status
from paged_jax.sizes import cdiv
from paged_jax.study.reservation import true_len

CATEGORIES = ("token_states", "reserved_future", "internal_frag", "external_frag")


# ---- latency ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    """One request's clock times (same clock for all fields) and output size."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0


def latency_summary(timings: list[Timing]) -> dict:
    """Means (and p50/p90 of normalized latency) over finished requests."""
    done = [t for t in timings if t.finished is not None and t.output_tokens > 0]
    if not done:
        return dict(n=0)
    norm = np.array([(t.finished - t.arrival) / t.output_tokens for t in done])
    ttft = np.array([t.first_token - t.arrival for t in done])
    tpot = np.array([(t.finished - t.first_token) / max(1, t.output_tokens - 1) for t in done])
    return dict(n=len(done), normalized_latency=float(norm.mean()),
                normalized_latency_p50=float(np.median(norm)),
                normalized_latency_p90=float(np.percentile(norm, 90)),
                ttft=float(ttft.mean()), tpot=float(tpot.mean()),
                e2e=float(np.mean([t.finished - t.arrival for t in done])))


# ---- KV memory breakdown ---------------------------------------------------------------------
def kv_snapshot(engine) -> dict:
    """Token positions per category (see the module docstring) in the engine's state right now."""
    sch, bs = engine.scheduler, engine.config.block_size
    out = dict.fromkeys(CATEGORIES, 0) | {"blocks_private": 0}
    for req in sch.running:
        r = cdiv(sch.policy.reserved_tokens(req), bs)
        final = true_len(req)
        for s in req.seqs:
            if s.status is not Status.RUNNING:
                continue
            alloc = cdiv(s.num_computed, bs)
            held = max(r, alloc) * bs
            future = max(0, min(held, final) - alloc * bs)
            out["token_states"] += s.num_computed
            out["reserved_future"] += future
            out["internal_frag"] += held - s.num_computed - future
            out["blocks_private"] += alloc  # what it would hold with nothing shared
    head = sch.waiting[0] if sch.waiting else None
    out["external_frag"] = sch.policy.external_fragmentation(head) * bs
    out["blocks_used"] = engine.kv.blocks_used()  # cached-free blocks count as free
    return out


def breakdown(snapshots: list[dict], weights: list[float]) -> dict:
    """Time-weighted shares of each category in the KV memory in use (sums to 1)."""
    tot = dict.fromkeys(CATEGORIES, 0.0)
    for snap, w in zip(snapshots, weights, strict=True):
        for c in CATEGORIES:
            tot[c] += w * snap[c]
    s = sum(tot.values())
    return {c: (tot[c] / s if s else 0.0) for c in CATEGORIES}


# ---- bandwidth and roofline ------------------------------------------------------------------
def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: a large array max-reduced on every core at once
    (numpy drops the GIL), best of repeats. What a batch-1 decode needs is reading: a
    one-thread copy (reads + writes) measured 26 GB/s on a 2-core EPYC where two readers
    reach 33-34 GB/s and our bfloat16 decode went past the copy's figure."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    parts = np.array_split(np.ones(nbytes // 8, np.int64), os.cpu_count() or 1)
    best = float("inf")
    with ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.maximum.reduce, parts))
            best = min(best, time.perf_counter() - t0)
    return sum(p.nbytes for p in parts) / best


def weight_bytes(params) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(params)))


def streamed_weight_bytes(params) -> int:
    """Weight bytes a decode step reads: all of them, less an untied embedding table (a
    token reads one row of it; a tied one is the LM head, read whole)."""
    untied = "lm_head" in params and "embed" in params
    return weight_bytes(params) - (weight_bytes(params["embed"]) if untied else 0)


def gguf_streamed_bytes(path) -> int:
    """The weight bytes a decode step of llama.cpp reads from a GGUF file: every matrix in
    its own type (Q4_K, Q6_K, ...), less the embedding table when an output matrix is there
    (a token reads one row of it; without one it is the LM head, read whole)."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) >= 2]
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def kv_bytes_per_token(model_config, dtype) -> int:
    """K and V bytes of one token over all layers."""
    item = np.dtype(dtype).itemsize
    return 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * item


def roofline(stats, snapshots: list[dict], params, model_config, bandwidth: float) -> dict:
    """Achieved bytes/s of the steps (weights + cached K/V read per step) vs `bandwidth`."""
    wb = streamed_weight_bytes(params)
    kvt = kv_bytes_per_token(model_config, jax.tree.leaves(params)[0].dtype)
    moved = sum(st.num_steps * (wb + kvt * snap["token_states"])
                for st, snap in zip(stats, snapshots, strict=True) if st.num_steps)
    busy = sum(st.duration for st in stats if st.num_steps)
    achieved = moved / busy if busy else 0.0
    return dict(weight_bytes=wb, kv_bytes_per_token=kvt, achieved_bytes_per_s=achieved,
                machine_bytes_per_s=bandwidth, fraction_of_bandwidth=achieved / bandwidth)


def throughput(timings: list[Timing], span: float) -> dict:
    """Requests/s and output tokens/s over `span` seconds."""
    done = [t for t in timings if t.finished is not None]
    toks = sum(t.output_tokens for t in done)
    return dict(requests_per_s=len(done) / span if span else 0.0,
                output_tokens_per_s=toks / span if span else 0.0, output_tokens=toks)
