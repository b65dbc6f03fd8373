"""kernels/cpp_build's ISA switch: each ISA's build holds its own code paths (the scalar and
AVX2 ones that an AVX-512 machine's native build never compiles), and on each one the matmul
and attention kernels match float64; a NaN or Inf in a row of activations gives NaN or Inf in
that row's output only (as the float64 math does), never finite codes.

Every ISA builds once per process (each library registers its own FFI target names); deeper
checks of the portable builds run in the slow tier of tests/test_cpu_matmul*.py and
tests/test_cpu_attention.py."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpp_build, cpu_attention, cpu_lora, cpu_matmul, cpu_rows
from paged_jax import compile_cache
from tests.attention_helpers import naive

X86 = platform.machine().lower() in ("x86_64", "amd64")
PATH_BITS = {"avx512f": 1, "avx2": 2, "f16c": 4, "avx_vnni": 8, "fma": 16,
             "avx512_bf16": 32, "amx_bf16": 64, "avx512_vnni": 128}  # PagedJaxIsaPaths' bits
WEIGHTS = ("float32", "bfloat16", "int8", "int4", "int4-grid")  # int4-grid: int8 kept a grid


@functools.cache
def built(isa: str) -> bool:
    """Both kernels built and registered for `isa` (once per process)."""
    folder = str(compile_cache.kernel_folder())
    return cpu_matmul.load(folder, isa) and cpu_attention.load(folder, isa)


def test_the_kernels_build_wherever_a_compiler_is():
    """Every kernel test skips where its library did not build, which must mean no compiler:
    a build error there (a change that does not compile) would otherwise skip them all and
    pass (the engine falls back to XLA). The native build of each library loads."""
    if cpp_build.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    folder = str(compile_cache.kernel_folder())
    for lib in (cpu_matmul, cpu_attention, cpu_lora):
        assert lib.load(folder), f"{lib.__name__} did not build (its warning says why)"


@pytest.fixture(params=list(cpp_build.ISAS))
def isa(request) -> str:
    if request.param != "native" and not X86:
        pytest.skip("x86-64 ISA levels build only on x86-64")
    if not built(request.param):
        pytest.skip("no C++ compiler on this machine: the kernels cannot build")
    return request.param


def cpu_flags() -> set[str]:
    try:
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def library(source, isa: str):
    return cpp_build.library_path(source, compile_cache.kernel_folder(), cpp_build.flags(isa))


def test_each_isa_compiles_its_own_paths(isa):
    """x86-64-v2 holds none of the AVX paths (its halves, rounding, byte widening and int4 run
    in scalar code or SSE), x86-64-v3 the AVX2 ones without AVX-512, native what the CPU has."""
    paths = ctypes.CDLL(str(library(cpu_matmul.SOURCE, isa))).PagedJaxIsaPaths()
    got = {name for name, bit in PATH_BITS.items() if paths & bit}
    want = {"x86-64-v2": set(), "x86-64-v3": {"avx2", "f16c", "fma"},
            "native": cpu_flags() & PATH_BITS.keys()}[isa]
    assert got == want


def test_each_isa_keeps_a_vector_exp(isa):
    """The softmax's exp stays vectorized with NaN and Inf honoured (-fno-finite-math-only
    hides glibc's declaration of it; cpu_attention.cc declares it again): libmvec's
    _ZGV{b,d,e}N*v_expf, of the ISA's width (native: the compiler's choice)."""
    if os.environ.get(cpp_build.SANITIZE_ENV):
        pytest.skip("the sanitizer's checks keep the loop scalar")
    text = library(cpu_attention.SOURCE, isa).read_bytes()
    widths = set(re.findall(rb"_ZGV([bcde])N\d+v_expf", text))
    assert widths, "no vector expf: the softmax's exp runs one lane at a time"
    assert widths == {"x86-64-v2": {b"b"}, "x86-64-v3": {b"d"}}.get(isa, widths)


def test_isas_build_apart_and_an_unknown_one_is_refused(monkeypatch):
    folder = compile_cache.kernel_folder()
    paths = {library(cpu_matmul.SOURCE, i) for i in cpp_build.ISAS}
    assert len(paths) == len(cpp_build.ISAS)
    assert cpp_build.target("t", "x86-64-v2") == "t_x86_64_v2"
    monkeypatch.setenv(cpp_build.ISA_ENV, "x86-64-v3")
    assert cpp_build.isa() == "x86-64-v3" and "-march=x86-64-v3" in cpp_build.flags()
    monkeypatch.setenv(cpp_build.ISA_ENV, "pentium4")
    with pytest.raises(ValueError, match="PAGED_JAX_CPU_ISA"):
        cpu_matmul.load(str(folder))
    monkeypatch.setenv(cpp_build.SANITIZE_ENV, "undefined")
    assert "-fsanitize=undefined" in cpp_build.flags("native")


def packed(weights: str, n: int, k: int, rng) -> cpu_matmul.Packed:
    """A random [n, k] weight packed as `weights`; int4-grid lies on a 4-bit grid per 32
    inputs (a GGUF Q4 tensor), which int8 packing keeps as int4 codes with float16 scales
    and mins, x quantized (W4A8)."""
    if weights != "int4-grid":
        return cpu_matmul.pack(rng.standard_normal((n, k), np.float32), weights)
    d = rng.uniform(0.01, 0.1, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    lo = rng.uniform(-1, 0, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    w = (rng.integers(0, 16, (n, k // 32, 32)) * d + lo).reshape(n, k).astype(np.float32)
    p = cpu_matmul.pack(w, "int8")
    assert p.mins is not None and p.supers is None and p.quantize_x
    return p


def want_matmul(x: np.ndarray, p: cpu_matmul.Packed) -> np.ndarray:
    """float64 x @ w.T on the packed weight's values, x quantized where the kernel quantizes
    it (a group holding NaN or Inf is then NaN), or rounded to bfloat16 against bfloat16
    weights (every path of the kernel rounds it)."""
    with np.errstate(invalid="ignore"):
        xs = cpu_matmul.quantized_rows(x) if p.quantize_x else x
        if p.panels.dtype == jnp.uint16:
            xs = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
        return xs.astype(np.float64) @ np.asarray(cpu_matmul.unpack(p), np.float64).T


def run_matmul(x: np.ndarray, p: cpu_matmul.Packed, isa: str) -> np.ndarray:
    return np.asarray(jax.jit(functools.partial(cpu_matmul.matmul, isa=isa))(jnp.asarray(x), p))


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("m, k, n", [(1, 96, 41), (13, 576, 130)])
def test_matmul_matches_float64_on_every_isa(isa, weights, m, k, n):
    """One row (codes widened in registers, or int4's integer row) and 13 (the micro-kernels,
    AVX-512's panel pairs and 256-k chunks where built, a partial last panel)."""
    rng = np.random.default_rng(m * k + n)
    p, x = packed(weights, n, k, rng), rng.standard_normal((m, k), np.float32)
    np.testing.assert_allclose(run_matmul(x, p, isa), want_matmul(x, p), rtol=1e-5,
                               atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("weights", WEIGHTS)
def test_matmul_nan_and_inf_stay_in_their_row(isa, weights):
    """Row 1 holds a NaN, row 4 an Inf, alone or in the batch: those rows' outputs are not
    finite where float64's are not (an Inf with float64's sign, or NaN: weight-only int4 sums
    codes times x, and code 0 times Inf is NaN; int4's quantized x is NaN), the other rows
    match float64."""
    rng = np.random.default_rng(11)
    p, x = packed(weights, 40, 96, rng), rng.standard_normal((6, 96), np.float32)
    x[1, 40], x[4, 7] = np.nan, np.inf
    want = want_matmul(x, p)
    assert np.isnan(want[1]).all() and not np.isfinite(want[4]).any()
    assert np.isfinite(np.delete(want, [1, 4], axis=0)).all()
    for rows in (slice(0, 6), slice(1, 2), slice(4, 5)):
        got, w = run_matmul(x[rows], p, isa), want[rows]
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(w), err_msg=f"{rows}")
        inf = np.isinf(got)
        np.testing.assert_array_equal(got[inf], w[inf], err_msg=f"{rows}: Inf signs")
        ok = np.isfinite(w)
        np.testing.assert_allclose(got[ok], w[ok], rtol=1e-5, atol=1e-4, err_msg=f"{rows}")


def attention_batch(pages_dtype: str, rng) -> tuple[list, list]:
    """A decode, a prefill chunk across pages, a two-token chunk and a first token over
    shuffled pages of 4 tokens (2 KV heads, 2 query heads each, D = 8): the kernel's arguments
    (pages as stored) and naive's (pages in float32)."""
    h, kb, d, n = 2, 4, 8, 30
    lens, num_q = np.array([5, 19, 11, 1], np.int32), np.array([1, 6, 2, 1])
    tables = rng.permutation(np.arange(1, n))[:24].reshape(4, 6).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    q = rng.standard_normal((int(num_q.sum()) + 1, 2 * h, d)).astype(np.float32)  # 1 padding
    kv = [rng.standard_normal((h, n, kb, d)).astype(np.float32) for _ in range(2)]
    if pages_dtype in ("float32", "bfloat16"):
        stored = [jnp.asarray(x, pages_dtype) for x in kv]
        plain = [np.asarray(x, np.float32) for x in stored]
    else:
        dt = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
        vals = [jnp.asarray(np.clip(np.rint(x * 20), -127, 127), jnp.float32).astype(
            dt[pages_dtype]) for x in kv]
        scales = [rng.uniform(0.01, 0.1, (h, n, kb, 2)).astype(np.float32) for _ in kv]
        stored = [(v, jnp.asarray(s)) for v, s in zip(vals, scales, strict=True)]
        plain = [(np.asarray(v, np.float32).reshape(h, n, kb, 2, 4) * s[..., None]).reshape(
            h, n, kb, d) for v, s in zip(vals, scales, strict=True)]
    ints = [tables, lens, starts]
    return [jnp.asarray(q), *stored, *map(jnp.asarray, ints)], [q, *plain, *ints]


def run_attention(args: list, isa: str, window: int | None = None) -> np.ndarray:
    call = functools.partial(cpu_attention.paged_attention, scale=0.3, window=window, isa=isa)
    return np.asarray(jax.jit(call)(*args), np.float32)


@pytest.mark.parametrize("pages", ["float32", "bfloat16", "int8", "fp8", "fp8_e5m2"])
def test_attention_matches_float64_on_every_isa(isa, pages):
    """Each page dtype's decoding (vectorized per ISA) and the softmax, with and without a
    sliding window; padding tokens read zeros."""
    args, plain = attention_batch(pages, np.random.default_rng(3))
    for window in (None, 6):
        got = run_attention(args, isa, window)
        np.testing.assert_allclose(got, naive(*plain, 0.3, window), rtol=1e-5, atol=1e-5)
        assert not got[-1].any(), "the padding token must read zeros"


def test_attention_nan_and_inf_stay_in_their_query_head(isa):
    """A NaN in one query head, an Inf in another (of the prefill chunk) and in a first
    token's (one key, its score -Inf): those query heads' outputs are NaN, as float64's
    softmax (Inf - Inf), every other head and token matches float64."""
    args, plain = attention_batch("float32", np.random.default_rng(4))
    q, k, tables = plain[0], plain[1], plain[3]
    q[1, 2, 5], q[3, 0, 1] = np.nan, np.inf
    q[9, 1, 2] = -np.inf * np.sign(k[0, tables[3, 0], 0, 2])  # head 1 reads KV head 0
    args[0] = jnp.asarray(q)
    with np.errstate(invalid="ignore"):
        want = naive(*plain, 0.3)
    bad = np.zeros(q.shape[:2], bool)
    bad[1, 2] = bad[3, 0] = bad[9, 1] = True
    assert np.isnan(want[bad]).all() and np.isfinite(want[~bad]).all()
    np.testing.assert_allclose(run_attention(args, isa), want, rtol=1e-5, atol=1e-5)


def test_row_logprobs_match_float64_on_every_isa(isa):
    """kernels/cpu_logprobs.h (its own vector exp, a double sum) against float64 log_softmax:
    logprobs, ranks and the top J, on a row with ties and a row of the 152k vocabulary."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 152064)) * 5).astype(np.float32)
    x[1, :1000] = np.round(x[1, :1000])  # ties: the lower id first
    tokens, active = np.array([5, 7, 9], np.int32), np.array([1, 1, 0], np.int32)
    got = [np.asarray(a) for a in jax.jit(functools.partial(
        cpu_rows.row_logprobs, num_top=20, isa=isa))(x, tokens, active)]
    x64 = x.astype(np.float64)
    lsm = x64 - x64.max(1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(1, keepdims=True))
    for r in (0, 1):
        order = np.lexsort((np.arange(x.shape[1]), -x[r]))[:20]
        np.testing.assert_array_equal(got[2][r], order)
        np.testing.assert_allclose(got[3][r], lsm[r, order], rtol=0, atol=2e-6)
        np.testing.assert_allclose(got[0][r], lsm[r, tokens[r]], rtol=0, atol=2e-6)
        assert got[1][r] == 1 + (x[r] > x[r, tokens[r]]).sum()
    assert not any(a[2].any() for a in got)


def test_argmax_with_blocked_ids_is_argmax_of_the_row_with_them_at_minus_inf(isa):
    """cpu_argmax.h's row_argmax_blocked (greedy sampling under min_tokens): the rows'
    maxima blocked, not blocked, a NaN row, no ids at all (-1), ties to the lower id."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((5, 3001)).astype(np.float32)
    x[0, 17] = x[0, 99] = 50.0  # blocked max: the next best
    x[1, 5] = 40.0  # its max is not blocked
    x[2, 2000] = np.nan
    x[4, [3, 8]] = 30.0  # blocked 3: tie left is 8
    blocked = np.array([[17, 99, -1], [6, -1, -1], [2000, -1, -1], [-1, -1, -1],
                        [3, -1, -1]], np.int32)
    got = np.asarray(jax.jit(functools.partial(cpu_rows.row_argmax, isa=isa))(
        x, blocked=blocked))
    want = x.copy()
    for r, ids in enumerate(blocked):
        want[r, ids[ids >= 0]] = -np.inf
    np.testing.assert_array_equal(got, np.argmax(want, axis=1))
