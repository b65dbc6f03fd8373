"""Multi-turn chat on the hybrid KV cache with prefix caching on (the defaults): does the
prefix-hit rate hold as the pool fills, and what does it cost?

    python -m experiments.sliding_window_kv            (runs this as its part 3)

Workload: CONVERSATIONS chats share a SYSTEM-token system prompt longer than Gemma 3's
512-token window; each of TURNS turns sends the whole conversation so far (system prompt,
earlier turns and answers) plus a new USER-token message and generates ANSWER tokens (greedy,
ignore_eos). All conversations' turn t run as one batch; turn t + 1's prompts continue turn
t's outputs, so each can hit the cache up to the end of its previous answer, past the window.
A sliding group must then hold the window's blocks before the hit point (cache/prefix_cache.py).

Pool sizes: `occupancy` is the KV the whole workload would keep with one group (every
conversation's final context, the system prompt once) over the pool's bytes, from 10% (every
block stays cached) past 100% (the cache must evict). Both layouts get the same bytes. The
hit rate (prompt tokens served from the cache over prompt tokens, vLLM's definition) is a
count: it has no run-to-run noise, and it is measured on the layout model of
sliding_window_engine.py (Gemma 3's KV layout, head dim 32, tiny everything else). Throughput
(output tokens over the whole run's seconds, prefill included) is measured on the real 270M
model where it is loaded (sliding_window_kv's default), else on the layout model, whose steps
are mostly the engine's bookkeeping; layouts alternate in paired rounds (experiments/
common.py's rule), a fresh engine each.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from experiments import common
from experiments import sliding_window_engine as sw
from paged_jax.sampling_params import SamplingParams
from paged_jax.sizes import cdiv

SYSTEM, USER, ANSWER, TURNS, CONVERSATIONS = 600, 96, 32, 4, 8
OCCUPANCIES = (0.1, 0.25, 0.5, 0.75, 0.95, 1.5, 3.0)


@dataclasses.dataclass(frozen=True)
class Workload:
    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn] -> the message's token ids

    @property
    def final_len(self) -> int:
        return SYSTEM + TURNS * (USER + ANSWER)


def workload(vocab: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(3, vocab - 1, n).tolist()  # noqa: E731
    return Workload(ids(SYSTEM), [[ids(USER) for _ in range(TURNS)]
                                  for _ in range(CONVERSATIONS)])


def one_group_bytes(parts, block: int = 16) -> int:
    """KV bytes the finished workload keeps in one group of every layer (float32): every
    conversation's blocks, the system prompt's full blocks once."""
    c = parts[0]
    per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * block
    blocks = CONVERSATIONS * cdiv(SYSTEM + TURNS * (USER + ANSWER), block)
    return per_block * (blocks - (CONVERSATIONS - 1) * (SYSTEM // block))


def chat(llm, w: Workload) -> dict:
    """Runs the workload's turns on `llm`; the hit rate, output tok/s and the decode batch."""
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=ANSWER, ignore_eos=True, temperature=0.0)
    history = [list(w.system) for _ in range(CONVERSATIONS)]
    eng.recorder = steps = []
    made, t0 = 0, time.perf_counter()
    for turn in range(TURNS):
        prompts = [h + u[turn] for h, u in zip(history, w.users, strict=True)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        history = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
        made += sum(len(o.outputs[0].token_ids) for o in outs)
    secs = time.perf_counter() - t0
    eng.recorder = None
    prefix = eng.kv.prefix
    return dict(hit_rate=prefix.hit_rate, tok_s=made / secs, seconds=secs,
                decode_batch=sw._decode_batch(steps), evicted=prefix.evicted,
                preemptions=eng.scheduler.num_preempted, outputs=history)


def run(parts, occupancies=OCCUPANCIES, rounds: int = common.MIN_ROUNDS,
        speed_parts=None) -> dict:
    """Both layouts at each occupancy (hit rates: one pass each, counts), then tok/s at the
    highest occupancy up to 95% (every block cached, nothing evicted) in paired rounds, on
    `speed_parts` (the real model) when given, else on `parts`."""
    w, need = workload(parts[0].vocab_size), one_group_bytes(parts)
    rows, saturation = [], max(o for o in occupancies if o <= 0.95)
    for occ in occupancies:
        got = {name: _chat_on(parts, hybrid, int(need / occ), w)
               for name, hybrid in sw.LAYOUTS.items()}
        same = got["hybrid"].pop("outputs") == got["one group"].pop("outputs")
        one, hyb = got["one group"]["hit_rate"], got["hybrid"]["hit_rate"]
        rows.append(dict(occupancy=occ, budget_bytes=int(need / occ), same_tokens=same,
                         hit_ratio=hyb / one if one else float("inf"), **{
                             f"{k}_{'hybrid' if n == 'hybrid' else 'one'}": v
                             for n, r in got.items() for k, v in r.items()}))
    print(common.table(rows, ["occupancy", "hit_rate_one", "hit_rate_hybrid", "hit_ratio",
                              "evicted_one", "evicted_hybrid", "decode_batch_one",
                              "decode_batch_hybrid", "pool_blocks_one", "pool_blocks_hybrid",
                              "same_tokens"]))
    speed = speed_parts or parts
    speed_work, speed_need = workload(speed[0].vocab_size), one_group_bytes(speed)
    for name in sw.LAYOUTS:  # warm-up: this run's programs compiled before any timing
        _chat_on(speed, sw.LAYOUTS[name], int(speed_need / saturation), speed_work)
    runs = {name: [] for name in sw.LAYOUTS}
    for r in range(rounds):  # a fresh engine (a cold cache) per run, layouts alternating
        for name in common.rotated(list(sw.LAYOUTS), r):
            runs[name].append(_chat_on(speed, sw.LAYOUTS[name],
                                       int(speed_need / saturation), speed_work)["tok_s"])
    print(f"tok/s at {saturation:.0%}: " + ", ".join(f"{n} {v}" for n, v in runs.items()))
    return dict(workload=dict(system=SYSTEM, user=USER, answer=ANSWER, turns=TURNS,
                              conversations=CONVERSATIONS, one_group_bytes=need),
                rows=rows, saturation=dict(occupancy=saturation, tok_s_runs=runs,
                                           model="real" if speed_parts else "layout"),
                targets=targets(rows, runs))


def _chat_on(parts, hybrid: bool, budget: int, w: Workload) -> dict:
    """`chat` on a fresh engine of `budget` KV bytes (defaults: prefix caching on)."""
    llm = sw._engine(parts, hybrid, budget, w.final_len + 64, 512, CONVERSATIONS)
    return dict(chat(llm, w), pool_blocks=llm.llm_engine.config.cache.usable_blocks)


def targets(rows: list[dict], runs: dict[str, list[float]]) -> dict:
    """Issue 58's bars: hybrid's hit rate >= 0.95x one group's at every occupancy from 10%
    to 95%, and its tok/s there not below one group's (the one rule's "not slower" bound,
    common.NOT_SLOWER)."""
    low = [r for r in rows if r["occupancy"] <= 0.95]
    return dict(hit_ratio_min=min(r["hit_ratio"] for r in low),
                hit_ratio_met=all(r["hit_ratio"] >= 0.95 for r in low),
                same_tokens=all(r["same_tokens"] for r in rows),
                throughput=common.not_slower(runs["hybrid"], runs["one group"]),
                rule=common.RULE)
