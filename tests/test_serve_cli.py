"""`python -m paged_jax.serve MODEL` as a user starts it: a tiny GGUF, a free loopback port,
the `openai` client, and a graceful stop (SIGINT: uvicorn finishes, the engine thread ends)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from paged_jax.engine.config import scheduling
from paged_jax.routing import features as feat
from paged_jax.routing import head as head_lib
from paged_jax.routing import train
from paged_jax.serve import cli
from paged_jax.serve.cli import parser
from tests.test_models_gguf import E, hf_weights, write_gguf


def tiny_head(folder, candidate=(None, 4)) -> str:
    """A head for the tiny GGUF's hidden size, on random labels (the shipped head projects
    SmolLM2's 576-wide hidden state); candidate train.PROMPT: a prompt head."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, len(feat.NAMES) + E)).astype(np.float32)
    y = (rng.random((256, 2)) < 0.5).astype(np.float32)
    return str(head_lib.save(train.fit(x, y, candidate), folder))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("routed", [False, True], ids=["one-model", "routed"])
def test_cli_serves_a_gguf_and_stops_gracefully(tmp_path, routed):
    """One model with `--quantization int4` (int4 weights through the CLI); routed:
    `--strong-model` adds a second GGUF and "auto" (a head saved for the tiny model's hidden
    size routes: `--router-head`, and a prompt head for the default policy, cascade routing:
    `--prompt-head`)."""
    path, strong = tmp_path / "tiny.gguf", tmp_path / "tiny2.gguf"
    write_gguf(path, hf_weights(np.random.default_rng(0)))
    extra = ["--quantization", "int4"]
    if routed:
        write_gguf(strong, hf_weights(np.random.default_rng(1)))
        extra = ["--strong-model", str(strong), "--router-head", tiny_head(tmp_path / "head"),
                 "--prompt-head", tiny_head(tmp_path / "prompt", train.PROMPT)]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "paged_jax.serve", str(path), "--port", str(port),
         "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--kv-cache-memory", str(1 << 22), *extra],
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
        names = [m.id for m in c.models.list().data]
        assert names == (["tiny", "tiny2", "auto"] if routed else ["tiny"])
        res = c.completions.create(model=names[-1], prompt="ab a", max_tokens=5, temperature=0)
        assert res.usage.prompt_tokens >= 3 and res.choices[0].finish_reason in ("length", "stop")
        assert res.model in names[:2]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_scheduling_flags_default_to_what_llm_decides():
    """No flag: LLM's defaults (async scheduling, decode_window recorded 1); --decode-window
    alone turns async scheduling off; both together are refused, naming both."""
    a = parser().parse_args([])
    assert (a.decode_window, a.async_scheduling) == (None, None)
    assert scheduling(a.decode_window, a.async_scheduling, None) == (1, True)
    a = parser().parse_args(["--decode-window", "4"])
    assert scheduling(a.decode_window, a.async_scheduling, None) == (4, False)
    a = parser().parse_args(["--decode-window", "4", "--async-scheduling"])
    with pytest.raises(ValueError, match="decode_window=4 .*async_scheduling=True"):
        scheduling(a.decode_window, a.async_scheduling, None)


def test_a_policy_without_its_prompt_head_names_the_problem(tmp_path):
    """An answer head brought alone cannot run the default policy: the error says which
    folder lacks the prompt head and both ways out; cascade needs no prompt head."""
    head = Path(tiny_head(tmp_path / "head"))
    a = parser().parse_args(["m.gguf", "--strong-model", "s.gguf", "--router-head", str(head)])
    with pytest.raises(SystemExit, match="prompt_head holds none.*--routing-policy cascade"):
        cli.prompt_folder(a, head)
    a.prompt_head = tiny_head(tmp_path / "prompt", train.PROMPT)
    assert cli.prompt_folder(a, head) == Path(a.prompt_head)
