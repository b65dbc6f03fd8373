"""How `make bench` talks to a side that runs in its own venv (vLLM, llama.cpp): JSON lines.

    worker -> {"ready": true, "versions": {...}, "settings": {...}}     once, after loading
    driver -> {"op": "run", "prompts": [[ids], ...], "tokens": N}
    worker -> {"seconds": s, "tokens": [[ids], ...]}                     or {"error": "..."}
    driver -> {"op": "generate", "prompts": [...], "max_tokens": [N, ...],
               "constraints": [{structured-output fields} or None, ...]}  (vLLM only)
    worker -> {"seconds": s, "tokens": [[ids], ...], "texts": [str, ...]}
    driver -> {"op": "score", "ids": [ids]}                              (llama.cpp only)
    worker -> {"nll": [-log p(ids[i + 1] | ids[:i + 1]) for each i]}
    driver -> {"op": "quit"}

Workers import this file by path (their venvs hold no paged_jax); it uses the standard
library only. The worker's own output (logs) goes to stderr, so stdout carries only answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

ANSWERS = sys.stdout
"""Where answers go. `quiet()` (call it first, before importing a library that logs) points
sys.stdout at stderr, so nothing but answers reaches the driver."""


def quiet() -> None:
    sys.stdout = sys.stderr


def serve(run: Callable[[dict], dict], versions: dict, settings: dict) -> None:
    """The worker's loop: answers each command until "quit" (or end of input)."""
    quiet()
    out = ANSWERS
    _send(out, dict(ready=True, versions=versions, settings=settings))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            _send(out, run(cmd))
        except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the row
            _send(out, dict(error=f"{type(e).__name__}: {e}"))


def _send(stream, obj: dict) -> None:
    stream.write(json.dumps(obj) + "\n")
    stream.flush()


class Worker:
    """The driver's handle on a worker process (started now, ready when this returns)."""

    def __init__(self, argv: list[str], env: dict | None = None, cwd: str | None = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=cwd)
        hello = self._read()
        self.versions, self.settings = hello["versions"], hello["settings"]

    def run(self, prompts: list[list[int]], tokens: int) -> dict:
        return self.call("run", prompts=prompts, tokens=tokens)

    def call(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps(dict(op=op, **args)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker {self.proc.args[:3]} exited "
                               f"(status {self.proc.poll()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"worker {self.proc.args[:3]}: {msg['error']}")
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps(dict(op="quit")) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
