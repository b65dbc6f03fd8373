"""The hybrid KV cache in the real engine: the sequences a fixed pool holds, and throughput at
memory saturation, one KV cache group for every layer ("one group", before) against
sliding-window groups ("hybrid", paged_jax/cache/groups.py). experiments/sliding_window_kv.py
runs these beside its block arithmetic.

Held: N requests of `context` prompt tokens (random ids, no shared prefix) run to completion
through `LLM`'s engine in a pool of `budget` bytes; after every step we count the sequences
that hold at least `context` computed tokens at once. N is what the block arithmetic says the
pool holds plus two, so the pool, not the request count, is the limit. Sequences that hold
their prompt decode while later prompts prefill, so the count is compared with the
arithmetic at the lengths they have then (a pool one sequence's margin past N fills up with
their decoded tokens before the last prompt is in). The weights are random
and everything but the KV layout (layers, KV heads, window, layer pattern) is tiny: the count
depends only on the layout and the allocator, and prefilling dozens of 32k-token prompts
through the real 270M model would take hours on this CPU. The head dim is cut to 32 with the
budget cut by the same factor (sliding_window_kv.main), so the pool has exactly the real
shape's block count while attention does an eighth of the work.

Throughput: the real model (its weights) at a context where the pool is the limit; output
tokens per second over the whole run (prefill included, as a user sees it) and the mean batch
of the decode steps, both layouts alternating, median of the rounds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from paged_jax.llm import LLM
from paged_jax.models.config import ModelConfig
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_gemma3_config
from paged_jax.sampling_params import SamplingParams

LAYOUTS = {"one group": False, "hybrid": True}


def layout_model(config: ModelConfig, max_len: int, head_dim: int | None = None) -> tuple:
    """Random (config, params, tokenizer) with `config`'s KV layout (its head dim, or
    `head_dim`) and tiny everything else (hidden 64, one query head per KV head, a byte
    vocabulary)."""
    c = tiny_gemma3_config(
        num_layers=config.num_layers, layer_types=config.layer_types,
        sliding_window=config.sliding_window, num_kv_heads=config.num_kv_heads,
        num_heads=config.num_kv_heads, head_dim=head_dim or config.head_dim, hidden_size=64,
        intermediate_size=64, max_position_embeddings=max_len)
    return c, random_params(c), byte_tokenizer()


def _engine(parts, hybrid: bool, budget: int, max_len: int, chunk: int, seqs: int,
            caching: bool = True) -> LLM:
    """`LLM`'s defaults (prefix caching on) but for the layout, pool and limits."""
    return LLM(model_parts=parts, hybrid_kv_cache=hybrid, enable_prefix_caching=caching,
               kv_cache_memory=budget, max_model_len=max_len, max_num_seqs=seqs,
               max_num_batched_tokens=chunk, async_scheduling=False)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab - 1, length).tolist()} for _ in range(n)]


def held(parts, context: int, hybrid: bool, budget: int, chunk: int = 512,
         max_seqs: int = 64, room: int = 1024) -> dict:
    """The most sequences of >= `context` computed tokens the engine held at once: requests
    run until the pool is full (a preemption) or every one holds its prompt; then aborted.

    Sequences that hold their prompt decode while later ones prefill, so at the count they
    are longer than `context`: `arithmetic_held` is the arithmetic at their mean length then
    (the pool's blocks over the blocks such a sequence holds)."""
    llm = _engine(parts, hybrid, budget, context + room, chunk, max_seqs)
    eng, cc = llm.llm_engine, llm.llm_engine.config.cache
    fits = cc.usable_blocks // cc.blocks_for(context)
    n = min(fits + 2, max_seqs)
    row = dict(context=context, layout="hybrid" if hybrid else "one group",
               groups=cc.num_groups, pool_blocks=cc.usable_blocks,
               blocks_per_seq=cc.blocks_for(context), arithmetic=fits, held=0, requests=n,
               refused=None, arithmetic_held=fits)
    sp = SamplingParams(max_tokens=room, ignore_eos=True)
    t0, peak = time.perf_counter(), 0
    try:
        for i, p in enumerate(_prompts(n, context, parts[0].vocab_size, 0)):
            eng.add_request(str(i), p, sp)
    except ValueError as e:  # a sequence that can never fit: the engine refuses it up front
        row["refused"] = str(e)
        return row
    while eng.has_unfinished() and not eng.scheduler.num_preempted:
        eng.step()
        seqs = [s for r in eng.scheduler.running for s in r.seqs]
        done = [cc.blocks_for(s.num_computed) for s in seqs if s.num_computed >= context]
        if len(done) > peak:
            peak, row["arithmetic_held"] = len(done), int(cc.usable_blocks * len(done)
                                                          // sum(done))
        if not eng.scheduler.waiting and all(s.num_computed >= context for s in seqs):
            break
    for i in range(n):
        eng.abort(str(i))
    row.update(held=peak, seconds=time.perf_counter() - t0)
    return row


def _decode_batch(steps: list) -> float:
    """Mean rows of the decode windows among an engine's recorded steps."""
    sizes = [s.num_tokens / s.num_steps for s in steps if s.kind == "window" and s.num_steps]
    return statistics.fmean(sizes) if sizes else 0.0


def throughput(parts, context: int, budget: int, requests: int, new_tokens: int,
               rounds: int, chunk: int = 512) -> list[dict]:
    """Output tok/s of `requests` prompts of `context` tokens at saturation, per layout."""
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    prompts = _prompts(requests, context, parts[0].vocab_size, 1)
    # Prefix caching off: every round sends the same prompts to the same engine, and the
    # hits of later rounds would skip prefill (more of them where the pool keeps more).
    llms = {name: _engine(parts, h, budget, context + new_tokens, chunk, requests, False)
            for name, h in LAYOUTS.items()}
    for llm in llms.values():  # warm-up: compile this run's programs
        llm.generate(prompts[:2], dataclasses.replace(sp, max_tokens=2), use_tqdm=False)
    runs: dict[str, list] = {name: [] for name in llms}
    for r in range(rounds):
        for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            eng = llms[name].llm_engine
            eng.recorder = steps = []
            t0 = time.perf_counter()
            outs = llms[name].generate(prompts, sp, use_tqdm=False)
            secs = time.perf_counter() - t0
            eng.recorder = None
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[name].append((made / secs, _decode_batch(steps),
                               sum(s.preempted for s in steps)))
    rows = []
    for name, got in runs.items():
        cc = llms[name].llm_engine.config.cache
        rows.append(dict(layout=name, context=context, requests=requests,
                         new_tokens=new_tokens, pool_blocks=cc.usable_blocks,
                         fits=cc.usable_blocks // cc.blocks_for(context + new_tokens),
                         tok_s=statistics.median(g[0] for g in got),
                         runs=[g[0] for g in got],
                         decode_batch=statistics.median(g[1] for g in got),
                         preemptions=statistics.median(g[2] for g in got)))
    return rows
