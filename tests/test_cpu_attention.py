"""kernels/cpu_attention: the C++ kernel against a float64 numpy loop and the jnp reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpp_build, cpu_attention
from paged_jax import compile_cache
from paged_jax.models.attention import cpu_kernel_available, default_backend, paged_attention
from tests.attention_helpers import jitted, naive
from tests.engine_helpers import GREEDY, engine, prompts, run, tokens

pytestmark = pytest.mark.skipif(not cpu_kernel_available(),
                                reason="no C++ compiler on this machine: the kernel cannot build")

# The numeric tests run on the default build (native) in the fast tier, and on each portable
# build (kernels/cpp_build.py) in the slow tier; tests/test_cpu_isa.py runs a batch of each
# in the fast tier.
ISAS = [pytest.param(None, id="default"),
        *(pytest.param(i, marks=pytest.mark.slow) for i in cpp_build.ISAS if i != "native")]


def attention_on(isa: str | None):
    """The kernel of the default build, or of one ISA's."""
    if isa is not None and not cpu_attention.load(str(compile_cache.kernel_folder()), isa):
        pytest.skip(f"the {isa} build is not available here")
    return functools.partial(cpu_attention.paged_attention, isa=isa)


@st.composite
def batches(draw):
    """Ragged rows (prefill chunks, decodes, empty rows) over shuffled pages; NaN in every
    block no row holds, so a read past a row's pages shows up in the output. Head dims of 16
    and 64 take the AVX-512 path that reads a KV head's query heads together (in passes of up
    to 4: groups of 6 and 7 split 3 + 3 and 4 + 3), 8 the general one."""
    rows, kb = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 4, 16, 32]))
    h, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 4, 6, 7]))
    d = draw(st.sampled_from([8, 16, 64]))
    pages = draw(st.integers(1, 4))
    lens = np.array(draw(st.lists(st.integers(0, pages * kb), min_size=rows, max_size=rows)))
    num_q = np.array([draw(st.integers(0, min(6, x))) for x in lens])
    n = rows * pages + 2
    tables = np.zeros((rows, pages), np.int32)
    held = -(-lens // kb)
    perm = np.array(draw(st.permutations(range(1, n))))
    tables[np.arange(pages)[None, :] < held[:, None]] = perm[: held.sum()]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    k, v = (rng.standard_normal((h, n, kb, d)).astype(np.float32) for _ in range(2))
    k[:, 0] = v[:, 0] = 0.0  # the zero block
    free = np.ones(n, bool)
    free[tables[tables > 0]] = free[0] = False
    k[:, free] = v[:, free] = np.nan
    query_start = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    q = rng.standard_normal((num_q.sum() + 2, h * group, d)).astype(np.float32)  # 2 padding
    return q, k, v, tables, lens.astype(np.int32), query_start


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_kernel_matches_naive(isa, batch):
    got = np.asarray(attention_on(isa)(*map(jnp.asarray, batch), scale=0.3))
    assert np.all(np.isfinite(got)), "a NaN from a free block leaked"
    np.testing.assert_allclose(got, naive(*batch, 0.3), atol=1e-5, rtol=1e-5)
    assert not got[batch[5][-1]:].any(), "padding tokens must read zeros"


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=5, deadline=None)
@given(batch=batches())
def test_bfloat16_matches_reference_in_float32(isa, batch):
    bf = [jnp.asarray(x, jnp.bfloat16) for x in batch[:3]] + list(map(jnp.asarray, batch[3:]))
    got = attention_on(isa)(*bf, scale=0.3)
    assert got.dtype == jnp.bfloat16
    want = naive(*[np.asarray(x, np.float32) for x in bf[:3]], *batch[3:], 0.3)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d, group", [(64, 3), (64, 7), (16, 6), (8, 3)])
def test_a_query_gives_the_same_bits_alone_or_in_a_chunk(dtype, d, group):
    """A decode row (one query) and the same position as the last query of a prefill or
    verify chunk give the same bits: a query's arithmetic does not depend on the others in
    its call (speculative decoding's greedy tokens equal plain decoding's)."""
    rng = np.random.default_rng(d * group)
    h, kb, n, length = 2, 32, 12, 150
    k, v = (jnp.asarray(rng.standard_normal((h, n, kb, d)), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((5, h * group, d)), dtype)
    tables = jnp.asarray(rng.permutation(np.arange(1, n))[None, :5].astype(np.int32))
    lens = jnp.asarray([length], jnp.int32)
    call = functools.partial(cpu_attention.paged_attention, scale=d ** -0.5)
    chunk = call(q, k, v, tables, lens, jnp.asarray([0, 5], jnp.int32))
    alone = call(q[4:], k, v, tables, lens, jnp.asarray([0, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(chunk[4:], np.float32),
                                  np.asarray(alone, np.float32))


@settings(max_examples=5, deadline=None)
@given(batch=batches())
def test_jitted_backend_equals_reference_backend(batch):
    batch = [jnp.asarray(x) for x in batch]
    call = functools.partial(paged_attention, max_q=6, scale=0.3)
    ours = jax.jit(functools.partial(call, backend="cpu"))(*batch)
    ref = jax.jit(functools.partial(call, backend="reference"))(*batch)
    np.testing.assert_allclose(np.asarray(ours), np.nan_to_num(np.asarray(ref)), atol=1e-5)


def test_default_backend_on_cpu_is_the_kernel():
    assert default_backend() == "cpu"


def test_engine_tokens_equal_on_both_backends():
    """Prefill chunks, decode windows and preemption on the kernel give the reference's
    greedy tokens (the tiny model's margins are wide: no near-ties to flip)."""
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(6))]
    engines = {b: engine(backend=b, num_kv_blocks=16) for b in ("cpu", "reference")}
    outs = {b: run(e, reqs) for b, e in engines.items()}
    assert engines["cpu"].scheduler.num_preempted > 0, "the small pool should preempt"
    for i in range(6):
        assert tokens(outs["cpu"], str(i)) == tokens(outs["reference"], str(i)), f"prompt {i}"


def test_loading_the_kernel_keeps_subnormal_floats():
    """A -ffast-math shared library can switch the whole process to flush-to-zero; the
    build links without it, so numpy, torch and XLA keep IEEE subnormals."""
    assert cpu_kernel_available()
    assert np.float32(1e-40) * np.float32(1.0) != 0.0  # (XLA flushes in its own threads)


def quantized_pages_match(isa, batch, name):
    """int8 / fp8 pages with two scales per row (groups of D / 2); free blocks' scales are
    NaN."""
    from paged_jax.cache import kv_quant

    q, k, v, tables, lens, qs = batch
    dt = kv_quant.storage_dtype(name, jnp.float32)
    pages = []
    for x in (k, v):
        vals, scale = jitted(kv_quant.quantize, dtype=dt, group=x.shape[-1] // 2)(
            jnp.asarray(np.nan_to_num(x)))
        pages.append((vals, jnp.where(jnp.isnan(x).any(-1)[..., None], jnp.nan, scale)))
    args = (jnp.asarray(q), *pages, *map(jnp.asarray, (tables, lens, qs)))
    got = np.asarray(attention_on(isa)(*args, scale=0.3))
    ref = np.asarray(jitted(paged_attention, max_q=8, backend="reference", scale=0.3)(*args))
    assert np.all(np.isfinite(got)), "a NaN from a free block leaked"
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


# Each example compiles its shapes (seconds): a few in the fast tier (the default build; the
# portable builds' in the slow tier), more in the slow tier's twin (tests/conftest.py).
_QUANTIZED = given(batch=batches(), name=st.sampled_from(["int8", "fp8", "fp8_e5m2"]))
test_quantized_pages_match_the_reference = pytest.mark.parametrize("isa", ISAS)(
    settings(max_examples=5, deadline=None)(_QUANTIZED(quantized_pages_match)))
test_quantized_pages_match_the_reference_deep = pytest.mark.parametrize("isa", ISAS[:1])(
    settings(max_examples=24, deadline=None)(_QUANTIZED(quantized_pages_match)))


def test_inconsistent_shapes_are_refused():
    """V with fewer blocks than K, or scales of other pages, would be read past their end:
    the kernel itself refuses them (called directly: the wrapper's type hints check shapes
    only under tests), an error, not undefined behaviour."""
    q, k = jnp.zeros((1, 2, 8)), jnp.zeros((1, 4, 2, 8))
    ints = [jnp.asarray(x, jnp.int32) for x in ([[1]], [1], [0, 1])]
    attrs = dict(scale=np.float32(1), window=np.int32(0))
    call = lambda name: jax.ffi.ffi_call(cpp_build.target(name), q)  # noqa: E731
    with pytest.raises(Exception, match="inconsistent q / k / v"):
        np.asarray(call(cpu_attention.TARGET)(q, k, k[:, :2], *ints, **attrs))
    vals, scale = jnp.zeros((1, 4, 2, 8), jnp.int8), jnp.ones((1, 4, 2, 2))
    with pytest.raises(Exception, match="scales must be"):
        np.asarray(call(cpu_attention.TARGET_QUANT)(q, vals, vals, scale[:, :2], scale, *ints,
                                                    e5m2=np.int32(0), **attrs))
