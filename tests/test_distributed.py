"""Two processes on localhost joined by jax.distributed (gloo on CPU), one engine over both
(TP = 2, one device each): the greedy tokens of one process. Both are started and stopped by
the test, bounded in time."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from paged_jax.distributed import greedy_tokens
from tests.distributed_worker import PROMPTS, tiny_llm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_one_process_tokens(tmp_path):
    out = tmp_path / "tokens.json"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, "PYTHONPATH": os.getcwd(),
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=1".strip()}
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
