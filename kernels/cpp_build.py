"""Builds the C++ CPU kernels (XLA FFI custom calls) with the machine's g++, once.

A library is compiled on first use into a folder of the caller's choosing, keyed by a hash of
its source (and the local headers it includes), the flags, the JAX version and the CPU, so a
rebuilt JAX or another CPU gets its own build; concurrent builds do not clash (each writes a
temporary file, then renames it).

The instruction set is a switch, `PAGED_JAX_CPU_ISA` (or a wrapper's `isa=` argument):

    ISA         -march        paths compiled (cpu_matmul.cc / cpu_matmul_quant.h)
    native      native        all this CPU has: AVX-512 panel pairs, AVX2 integer int4 rows,
                              AVX-512 VNNI int8 rows, F16C halves (the default)
    x86-64-v3   x86-64-v3     AVX2, FMA, F16C: the AVX2 paths, no AVX-512
    x86-64-v2   x86-64-v2     SSE4.2: the scalar paths (halves, rounding, bytes, int4 on floats)

so a test on an AVX-512 machine also runs the code a user on an older CPU runs. Each ISA's
library registers its own FFI target names (`target`): several live in one process.
`PAGED_JAX_CPU_SANITIZE=undefined` builds under that sanitizer (tests/test_cpu_sanitize.py).
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

BASE_FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp-simd", "-std=c++17",
              "-fPIC")
"""Compile flags every ISA shares. -ffast-math lets the compiler reorder float sums (the
vectorized dot and exp); -fno-finite-math-only then keeps NaN and Inf meaning what IEEE says
(finite-math-only let the compiler assume neither exists, and a NaN activation became
arbitrary int8 codes). The link step leaves them out, because g++ then links crtfastmath.o,
which turns on flush-to-zero for the whole process (numpy, torch and XLA would all lose
subnormal floats on loading the library)."""

ISAS = {"native": ("-march=native",), "x86-64-v3": ("-march=x86-64-v3",),
        "x86-64-v2": ("-march=x86-64-v2",)}
"""ISA name -> its flags (the module docstring's table)."""

ISA_ENV, SANITIZE_ENV = "PAGED_JAX_CPU_ISA", "PAGED_JAX_CPU_SANITIZE"


def isa(name: str | None = None) -> str:
    """`name`, else `$PAGED_JAX_CPU_ISA`, else "native"; ValueError for one not in ISAS."""
    name = name or os.environ.get(ISA_ENV) or "native"
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV} (or isa=) must be one of {sorted(ISAS)}, got {name!r}")
    return name


def flags(isa_name: str | None = None) -> tuple[str, ...]:
    """The compile flags for an ISA (`isa`'s choice), with the sanitizer's where
    `$PAGED_JAX_CPU_SANITIZE` names one (e.g. "undefined"): a report aborts the process."""
    checks = os.environ.get(SANITIZE_ENV)
    sanitize = (f"-fsanitize={checks}", f"-fno-sanitize-recover={checks}", "-g") if checks else ()
    return (*BASE_FLAGS, *ISAS[isa(isa_name)], *sanitize)


def target(name: str, isa_name: str | None = None) -> str:
    """FFI target `name` as registered by `isa_name`'s library."""
    return f"{name}_{isa(isa_name).replace('-', '_')}"


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


def library_path(source: Path, folder: Path, flags: tuple[str, ...]) -> Path:
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


def compiler() -> str | None:
    """The C++ compiler the kernels build with ($CXX, else g++ or c++ on the PATH), or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(source: Path, folder: Path, what: str, flags: tuple[str, ...]) -> Path:
    """Compiles `source` into `folder` unless already built; returns the library's path.

    Raises:
      RuntimeError: no C++ compiler, or the compilation failed (its output in the message,
        which names `what` was being built).
    """
    out = library_path(source, folder, flags)
    if out.is_file():
        return out
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler (g++) found to build the {what}")
    out.parent.mkdir(parents=True, exist_ok=True)
    link = [f for f in flags if f.startswith("-fsanitize=")]  # its runtime, as a dependency
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, part = Path(tmp) / "kernel.o", Path(tmp) / out.name
        for cmd in ([cxx, *flags, f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", str(obj)],
                    [cxx, "-shared", *link, str(obj), "-o", str(part)]):
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"building the {what} failed:\n{' '.join(cmd)}\n"
                                   f"{res.stderr[-4000:]}")
        os.replace(part, out)  # atomic: a reader never sees half a library
    return out


def load(source: Path, folder: Path, what: str, fallback: str, targets: dict[str, str],
         isa_name: str | None = None, extra: tuple[str, ...] = ()) -> bool:
    """Builds `source` for an ISA (if needed; `extra`: flags after the ISA's), loads it and
    registers each FFI target name -> exported handler symbol with XLA on the CPU, as
    `target(name, isa_name)`; False, with a warning naming `what` and the `fallback` used
    instead, when it cannot be built or loaded (ValueError for an unknown ISA)."""
    chosen = isa(isa_name)
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source, folder, what, (*flags(chosen), *extra))))
    except (RuntimeError, OSError) as err:
        import warnings

        warnings.warn(f"{what} ({chosen}) unavailable, using {fallback}: {err}", stacklevel=3)
        return False
    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(target(name, chosen), jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True
