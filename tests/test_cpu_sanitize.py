"""The C++ kernels under UndefinedBehaviorSanitizer (slow tier): every ISA's build of both
kernels, with `-fsanitize=undefined,float-cast-overflow -fno-sanitize-recover`, runs the
kernel tests in a child process, which a report would abort. The child's output is kept in
/tmp/paged_jax_ubsan.log. A planted signed overflow first shows that a report does reach us
from a library loaded this way (its runtime comes in as the library's dependency, no
LD_PRELOAD).

UBSan does not see everything: GCC does not instrument shifts of vector lanes, nor type-based
aliasing; cpu_matmul_quant.h avoids those by construction (unsigned lanes, may_alias)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpp_build, cpu_attention, cpu_matmul
from paged_jax import compile_cache


def _has_ubsan() -> bool:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        return False
    found = subprocess.run([cxx, "-print-file-name=libubsan.so"], capture_output=True,
                           text=True, check=False).stdout.strip()
    return os.path.isabs(found)  # the bare name when g++ has no such runtime


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                 reason="the ISA levels checked are x86-64's"),
              pytest.mark.skipif(not _has_ubsan(), reason="no g++ with libubsan here")]

CHECKS = "undefined,float-cast-overflow"
LOG = Path("/tmp/paged_jax_ubsan.log")
TESTS = ["tests/test_cpu_isa.py", "tests/test_cpu_matmul.py::test_matmul_matches_float64",
         "tests/test_cpu_matmul_int4.py::test_int4_matmul_is_exact_on_its_codes",
         "tests/test_cpu_attention.py::test_kernel_matches_naive",
         "tests/test_cpu_attention.py::test_quantized_pages_match_the_reference"]
PLANTED = """#include <cstdint>
extern "C" int32_t shift(int32_t x, int32_t by) { return x << by; }
"""


def sanitized_env() -> dict[str, str]:
    return {**os.environ, cpp_build.SANITIZE_ENV: CHECKS,
            "UBSAN_OPTIONS": "print_stacktrace=1:report_error_type=1"}


def test_a_planted_overflow_is_reported(tmp_path, monkeypatch):
    """x << 31 for x = 3 overflows int32: the sanitized library aborts its process with the
    report (what the kernel run below must never show)."""
    src = tmp_path / "planted.cc"
    src.write_text(PLANTED)
    monkeypatch.setenv(cpp_build.SANITIZE_ENV, CHECKS)
    lib = cpp_build.build(src, tmp_path, "planted UB", cpp_build.flags("native"))
    call = f"import ctypes; print(ctypes.CDLL({str(lib)!r}).shift(3, 31))"
    res = subprocess.run([sys.executable, "-c", call], env=sanitized_env(), capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode != 0 and "runtime error: left shift" in res.stderr, res.stderr


def test_kernels_run_clean_under_ubsan(monkeypatch):
    """Each ISA's float32, bfloat16, int8 and int4 (W8A8, W4A8) matmuls and float / quantized
    attention, NaN and Inf rows included: no report, and the libraries that ran were the
    instrumented ones."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "-p", "no:xdist", *TESTS]
    res = subprocess.run(cmd, env=sanitized_env(), capture_output=True, text=True,
                         timeout=1500, check=False, cwd=Path(__file__).parents[1])
    LOG.write_text(res.stdout + res.stderr)
    assert "runtime error" not in res.stdout + res.stderr, f"see {LOG}"
    assert res.returncode == 0, f"see {LOG}:\n{res.stdout[-2000:]}"
    monkeypatch.setenv(cpp_build.SANITIZE_ENV, CHECKS)  # the child's flags, its libraries
    folder = compile_cache.kernel_folder()
    libs = [cpp_build.library_path(s, folder, cpp_build.flags(isa))
            for s in (cpu_matmul.SOURCE, cpu_attention.SOURCE) for isa in cpp_build.ISAS]
    assert all(b"__ubsan_handle" in p.read_bytes() for p in libs), libs
