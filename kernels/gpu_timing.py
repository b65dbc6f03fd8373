"""Timing on one GPU for `make gpu-check`: paired rounds, the copy-bandwidth limit, L2 flushes.

Every contender of a shape is timed in the same rounds, one after the other (paired), so a
drift of the machine hits all of them alike; a verdict reads the per-round ratios.

    K/V >= BIG_BYTES   a round = `reps` calls back to back (no sync between them: launch
                       overhead hides behind the previous call), time / reps
    smaller            a round = one call after a 256 MiB write (more than any GPU's L2),
                       so it reads HBM, not cache; its time includes the dispatch
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

BIG_BYTES = 256 << 20
FLUSH_WORDS = 64 << 20  # float32 words written by flush_l2 (256 MiB)
COPY_BYTES = 2 << 30  # the copy-bandwidth buffer
_flush_buffer = None


def flush_l2() -> None:
    """Writes 256 MiB on the device (H100/H200 L2: 50-60 MB), so the next call reads HBM."""
    import jax
    import jax.numpy as jnp

    global _flush_buffer
    if _flush_buffer is None or _flush_buffer.size != FLUSH_WORDS:
        _flush_buffer = jnp.zeros((FLUSH_WORDS,), jnp.float32)
    _flush_buffer = jax.block_until_ready(_bump()(_flush_buffer))


@functools.cache
def _bump():
    import jax

    return jax.jit(lambda a: a + 1.0, donate_argnums=0)


def one_round(fn: Callable, args: tuple, big: bool, reps: int) -> float:
    """Seconds per call of one round (module docstring)."""
    import jax

    if not big:
        flush_l2()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def paired(contenders: dict[str, Callable], args: dict[str, tuple], nbytes: int,
           rounds: int = 7, reps: int = 20) -> dict[str, dict]:
    """Times every contender in the same rounds after a compiling call each; a contender that
    fails to compile or run gets {"error": ...} and leaves the others be.

    Returns {name: dict(times=[s per call, one per round], ms=median ms, spread=half-range
    over the median, compile_s) | dict(error=...)}."""
    import jax

    big = nbytes >= BIG_BYTES
    out, live = {}, {}
    # A round of the first contender right after the compiles ran at lower clocks (run 1 on
    # the H200: one round in seven 30-50% slow): every contender runs one round unrecorded.
    for name, fn in contenders.items():
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(fn(*args[name]))
        except Exception as e:  # one contender must not lose the whole table
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
            continue
        out[name] = dict(compile_s=time.perf_counter() - t0, times=[])
        live[name] = fn
    for name, fn in live.items():
        one_round(fn, args[name], big, reps)
    for _ in range(rounds):
        for name, fn in live.items():
            out[name]["times"].append(one_round(fn, args[name], big, reps))
    for name in live:
        ts = out[name]["times"]
        med = statistics.median(ts)
        out[name].update(ms=med * 1e3, spread=(max(ts) - min(ts)) / 2 / med)
    return out


def copy_bandwidth(rounds: int = 7, reps: int = 10) -> dict:
    """GB/s of a device copy of 2 GiB (bytes read + bytes written): the decode limit.
    Returns dict(gbps=median, rounds=[GB/s per round])."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((COPY_BYTES // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    res = paired({"copy": f}, {"copy": (x,)}, 2 * x.nbytes, rounds, reps)["copy"]
    per = [2 * x.nbytes / t / 1e9 for t in res["times"]]
    return dict(gbps=statistics.median(per), rounds=per)


def per_round_ratio(a: dict, b: dict) -> list[float]:
    """b's time over a's in each round (a's speed-up over b), paired round by round."""
    return [tb / ta for ta, tb in zip(a["times"], b["times"], strict=True)]
