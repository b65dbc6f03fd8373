"""`python -m paged_jax.distributed`. Slow tier: two processes on localhost joined by
jax.distributed (gloo on CPU), one engine over both (TP = 2, one device each): the greedy
tokens of one process. Fast tier: its arguments, and the command itself as one process of
two devices on a tiny GGUF: the tokens of an engine on one device, written and printed.
Every process is started and stopped by the test, bounded in time."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from paged_jax.distributed import greedy_tokens, parse_args
from paged_jax.llm import LLM
from tests.distributed_worker import PROMPTS, tiny_llm
from tests.test_models_gguf import hf_weights, write_gguf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_devices(n: int) -> dict[str, str]:
    """This environment for a child process with `n` fake CPU devices (conftest's 4 out)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "PYTHONPATH": os.getcwd(),
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}


def test_arguments():
    a = parse_args(["--coordinator", "10.0.0.1:1234", "--num-processes", "2",
                    "--process-id", "1", "--prompt", "x", "--prompt", "y z", "--out", "t.json"])
    assert (a.coordinator, a.num_processes, a.process_id) == ("10.0.0.1:1234", 2, 1)
    assert a.prompt == ["x", "y z"] and a.out.name == "t.json" and a.max_tokens == 16
    assert parse_args(["--coordinator", "h:1", "--num-processes", "1",
                       "--process-id", "0"]).model is None  # the default model
    for missing in ("--coordinator", "--num-processes", "--process-id"):
        argv = ["--coordinator", "h:1", "--num-processes", "1", "--process-id", "0"]
        i = argv.index(missing)
        with pytest.raises(SystemExit):
            parse_args(argv[:i] + argv[i + 2:])


def test_one_process_command_gives_one_devices_tokens(tmp_path):
    """`python -m paged_jax.distributed` as the only process (jax.distributed with one
    member, gloo), its engine over two devices (TP = 2) on a tiny GGUF: what one device
    gives, in --out and printed."""
    path, out = tmp_path / "tiny.gguf", tmp_path / "tokens.json"
    write_gguf(path, hf_weights(np.random.default_rng(0)))
    prompts = ["ab a", "b ab ab"]
    cmd = [sys.executable, "-m", "paged_jax.distributed", "--coordinator",
           f"127.0.0.1:{free_port()}", "--num-processes", "1", "--process-id", "0",
           "--model", str(path), "--max-tokens", "5", "--out", str(out)]
    done = subprocess.run(cmd + [a for p in prompts for a in ("--prompt", p)],
                          env=env_with_devices(2), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    got = json.loads(out.read_text())
    assert (got["devices"], got["processes"]) == (2, 1)
    llm = LLM(str(path))
    want = greedy_tokens(llm, prompts, 5)
    assert got["tokens"] == want and all(len(t) == 5 for t in want)
    text = llm.get_tokenizer().decode(want[1])
    assert f"{prompts[1]!r} -> {text!r}" in done.stdout


@pytest.mark.slow
def test_two_processes_give_one_process_tokens(tmp_path):
    out = tmp_path / "tokens.json"
    env = env_with_devices(1)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.distributed_worker", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    got = json.loads(out.read_text())
    assert (got["devices"], got["processes"]) == (2, 2)
    assert got["tokens"] == greedy_tokens(tiny_llm(1), PROMPTS)
