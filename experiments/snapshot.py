"""Engine snapshots and sleep mode: seconds and bytes with a full KV pool, and orbax beside a
plain safetensors writer for the same state.

    python -m experiments.snapshot [--models smollm2 qwen2.5-coder-1.5b] [--rounds 3]

Per model, one LLM (its defaults: dtype "auto", a 1 GiB pool; max_num_seqs 64, 2048 tokens a
step) is filled: 64 requests of distinct random-token prompts sized so that their K/V take 90%
of the pool's blocks are prefilled (each has sampled its first token), then:
  save / restore   LLM.save_state (engine/snapshot.py: one orbax checkpoint of the device
                   state's arrays, the host mirror pickled beside them) and restore_state
                   into the same LLM emptied of its requests; the restored engine's next
                   step is checked to be the step the saved one would have run (same tokens)
  safetensors      the same leaves and host blob written with safetensors.numpy.save_file
                   and read back with load_file + device_put (no atomic commit, no checks):
                   the plain writer the issue asks orbax to be compared with
  sleep / wake     LLM.sleep(1) + wake_up() and sleep(2) + wake_up() (which reloads the
                   weights from the model's file), on the LLM before it is filled (a pool's
                   arrays are the same bytes full or empty); the device bytes freed
Sides alternate round by round; medians and every round are saved. Before each timed save the
page cache's dirty pages are flushed (os.sync, untimed): a write then costs its own bytes, not
the flushing of the side before it; no side fsyncs its own files (a killed process loses
nothing written; a machine that loses power may). Writes results/snapshot.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from experiments import common
from paged_jax.engine import snapshot
from paged_jax.sampling_params import SamplingParams

FILL = 0.9


def fill(llm) -> int:
    """Adds 64 requests whose prompts take FILL of the pool and steps until each has sampled
    its first token; returns the blocks in use."""
    eng = llm.llm_engine
    ec, rng = eng.config, np.random.default_rng(0)
    per = int(ec.num_kv_blocks * FILL / 64) * ec.block_size - 1
    per = min(per, ec.max_model_len - 8)
    vocab = eng.model_config.vocab_size
    for i in range(64):
        ids = rng.integers(100, min(vocab, 30000), per).tolist()
        eng.add_request(f"fill-{i}", {"prompt_token_ids": ids},
                        SamplingParams(temperature=0.8, seed=i, max_tokens=64))
    while any(not r.seqs[0].output_ids for r in eng.requests.values()):
        eng.step()
    eng.drain()
    return eng.kv.blocks_used()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
        else path.stat().st_size


def kept_round(llm, work: Path) -> dict:
    """LLM.save_state / restore_state as built (engine/snapshot_files.py), the whole state."""
    eng, path = llm.llm_engine, work / "kept"
    os.sync()  # every side starts with no dirty pages to flush (timings then measure writes)
    t0 = time.perf_counter()
    llm.save_state(str(path))
    t1 = time.perf_counter()
    before = {r: list(q.seqs[0].tokens) for r, q in eng.requests.items()}
    for rid in list(eng.requests):
        eng.abort(rid)
    t2 = time.perf_counter()
    llm.restore_state(str(path))
    jax.block_until_ready(eng.runner.state)
    t3 = time.perf_counter()
    assert {r: list(q.seqs[0].tokens) for r, q in eng.requests.items()} == before
    size = folder_bytes(path)
    shutil.rmtree(path)
    return {"all": {"save_s": t1 - t0, "restore_s": t3 - t2, "bytes": size}}


def parts(eng) -> dict[str, dict]:
    """The state as the snapshot splits it: the K/V pages, and the small arrays with the
    host mirror's pickle."""
    eng.drain()
    small, pages = snapshot._parts(eng.runner.state)
    small["host"] = jax.device_put(np.frombuffer(snapshot._pickle_host(eng, {}), np.uint8))
    return {"pages": pages, "small": small}


def timed_parts(llm, work: Path, name: str, save, load) -> dict:
    """Each part of the state written by `save(path, {name: array})` and read back by
    `load(path, like) -> leaves` (placed on the device), timed."""
    out = {}
    for part, tree in parts(llm.llm_engine).items():
        path = work / f"{name}-{part}"
        os.sync()  # every side starts with no dirty pages to flush
        t0 = time.perf_counter()
        save(path, tree)
        t1 = time.perf_counter()
        jax.block_until_ready(load(path, tree))
        out[part] = {"save_s": t1 - t0, "restore_s": time.perf_counter() - t1,
                     "bytes": folder_bytes(path)}
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


def orbax_round(llm, work: Path) -> dict:
    import orbax.checkpoint as ocp

    def save(path, tree):
        with ocp.StandardCheckpointer() as ck:
            ck.save(path, tree)

    def load(path, tree):
        like = {k: ocp.utils.to_shape_dtype_struct(x) for k, x in tree.items()}
        with ocp.StandardCheckpointer() as ck:
            return ck.restore(path, like)

    return timed_parts(llm, work, "orbax", save, load)


def safetensors_round(llm, work: Path) -> dict:
    from safetensors.numpy import load_file, save_file

    def save(path, tree):
        raw = {k: np.asarray(x) for k, x in tree.items()}
        save_file({k: x.reshape(-1).view(np.uint8) for k, x in raw.items()}, str(path))

    def load(path, tree):
        back = load_file(str(path))
        host = [back[k].view(x.dtype).reshape(x.shape) for k, x in tree.items()]
        return jax.device_put(host, [x.sharding for x in tree.values()])

    return timed_parts(llm, work, "plain", save, load)


def sleep_rounds(llm) -> dict:
    out = {}
    for level in (1, 2):
        t0 = time.perf_counter()
        freed = llm.sleep(level)
        t1 = time.perf_counter()
        llm.wake_up()
        jax.block_until_ready(llm.llm_engine.runner.params)
        out[f"level{level}"] = {"sleep_s": t1 - t0, "wake_s": time.perf_counter() - t1,
                                "freed_bytes": freed}
    return out


def run_model(name: str, rounds: int, work: Path) -> dict:
    from paged_jax.llm import LLM

    llm = LLM(name, max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=2048)
    rn = llm.llm_engine.runner
    weights = sum(x.nbytes for x in jax.tree.leaves(rn.params))
    kv = sum(x.nbytes for x in jax.tree.leaves(rn.state))
    # first: orbax's side below keeps copies of what it restored alive (about 2 GiB here),
    # which a sleep afterwards would count as freed
    sleeps = sleep_rounds(llm)
    used = fill(llm)
    sides = {"kept": [], "orbax": [], "safetensors": []}
    fns = {"kept": kept_round, "orbax": orbax_round, "safetensors": safetensors_round}
    for r in range(rounds):
        for side in common.rotated(list(sides), r):
            sides[side].append(fns[side](llm, work))
    for rid in list(llm.llm_engine.requests):
        llm.llm_engine.abort(rid)
    med = {s: {part: {k: statistics.median(x[part][k] for x in runs) for k in runs[0][part]}
               for part in runs[0]} for s, runs in sides.items()}
    faster = {f"{part} {k}": min(("orbax", "safetensors"), key=lambda s: med[s][part][k])
              for part in ("pages", "small") for k in ("save_s", "restore_s")}
    ec = llm.engine_config
    return {"model": name, "dtype": llm.dtype_choice["dtype"], "num_kv_blocks": ec.num_kv_blocks,
            "blocks_used": used, "weights_bytes": weights, "requests": 64, "median": med,
            "faster": faster, "rounds": sides, "state_bytes": kv, "sleep": sleeps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-1.5b"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows.append(run_model(name, args.rounds, Path(tmp)))
            m = rows[-1]["median"]
            print(f"{name}: {rows[-1]['blocks_used']}/{rows[-1]['num_kv_blocks']} blocks")
            for side, by_part in m.items():
                for part, v in by_part.items():
                    print(f"  {side:12s} {part:6s} save {v['save_s']:.3f} s  restore "
                          f"{v['restore_s']:.3f} s  {v['bytes'] / 2**20:.1f} MiB")
            print(f"  faster: {rows[-1]['faster']}; sleep: {rows[-1]['sleep']}", flush=True)
    common.save_json("snapshot", {"rows": rows, "fill": FILL, "rounds": args.rounds})


if __name__ == "__main__":
    main()
