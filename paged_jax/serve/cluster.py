"""`paged-jax cluster [MODEL] --replicas N --policy cache_aware [serve flags]`: N servers
behind vllm-router, from one command.

Each replica is `python -m paged_jax.serve` on its own loopback port (with `--pin`, on its
own CPU core, replica i on core i mod the cores this process may use), started together; the
router (vLLM's Rust router, PyPI's `vllm-router`) starts once every replica says ready
(/health 200: warm, engine/warmup.py) and listens on `--host`/`--port`. Clients talk to the
router as to one OpenAI-compatible server. Ctrl-C (SIGINT or SIGTERM) stops the router, then
the replicas.

Why vllm-router rather than sglang-router (both on PyPI, the same Rust lineage): it forwards
/v1/completions with token-id prompts, which sglang-router 0.3.2 refuses with 422 before any
worker sees them, and it keeps the request body's extra fields; it needs from a worker only
/health (startup and periodic checks) and, for `--policy power_of_two`, /get_load, which our
server answers ({"load": requests running + waiting}). Its cache-aware policy matches the
prompt's text (chat: the messages' text): token-id prompts all look alike to it, so use
round_robin or power_of_two for them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, path: str, timeout: float) -> None:
    """Until `url + path` answers 200; raises if `proc` exits or `timeout` passes."""
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        if time.time() > deadline:
            raise RuntimeError(f"{url}{path} did not answer 200 in {timeout:.0f} s")
        time.sleep(0.25)


def _pinned(core: int | None):
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def start_replicas(model: str | None, n: int, serve_flags: list[str], pin: bool,
                   env: dict | None = None) -> list[tuple[subprocess.Popen, str]]:
    """N `paged_jax.serve` processes on free loopback ports, not waited for."""
    cores = sorted(os.sched_getaffinity(0))
    out = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "paged_jax.serve", *([model] if model else []),
               "--host", "127.0.0.1", "--port", str(port), *serve_flags]
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                preexec_fn=_pinned(cores[i % len(cores)] if pin else None))
        out.append((proc, f"http://127.0.0.1:{port}"))
    return out


def start_router(urls: list[str], policy: str, host: str, port: int,
                 extra: list[str] | None = None) -> subprocess.Popen:
    """vllm-router in front of `urls` (health checked every 2 s, a worker out after 2
    failures; a failed request retried on another worker)."""
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--worker-urls", *urls,
           "--host", host, "--port", str(port), "--policy", policy,
           "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
           "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
           "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
           "--log-level", "warning", *(extra or [])]
    return subprocess.Popen(cmd)


@contextlib.contextmanager
def cluster(model: str | None, replicas: int, policy: str = "cache_aware",
            serve_flags: list[str] | None = None, pin: bool = False, host: str = "127.0.0.1",
            port: int | None = None, timeout: float = 900, env: dict | None = None
            ) -> Iterator[tuple[str, list[tuple[subprocess.Popen, str]]]]:
    """`with cluster(...) as (router_url, [(replica process, url)])`: everything started and
    ready inside the block, stopped after it."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    procs = start_replicas(model, replicas, serve_flags or [], pin, env)
    router = None
    try:
        for proc, url in procs:
            wait_ready(proc, url, "/health", timeout)
        port = port or free_port()
        router = start_router([u for _, u in procs], policy, host, port)
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        wait_ready(router, url, "/readiness", 120)
        yield url, procs
    finally:
        for p in ([router] if router else []) + [p for p, _ in procs]:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in ([router] if router else []) + [p for p, _ in procs]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="paged-jax cluster", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--pin", action="store_true", help="replica i on CPU core i")
    a, serve_flags = ap.parse_known_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with cluster(a.model, a.replicas, a.policy, serve_flags, a.pin, a.host, a.port) as (url, ps):
        print(f"{a.replicas} replicas ({', '.join(u for _, u in ps)}) behind vllm-router "
              f"({a.policy}) on {url}/v1", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while not stop and all(p.poll() is None for p, _ in ps):
                time.sleep(1)
