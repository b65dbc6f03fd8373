"""paged-jax's cache folders, and compiled XLA programs that persist on disk.

Everything paged-jax keeps between runs lives under one root, `cache_root()`: loaded params
(models/param_cache.py), compiled XLA programs (`xla/`, below) and native kernels
(`kernels/`, kernels/cpu_attention.py).

Compiled programs: a user's second script starts in seconds.

`import paged_jax` points JAX's persistent compilation cache at one folder,
`$PAGED_JAX_CACHE/xla` (default `~/.cache/paged_jax/xla`, beside the loaded-params cache),
unless the user already chose a folder (`JAX_COMPILATION_CACHE_DIR` or `jax.config`) or opted
out with `PAGED_JAX_COMPILE_CACHE=0`. Every engine step shape is a program of seconds to
compile on a CPU (the decoder's layers are unrolled); cached, a fresh process loads it in
milliseconds. Like any JAX compilation cache, the folder must only be writable by its user.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def cache_root() -> Path:
    """$PAGED_JAX_CACHE, else ~/.cache/paged_jax."""
    return Path(os.environ.get("PAGED_JAX_CACHE") or Path.home() / ".cache" / "paged_jax")


MIN_COMPILE_SECONDS = 0.0
"""Programs that compile faster than this are not worth a file (JAX's default is 1 s)."""


def enable(path: str | Path | None = None) -> Path | None:
    """Turns the persistent cache on (see the module docstring); returns its folder or None.

    Args:
      path: the folder; None = the user's choice if any, else `cache_root() / "xla"`.
    """
    if path is None:
        if os.environ.get("PAGED_JAX_COMPILE_CACHE", "1") == "0":
            return None
        chosen = jax.config.jax_compilation_cache_dir
        path = chosen or cache_root() / "xla"
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


RELIEVE_AT = 0.85
"""Share of vm.max_map_count past which relieve_jit_mappings drops the programs: one step
program adds under 1,000 mappings, so the margin (about 9,800 of 65,530) holds several; a
server's warm-up (engine/warmup.py) must fit below it."""


def relieve_jit_mappings(fraction: float = RELIEVE_AT) -> bool:
    """Drops in-memory compiled programs when the process nears the kernel's mapping limit.

    XLA:CPU maps each compiled kernel's code and data separately (about 1,000 mappings per
    SmolLM2 step program: three per kernel), and a process that holds more than
    `vm.max_map_count` mappings
    (65,530 by default) aborts in LLVM ("Unable to allocate section memory"). Above `fraction`
    of the limit this calls `clear_programs()`; programs still in use are reloaded from the
    persistent cache on their next call. Linux only; elsewhere it does nothing.

    Returns:
      True when the caches were cleared.
    """
    try:
        used = _count_lines("/proc/self/maps")
        limit = int(open("/proc/sys/vm/max_map_count").read())
    except OSError:
        return False
    if used < fraction * limit:
        return False
    clear_programs()
    return True


_CLEARS: list = []


def clear_programs() -> None:
    """Drops every compiled program this process holds in memory: jit's caches
    (`jax.clear_caches`) and the tables registered with `on_clear`."""
    jax.clear_caches()
    for clear in _CLEARS:
        clear()


def on_clear(clear) -> None:
    """Registers `clear()` to run when relieve_jit_mappings drops the compiled programs:
    tables of compiled programs held outside jit's own caches (engine/programs.py)."""
    _CLEARS.append(clear)


def kernel_folder() -> Path:
    """Where native kernels are built (kernels/cpu_attention.py): `cache_root() / "kernels"`."""
    return cache_root() / "kernels"
