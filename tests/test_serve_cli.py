"""`python -m paged_jax.serve MODEL` as a user starts it: a tiny GGUF, a free loopback port,
the `openai` client, and a graceful stop (SIGINT: uvicorn finishes, the engine thread ends)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai

from tests.test_models_gguf import hf_weights, write_gguf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_a_gguf_and_stops_gracefully(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_weights(np.random.default_rng(0)))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "paged_jax.serve", str(path), "--port", str(port),
         "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--kv-cache-memory", str(1 << 22)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.5)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        assert c.models.list().data[0].id == "tiny"
        res = c.completions.create(model="tiny", prompt="ab a", max_tokens=5, temperature=0)
        assert res.usage.prompt_tokens >= 3 and res.choices[0].finish_reason in ("length", "stop")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
