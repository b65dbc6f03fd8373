"""Engine snapshots (engine/snapshot.py): saved mid-run and restored, in this process or a
new one after the first was killed, every request finishes with the tokens of a run that never
stopped; a snapshot of another model, dtype or layout is refused by name; a partial or corrupt
one fails cleanly and the engine goes on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from paged_jax.engine import snapshot
from paged_jax.engine.programs import PROGRAMS
from paged_jax.models.testing import random_params, tiny_config
from paged_jax.sampling_params import SamplingParams
from tests import snapshot_helpers as sh
from tests.engine_helpers import engine, model

ROOT = Path(__file__).resolve().parents[1]


def uninterrupted(name: str) -> dict:
    eng = sh.build(name)
    for rid, p, sp in sh.workload():
        sh.add(eng, rid, p, sp)
    return sh.finish(eng)


@pytest.mark.parametrize("name,steps", [("sync", 17), ("async", 12), ("swap", 12),
                                        ("spec", 12)])
def test_restored_engine_finishes_with_the_same_tokens(tmp_path, name, steps):
    ref = uninterrupted(name)  # first: it builds every program the workload needs
    built = PROGRAMS.built
    done, seen = sh.save_mid_run(str(tmp_path / "s"), name, steps)
    assert seen["waiting"] and seen["decode"] and (seen["swapped"] or name != "swap")
    assert seen["beams"], seen  # beam searches mid-run are in the snapshot
    eng = sh.build(name)
    extra = snapshot.restore(eng, tmp_path / "s")
    assert len(eng.requests) + len(extra["done"]) == 64
    assert sh.finish(eng, extra["done"]) == ref
    assert PROGRAMS.built == built  # the restored arrays keep their placement: no compile


def test_snapshot_outlives_the_process_that_saved_it(tmp_path):
    """The worker saves 64 requests mid-run (one mid-prefill, preempted ones, n = 2 rows,
    beam searches, greedy, seeded and engine-seeded sampling, stop strings) and SIGKILLs
    itself."""
    path = tmp_path / "snap"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "snapshot_helpers.py"),
                           str(path), "sync", "45"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["prefill"] and seen["decode"] and seen["preempted"] and seen["waiting"]
    assert seen["beams"], seen
    eng = sh.build("sync")
    extra = snapshot.restore(eng, path)
    assert sh.finish(eng, extra["done"]) == uninterrupted("sync")


def saved(tmp_path, **overrides) -> Path:
    eng = engine(**overrides)
    for i in range(3):
        eng.add_request(str(i), f"prompt {i} " * 4, SamplingParams(temperature=0, max_tokens=9))
    eng.step()
    snapshot.save(eng, tmp_path / "s")
    return tmp_path / "s"


@pytest.mark.parametrize("what,parts,overrides,named", [
    ("model", (tiny_config(hidden_size=32), None), {}, "hidden_size"),
    ("weights", (None, "seed1"), {}, "weights"),
    ("dtype", (None, "bfloat16"), {}, "weights"),
    ("layout", (None, None), {"num_kv_blocks": 96}, "num_kv_blocks"),
])
def test_a_snapshot_of_another_engine_is_refused_by_name(tmp_path, what, parts, overrides,
                                                         named):
    path = saved(tmp_path)
    config, tok = tiny_config() if parts[0] is None else parts[0], model()[2]
    params = {None: model()[1], "seed1": random_params(config, seed=1),
              "bfloat16": random_params(config, dtype=jax.numpy.bfloat16)}[parts[1]]
    if parts[0] is not None:
        params = random_params(config)
    other = engine((config, params, tok), **overrides)
    with pytest.raises(snapshot.SnapshotError, match=named):
        snapshot.restore(other, path)
    assert not other.requests  # nothing was installed


@pytest.mark.parametrize("part", ["pages", "small"])
def test_a_corrupt_or_partial_snapshot_fails_cleanly_and_the_engine_goes_on(tmp_path, part):
    path = saved(tmp_path)
    eng = engine()
    if part == "pages":  # the K/V pages cut short
        data = (path / "pages.safetensors").read_bytes()
        (path / "pages.safetensors").write_bytes(data[: len(data) // 2])
    else:  # orbax's array files overwritten
        for f in sorted((path / "orbax" / "small").rglob("*")):
            if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
                f.write_bytes(b"\0" * 7)
    with pytest.raises(snapshot.SnapshotError, match="incomplete or corrupt"):
        snapshot.restore(eng, path)
    partial = tmp_path / "t.partial-123-0"
    shutil.copytree(path, partial)
    with pytest.raises(snapshot.SnapshotError, match="unfinished save"):
        snapshot.restore(eng, partial)
    with pytest.raises(snapshot.SnapshotError, match="no snapshot"):
        snapshot.restore(eng, tmp_path / "nothing")
    out = sh.finish(_one(eng))
    assert out["x"][0][2] == "length"  # the engine was left as it was, and serves


def test_a_save_cut_short_leaves_no_snapshot(tmp_path, monkeypatch):
    """The commit is the last rename: a writer failing before it leaves neither the path
    nor its temporary folder."""
    from paged_jax.engine import snapshot_files

    eng = _one(engine())
    eng.step()
    monkeypatch.setattr(snapshot_files, "save_file", mock_fail)
    with pytest.raises(OSError, match="disk full"):
        snapshot.save(eng, tmp_path / "s")
    assert list(tmp_path.iterdir()) == []


def mock_fail(*_a, **_k):
    raise OSError("disk full")


def _one(eng):
    eng.add_request("x", "hello", SamplingParams(temperature=0, max_tokens=5))
    return eng


def test_save_never_writes_over_a_snapshot_and_restore_needs_an_idle_engine(tmp_path):
    path = saved(tmp_path)
    before = sorted(p.name for p in path.rglob("*"))
    with pytest.raises(FileExistsError):
        snapshot.save(engine(), path)
    assert sorted(p.name for p in path.rglob("*")) == before
    busy = _one(engine())
    with pytest.raises(RuntimeError, match="idle engine"):
        snapshot.restore(busy, path)


def test_structured_output_requests_are_refused_by_name(tmp_path):
    eng = engine()
    eng.add_request("json", "x", SamplingParams(
        max_tokens=4, structured_outputs={"choice": ["yes", "no"]}))
    with pytest.raises(NotImplementedError, match="json"):
        snapshot.save(eng, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_llm_save_restore_resume(tmp_path):
    from paged_jax.llm import LLM

    kw = dict(model_parts=model(), num_kv_blocks=64, max_num_seqs=4, max_model_len=256)
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=20) for i in range(6)]
    prompts = [f"say {i} " * 3 for i in range(6)]
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sps, use_tqdm=False)]
    llm = LLM(**kw)
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        llm.llm_engine.add_request(str(i), p, sp)
    llm._counter = 6
    for _ in range(4):
        llm.llm_engine.step()
    stats = llm.save_state(str(tmp_path / "s"))
    assert stats.bytes > 0 and stats.requests == 6
    fresh = LLM(**kw)
    ids = fresh.restore_state(str(tmp_path / "s"))
    outs = fresh.resume(use_tqdm=False)
    assert ids == [str(i) for i in range(6)] and fresh._counter == 6
    assert [o.outputs[0].token_ids for o in outs] == ref
    shutil.rmtree(tmp_path / "s")
    assert np.isfinite(stats.seconds)
