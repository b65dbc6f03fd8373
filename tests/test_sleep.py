"""Sleep mode (engine/sleep.py, LLM.sleep / wake_up, the server's /sleep and /wake_up): an
idle engine frees its weights' device memory and its KV cache, wakes with the same tokens and
no compile; busy engines and requests to a sleeping one are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest

from paged_jax.engine import sleep
from paged_jax.engine.programs import PROGRAMS
from paged_jax.llm import LLM
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from paged_jax.sampling_params import SamplingParams
from paged_jax.serve.api import build_app
from paged_jax.serve.background import Server
from tests.engine_helpers import engine
from tests.serve_helpers import ENGINE

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [f"wake {i} " * (1 + i) for i in range(5)]


def own_parts(seed: int = 5):
    """Weights no other engine of the test session shares (runner.shared_weights), so that
    dropping them frees them."""
    c = tiny_config(hidden_size=128, intermediate_size=256)
    return c, random_params(c, seed=seed), byte_tokenizer()


def tokens(eng) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"{id(eng)}-{len(eng.stats)}-{i}", p, GREEDY)
    done = {}
    while eng.has_unfinished():
        done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
    return [done[k] for k in sorted(done, key=lambda k: int(k.rsplit("-", 1)[1]))]


def weight_bytes(eng) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eng.runner.params))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_weights_and_wake_runs_the_same_tokens_without_compiling(level):
    parts = own_parts()
    eng = engine(parts)
    ref, built, size = tokens(eng), PROGRAMS.built, weight_bytes(eng)
    kv = sum(x.nbytes for x in jax.tree.leaves(eng.state.cache))
    freed = sleep.sleep(eng, level)
    assert freed >= 0.9 * size + kv  # the weights (all laid-out copies) and the K/V pages
    assert eng.asleep is not None and eng.runner.params is None
    with pytest.raises(sleep.Sleeping, match="asleep"):
        eng.add_request("late", "x", GREEDY)
    sleep.wake_up(eng, parts[1] if level == 2 else None)
    assert tokens(eng) == ref
    assert PROGRAMS.built == built  # same shapes, dtypes and placements: every program applies


def test_sleep_refuses_a_busy_engine_and_wake_checks_the_weights():
    parts = own_parts(6)
    eng = engine(parts)
    eng.add_request("busy", "hello", GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        sleep.sleep(eng, 1)
    eng.abort("busy")
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        sleep.sleep(eng, 3)
    sleep.sleep(eng, 2)
    with pytest.raises(ValueError, match="needs the weights"):
        sleep.wake_up(eng)
    other = random_params(tiny_config(hidden_size=128, intermediate_size=256, num_layers=3))
    with pytest.raises(ValueError, match="not the engine's model"):
        sleep.wake_up(eng, other)
    assert eng.asleep is not None  # still asleep, and still wakes with the right weights
    sleep.wake_up(eng, parts[1])
    assert len(tokens(eng)) == len(PROMPTS)


def test_sleep_discards_the_prefix_cache():
    eng = engine(own_parts(7), enable_prefix_caching=True)
    tokens(eng)
    assert eng.prefix.hash_of
    sleep.sleep(eng, 1)
    sleep.wake_up(eng)
    assert not eng.prefix.hash_of and int(eng.state.pool.num_free) == eng.config.num_kv_blocks - 1
    eng.check, _ = True, tokens(eng)  # the host mirror agrees with the fresh device state


def test_an_llm_of_model_parts_wakes_from_level_2_only_with_the_weights_given():
    """It has no file to reload them from (LLM(model=...) does: the real-weights test)."""
    llm = LLM(model_parts=own_parts(8), **ENGINE)
    llm.sleep(2)
    with pytest.raises(ValueError, match="model_parts"):
        llm.wake_up()
    llm.wake_up(params=own_parts(8)[1])
    assert not llm.is_sleeping()
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)


def test_server_sleep_and_wake_up():
    with Server(build_app(LLM(model_parts=own_parts(9), **ENGINE), "tiny")) as srv:
        body = dict(model="tiny", prompt="hello", max_tokens=8, temperature=0)
        first = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        r = httpx.post(srv.url + "/sleep", params={"level": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["freed_bytes"] > 0
        assert httpx.get(srv.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        assert httpx.post(srv.url + "/sleep", params={"level": 5}, timeout=10).status_code == 400
        assert httpx.post(srv.url + "/wake_up", timeout=60).status_code == 200
        again = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert httpx.get(srv.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}


REAL = """
import json
from paged_jax.engine.programs import PROGRAMS
from paged_jax.llm import LLM
from tests.test_sleep import GREEDY, PROMPTS, weight_bytes
llm = LLM(max_model_len=256, kv_cache_memory=64 << 20, max_num_seqs=4)
run = lambda: [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
ref, size, built, out = run(), weight_bytes(llm.llm_engine), PROGRAMS.built, {}
for level in (1, 2):
    freed = llm.sleep(level)
    llm.wake_up()
    out[level] = dict(freed=freed, same=run() == ref, built=PROGRAMS.built - built)
print(json.dumps(dict(size=size, levels=out)))
"""


def test_real_weights_sleep_frees_90_percent_and_wake_is_exact():
    """SmolLM2-135M as LLM() loads it, in a process of its own (in this one other tests'
    engines share its laid-out weights, which sleeping then cannot free): level 1 frees >=
    90% of its weights' device bytes, level 2 reloads them from the model's file; greedy
    tokens equal, nothing compiles on waking."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", REAL], capture_output=True, text=True,
                          cwd=root, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for level in ("1", "2"):
        assert got["levels"][level]["freed"] >= 0.9 * got["size"]
        assert got["levels"][level]["same"] and got["levels"][level]["built"] == 0
