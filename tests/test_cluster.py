"""serve/cluster.py against the real vllm-router binary: two `paged_jax.serve` replicas of a
tiny GGUF on loopback, the router in front; every request is served, round-robin spreads
them, cache-aware keeps a shared prefix on one replica, and a replica killed mid-run loses
no request (the router retries it on the other)."""

from __future__ import annotations

import os
import signal

import httpx
import numpy as np
import pytest

from paged_jax.serve.cluster import cluster
from tests.serve_helpers import metric
from tests.test_models_gguf import hf_weights, write_gguf

pytest.importorskip("vllm_router")
FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--kv-cache-memory", str(1 << 22), "--warmup", "none"]
ENV = {"PYTHONPATH": os.getcwd()}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cluster") / "tiny.gguf"
    write_gguf(path, hf_weights(np.random.default_rng(0)))
    return str(path)


def complete(url: str, prompt, **kw) -> httpx.Response:
    body = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0, **kw)
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def served(replicas) -> list[float]:
    return [metric(httpx.get(u + "/metrics", timeout=10).text, "vllm:request_success_total")
            for _, u in replicas]


def test_round_robin_spreads_and_a_killed_replica_loses_nothing(gguf):
    with cluster(gguf, 2, "round_robin", FLAGS, env=ENV) as (url, reps):
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] \
            == ["tiny"]
        assert all(complete(url, f"ab a {i}").status_code == 200 for i in range(6))
        assert complete(url, [5, 6, 7, 8]).status_code == 200  # token ids pass the router
        stream = complete(url, "ab ab", stream=True)
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        assert all(n >= 3 for n in served(reps)), served(reps)
        reps[0][0].send_signal(signal.SIGKILL)
        reps[0][0].wait(10)
        codes = [complete(url, f"a b {i}").status_code for i in range(6)]
        assert codes == [200] * 6, codes


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(gguf):
    system = "ab a ba " * 12
    with cluster(gguf, 2, "cache_aware", FLAGS, env=ENV) as (url, reps):
        for i in range(4):
            assert complete(url, system + f"b{i}").status_code == 200
        assert sorted(served(reps)) == [0, 4]
