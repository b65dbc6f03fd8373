"""Builds the C++ CPU kernels (XLA FFI custom calls) with the machine's g++, once.

A library is compiled on first use into a folder of the caller's choosing, keyed by a hash of
its source (and the local headers it includes), the flags, the JAX version and the CPU, so a
rebuilt JAX or another CPU gets its own build; concurrent builds do not clash (each writes a
temporary file, then renames it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
"""Compile flags. -ffast-math gives the vectorized exp; the link step leaves it out, because
g++ then links crtfastmath.o, which turns on flush-to-zero for the whole process (numpy, torch
and XLA would all lose subnormal floats on loading the library)."""


def default_folder() -> Path:
    """The build folder paged-jax uses (paged_jax/compile_cache.py: `$PAGED_JAX_CACHE`, else
    ~/.cache/paged_jax, then kernels/); repeated here so the lab runs without the library."""
    root = os.environ.get("PAGED_JAX_CACHE") or Path.home() / ".cache" / "paged_jax"
    return Path(root) / "kernels"


def _cpu_id() -> str:
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def library_path(source: Path, folder: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the build of `source` for these flags, JAX and CPU lives in `folder`."""
    key = hashlib.sha256("\n".join(
        [*_texts(source), " ".join(flags), jax.__version__, _cpu_id()]).encode())
    return Path(folder) / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _texts(source: Path) -> list[str]:
    """The source and the local headers it includes (`#include "name.h"`, beside it): an
    edit to either is a new build."""
    text = source.read_text()
    local = re.findall(r'^#include "([^"/]+)"', text, flags=re.M)
    return [text] + [(source.parent / h).read_text() for h in local
                     if (source.parent / h).exists()]


def build(source: Path, folder: Path, what: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compiles `source` into `folder` unless already built; returns the library's path.

    Raises:
      RuntimeError: no C++ compiler, or the compilation failed (its output in the message,
        which names `what` was being built).
    """
    out = library_path(source, folder, flags)
    if out.is_file():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError(f"no C++ compiler (g++) found to build the {what}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, part = Path(tmp) / "kernel.o", Path(tmp) / out.name
        for cmd in ([cxx, *flags, f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", str(obj)],
                    [cxx, "-shared", str(obj), "-o", str(part)]):
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"building the {what} failed:\n{' '.join(cmd)}\n"
                                   f"{res.stderr[-4000:]}")
        os.replace(part, out)  # atomic: a reader never sees half a library
    return out


def load(source: Path, folder: Path, what: str, fallback: str, targets: dict[str, str]) -> bool:
    """Builds `source` (if needed), loads it and registers each FFI target name -> exported
    handler symbol with XLA on the CPU; False, with a warning naming `what` and the
    `fallback` used instead, when it cannot be built or loaded."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source, folder, what)))
    except (RuntimeError, OSError) as err:
        import warnings

        warnings.warn(f"{what} unavailable, using {fallback}: {err}", stacklevel=3)
        return False
    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True
