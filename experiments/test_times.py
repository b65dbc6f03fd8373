"""How long `make test`'s pytest run takes on this machine: cold (empty compile cache, as a
newcomer's first run) and then warm (the cache that run filled).

    python -m experiments.test_times [--tier fast|slow|all] [--pytest-args ...]

`--tier fast` (the default) is `make test` (`-m "not slow"`), `slow` is `make test-slow`.

The cold run gets a fresh, empty cache root (PAGED_JAX_CACHE: compiled programs, params,
native kernels); the warm run reuses it. Also measures what compiling at
the tests' XLA flags save (tests/xla_flags.py): one engine step
program of the tests' tiny model, compiled with and without the flag, each in a fresh
process with the persistent cache off, alternating, three times each (median).
Writes results/test_times.json.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from experiments import common

PYTEST = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
          "-p", "no:cacheprovider", "--durations=30"]
TIERS = {"fast": ["-m", "not slow"], "slow": ["-m", "slow"], "all": []}
ONE_PROGRAM = """
import time, jax
jax.config.update("jax_enable_compilation_cache", False)
from tests.engine_helpers import engine, prompts, GREEDY
eng = engine(check=False)
for i, p in enumerate(prompts(4)):
    eng.add_request(str(i), p, GREEDY)
t = time.perf_counter(); eng.step(); print(time.perf_counter() - t)
"""


def suite(cache: str, extra: list[str]) -> dict:
    env = {**os.environ, "PAGED_JAX_CACHE": cache}
    t0 = time.perf_counter()
    out = subprocess.run(PYTEST + extra, env=env, capture_output=True, text=True)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
    slowest = [line.split(maxsplit=2) for line in out.stdout.splitlines()
               if re.match(r"^\d+\.\d+s (call|setup|teardown) ", line)]
    return dict(seconds=time.perf_counter() - t0, returncode=out.returncode, summary=tail,
                slowest=[dict(seconds=float(t[:-1]), phase=ph, test=nid)
                         for t, ph, nid in slowest])


def first_step(flags: str) -> float:
    env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", ONE_PROGRAM], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def compile_flag(rounds: int = 3) -> dict:
    """A first engine step (mostly compiling its program) with the tests' flags and with
    XLA's defaults."""
    from tests.xla_flags import FAST_COMPILE_FLAGS

    fast, dflt = [], []
    for _ in range(rounds):
        fast.append(first_step(FAST_COMPILE_FLAGS))
        dflt.append(first_step(""))
    return dict(flags=FAST_COMPILE_FLAGS, tests_s=statistics.median(fast),
                default_s=statistics.median(dflt), tests_runs=fast, default_runs=dflt,
                saved=1 - statistics.median(fast) / statistics.median(dflt))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", choices=sorted(TIERS), default="fast")
    ap.add_argument("--pytest-args", nargs="*", default=[])
    a = ap.parse_args(argv)
    args = TIERS[a.tier] + a.pytest_args
    with tempfile.TemporaryDirectory(prefix="paged-jax-cold-") as cache:
        cold = suite(cache, args)
        warm = suite(cache, args)
    res = dict(tier=a.tier, pytest_args=args, cold=cold, warm=warm,
               cold_minutes=cold["seconds"] / 60, warm_minutes=warm["seconds"] / 60,
               workers=2, compile_flags=compile_flag())
    res["json"] = str(common.save_json("test_times" + ("" if a.tier == "fast" else f"_{a.tier}"),
                                       res))
    print(f"cold {res['cold_minutes']:.1f} min ({cold['summary']}), warm "
          f"{res['warm_minutes']:.1f} min ({warm['summary']}); first step with the tests' "
          f"flags {res['compile_flags']['tests_s']:.1f} s vs "
          f"{res['compile_flags']['default_s']:.1f} s")
    return res


if __name__ == "__main__":
    main()
