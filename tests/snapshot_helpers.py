"""A mixed workload for snapshot tests (tests/test_snapshot.py), and the worker that saves it
mid-run and dies (`python tests/snapshot_helpers.py PATH CONFIG STEPS`): the test restores
the snapshot in its own process and compares with a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_helpers import engine, prompts  # noqa: E402

from paged_jax.engine import snapshot  # noqa: E402
from paged_jax.engine.sequence import Status  # noqa: E402
from paged_jax.engine.speculative import SpeculativeConfig  # noqa: E402
from paged_jax.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

# A small pool and long prompts: requests get preempted (recomputed or swapped) mid-run,
# prompts take several chunks, and greedy, seeded and engine-seeded rows run side by side.
CONFIGS = {
    "sync": dict(num_kv_blocks=64, max_num_seqs=8, decode_window=4),
    "async": dict(num_kv_blocks=64, max_num_seqs=8, async_scheduling=True, decode_window=1),
    "swap": dict(num_kv_blocks=64, max_num_seqs=8, preemption_mode="swap",
                 swap_space=1 << 30),
    "spec": dict(num_kv_blocks=96, max_num_seqs=8, decode_window=1,
                 speculative=SpeculativeConfig(num_speculative_tokens=3,
                                               prompt_lookup_min=1, prompt_lookup_max=3)),
}


def workload(n: int = 64, beams: bool = True
             ) -> list[tuple[str, str, SamplingParams | BeamSearchParams]]:
    """Sampled requests of every kind and, every eighth from the second, a beam search (a
    sampled request there without `beams`)."""
    out = []
    for i in range(n):
        text = prompts(n)[i] + "abc abc " * (i % 5) + "x" * (40 * (i % 3))
        if beams and i % 8 == 1:  # shorter prompts: W beams must fit the small pool together
            out.append((f"r{i}", prompts(n)[i] + "abc " * (i % 5),
                        BeamSearchParams(beam_width=2 + i // 8 % 2, max_tokens=24 + i % 7)))
            continue
        kind = i % 4
        sp = SamplingParams(
            temperature=0.0 if kind == 0 else 0.9, seed=i if kind == 1 else None,
            max_tokens=8 + (i * 7) % 29, n=2 if kind == 3 else 1, top_p=0.9 if kind == 2
            else 1.0, logprobs=2 if i % 5 == 0 else None, stop=["zz"] if i % 6 == 0 else None)
        out.append((f"r{i}", text, sp))
    return out


def add(eng, rid: str, prompt: str, params) -> None:
    if isinstance(params, BeamSearchParams):
        eng.add_beam_request(rid, prompt, params)
    else:
        eng.add_request(rid, prompt, params)


def build(name: str):
    return engine(check=True, **CONFIGS[name])


def finish(eng, done: dict | None = None) -> dict:
    done = dict(done or {})
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason)
                                        for c in out.outputs]
    return done


def states(eng) -> dict[str, int]:
    """How many sequences are mid-prefill, decoding, waiting, preempted or swapped."""
    count = {"prefill": 0, "decode": 0, "waiting": 0, "preempted": 0, "swapped": 0,
             "beams": 0}
    for req in eng.requests.values():
        count["preempted"] += req.num_preemptions > 0
        count["beams"] += req.beam is not None and bool(req.forked)  # mid-search
        for s in req.seqs:
            count["swapped"] += s.swapped is not None
            if s.status == Status.WAITING or s.slot < 0:
                count["waiting"] += 1
            elif s.num_computed < s.prompt_len:
                count["prefill"] += 1
            else:
                count["decode"] += 1
    return count


def save_mid_run(path: str, name: str, steps: int) -> tuple[dict, dict]:
    eng = build(name)
    for rid, p, sp in workload():
        add(eng, rid, p, sp)
    done = {}
    for _ in range(steps):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason)
                                        for c in out.outputs]
    eng.drain()
    snapshot.save(eng, path, {"done": done})
    return done, states(eng)


if __name__ == "__main__":
    done, seen = save_mid_run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(json.dumps(seen), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean exit: the snapshot must stand alone
