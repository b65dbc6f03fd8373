"""kernels/cpu_matmul: the packed C++ matmul against float64 numpy, and the engine on it
against the engine on XLA's dot."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpp_build, cpu_matmul, cpu_rows
from paged_jax import compile_cache
from paged_jax.engine import EngineConfig
from paged_jax.engine.runner import matmul_backend
from paged_jax.models.llama import linear, pack_params, prepare_params
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from tests.engine_helpers import GREEDY, engine, prompts, run, tokens
from tests.forward_helpers import prefill_logits

pytestmark = pytest.mark.skipif(not cpu_matmul.load(str(compile_cache.kernel_folder())),
                                reason="no C++ compiler on this machine: the kernel cannot build")

# The numeric tests run on the default build (native) in the fast tier, and on each portable
# build (kernels/cpp_build.py: its AVX2 / scalar paths) in the slow tier; tests/test_cpu_isa.py
# runs a few shapes of each in the fast tier.
ISAS = [pytest.param(None, id="default"),
        *(pytest.param(i, marks=pytest.mark.slow) for i in cpp_build.ISAS if i != "native")]


def matmul_on(isa: str | None):
    """The jitted forward's matmul (`linear`), or the kernel of one ISA's build."""
    if isa is None:
        return jax.jit(linear)
    if not cpu_matmul.load(str(compile_cache.kernel_folder()), isa):
        pytest.skip(f"the {isa} build is not available here")
    return jax.jit(functools.partial(cpu_matmul.matmul, isa=isa))


@pytest.mark.parametrize("m, k, n", [
    (1, 8, 16), (5, 7, 40), (6, 64, 33), (16, 576, 960), (97, 24, 130), (200, 40, 16 * 9 + 1),
    (3, 600, 20), (13, 300, 50)])
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_matches_float64(m, k, n, isa):
    """Rows not a multiple of the micro-kernel's 6 or the task's 96, columns not a multiple of
    the panel's 16 (the last panel is partial, alone or the second of a pair on AVX-512), odd
    K and K past one or two of AVX-512's 256-k chunks; inside jit, as the forward runs it."""
    rng = np.random.default_rng(m * n + k)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((n, k), np.float32)
    got = np.asarray(matmul_on(isa)(jnp.asarray(x), cpu_matmul.pack(w)))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("m, k, n", [
    (2, 64, 40), (5, 7 * 2, 40), (6, 64, 33), (16, 576, 576), (64, 1536, 576), (97, 24, 130),
    (200, 40, 16 * 9 + 1), (3, 600, 20), (1, 576, 40)])
def test_bfloat16_matmul_matches_float64_on_rounded_inputs(m, k, n):
    """bfloat16 panels: x rounded to bfloat16 (16 at a time with AVX-512, as jnp rounds) times
    the weights' bfloat16 values, against float64 on the same values: every panel layout (an
    odd count per task, the matrix's partial last panel alone or second of a pair, 576 wide:
    36 panels) and one row."""
    rng = np.random.default_rng(m * n + k)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((n, k), np.float32)
    x[0, :3] = [1e-40, -0.0, 3.0e30][:k]  # a subnormal, a signed zero, a large value
    packed = cpu_matmul.pack(w, "bfloat16")
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), packed))
    xs = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    want = xs @ np.asarray(cpu_matmul.unpack(packed), np.float64).T
    assert got.shape == (m, n)
    np.testing.assert_allclose(got[:1], want[:1], rtol=1e-5, atol=1e-5 * np.sqrt(k) * 1.5e31)
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.skipif(not cpu_matmul.isa_paths(str(compile_cache.kernel_folder()))
                    & cpu_matmul.PATH_BF16_DOT, reason="this build holds no AVX-512 BF16 path")
def test_bfloat16_rows_equal_at_every_batch_of_two_or_more():
    """On AVX-512 BF16 every panel of a batch of two rows or more runs vdpbf16ps (a run's odd
    last panel too): a row's bits do not depend on the batch it came in."""
    rng = np.random.default_rng(7)
    w = cpu_matmul.pack(rng.standard_normal((576, 1536), np.float32), "bfloat16")
    x = jnp.asarray(rng.standard_normal((64, 1536), np.float32))
    f = jax.jit(cpu_matmul.matmul)
    full = np.asarray(f(x, w))
    for m in (2, 7, 16, 33):
        np.testing.assert_array_equal(np.asarray(f(x[:m], w)), full[:m])


def test_pack_keeps_every_weight_and_pads_with_zeros():
    w = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    p = cpu_matmul.pack(w)
    assert p.panels.shape == (3, 3, 16) and p.shape == (40, 3)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(p)), w)
    assert not np.asarray(p.panels)[2, :, 8:].any()  # columns 40..47 pad
    ids = jnp.asarray([0, 17, 39, 16, 5])
    np.testing.assert_array_equal(np.asarray(cpu_matmul.rows(p, ids)), w[np.asarray(ids)])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_packed_params_give_the_same_logits(tied):
    """pack_params packs every projection and the head (a tied head in place of the
    embedding, whose lookup then reads the panels); the forward's logits do not move."""
    config = tiny_config(tie_word_embeddings=tied)
    params = prepare_params(random_params(config))
    packed = pack_params(params)
    assert ("lm_head" in packed) != tied
    head = packed["embed"] if tied else packed["lm_head"]
    assert isinstance(head, cpu_matmul.Packed)
    assert all(isinstance(p[w], cpu_matmul.Packed) for p in packed["layers"]
               for w in ("w_qkv", "wo", "w_gate_up", "w_down"))
    logits = prefill_logits(config)
    np.testing.assert_allclose(logits(packed), logits(params), rtol=1e-5, atol=1e-5)


def test_engine_tokens_equal_on_packed_and_xla_matmuls():
    """Prefill chunks, decode windows and preemption: the same greedy tokens either way."""
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(6))]
    engines = {b: engine(matmul_backend=b, num_kv_blocks=16) for b in ("cpu", "xla")}
    assert engines["cpu"].runner.matmul == "cpu" and engines["xla"].runner.matmul == "xla"
    outs = {b: run(e, reqs) for b, e in engines.items()}
    for i in range(6):
        assert tokens(outs["cpu"], str(i)) == tokens(outs["xla"], str(i)), f"prompt {i}"


def test_matmul_backend_is_chosen_and_checked():
    assert matmul_backend(None, jnp.float32) == "cpu"
    assert matmul_backend(None, jnp.bfloat16) == "cpu"  # bfloat16 panels
    assert matmul_backend(None, jnp.float16) == "xla"  # the kernel has no float16 panels
    assert matmul_backend("xla", jnp.float32) == "xla"
    with pytest.raises(ValueError, match="needs float32 or bfloat16 weights"):
        matmul_backend("cpu", jnp.float16)
    with pytest.raises(ValueError, match="matmul_backend must be"):
        EngineConfig(matmul_backend="onednn")


@pytest.mark.parametrize("m, k, n", [(1, 128, 40), (16, 576, 960), (97, 24, 130), (1, 24, 17)])
@pytest.mark.parametrize("isa", ISAS)
def test_int8_matmul_is_exact_on_its_dequantized_weights(m, k, n, isa):
    """Int8: the kernel computes xq @ (q * scale).T, xq being x's int8 codes per 32 inputs
    (W8A8: integer dot products where the CPU has AVX-512 VNNI, the float paths on xq
    elsewhere), one row or many: against float64 as close as float32 allows. K = 24 has one
    group per column (32 does not divide it): weight-only, x as it is."""
    rng = np.random.default_rng(m + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((n, k), np.float32)
    p = cpu_matmul.pack(w, "int8")
    assert p.panels.dtype == jnp.int8 and p.scales.shape[1] == (k // 32 if k % 32 == 0 else 1)
    assert p.quantize_x == (k % 32 == 0)
    deq = np.asarray(cpu_matmul.unpack(p), np.float64)
    xs = cpu_matmul.quantized_rows(x) if p.quantize_x else x
    got = np.asarray(matmul_on(isa)(jnp.asarray(x), p))
    np.testing.assert_allclose(got, xs.astype(np.float64) @ deq.T, rtol=1e-5,
                               atol=1e-5 * np.sqrt(k))
    if p.quantize_x:  # x's codes, not x: a weight-only product is further off than that
        assert np.abs(got - x.astype(np.float64) @ deq.T).max() > 1e-3


def test_int8_keeps_a_four_bit_source_grid():
    """A weight whose every group of 32 lies on a 4-bit grid (a GGUF Q4_1 tensor, dequantized)
    is kept on it, as int4 codes with float16 scales and mins: exact to float16, where
    symmetric int8 codes would move each weight by up to half of max |w| / 127. Its x is
    quantized as for int8 codes (W4A8: the integer path, one row or many); a weight off
    any such grid, or one packed with keep_grid=False, gets int8 codes. Tensor parallelism
    shards either (tests/test_tensor_parallel.py)."""
    rng = np.random.default_rng(5)
    d = rng.uniform(0.01, 0.1, (40, 4, 1)).astype(np.float16).astype(np.float32)
    mn = rng.uniform(-1, 0, (40, 4, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (40, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # as Q4_1: the block's min and max are codes 0 and 15
    w = (q * d + mn).reshape(40, 128).astype(np.float32)
    p = cpu_matmul.pack(w, "int8")
    assert p.panels.dtype == jnp.uint8 and p.mins.dtype == jnp.float16 and p.quantize_x
    np.testing.assert_allclose(np.asarray(cpu_matmul.unpack(p)), w, rtol=0, atol=1e-6)
    for m in (1, 3, 8):  # x quantized per row and 32 inputs, as for int8 codes (W4A8)
        x = rng.standard_normal((m, 128), np.float32)
        xq = cpu_matmul.quantized_rows(x).astype(np.float64)
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(jnp.asarray(x), p)),
                                   xq @ w.astype(np.float64).T, rtol=1e-5, atol=1e-4)
    assert cpu_matmul.pack(w, "int8", keep_grid=False).panels.dtype == jnp.int8
    w[3, 7] += 1e-3  # one weight off its block's grid
    assert cpu_matmul.pack(w, "int8").panels.dtype == jnp.int8
    # past the first 16 panels that pack checks before searching the whole tensor
    q = rng.integers(0, 16, (320, 32))
    q[:, 0], q[:, 1] = 0, 15
    w = (q * d[0, 0] + mn[0, 0]).astype(np.float32)
    assert cpu_matmul.pack(w, "int8").panels.dtype == jnp.uint8
    w[300, 5] += 1e-3  # in panel 18
    assert cpu_matmul.pack(w, "int8").panels.dtype == jnp.int8


def test_int8_rounds_each_weight_to_within_half_a_step():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((50, 128), np.float32) * np.linspace(0.01, 3, 128, dtype=np.float32)
    p = cpu_matmul.pack(w, "int8")
    step = np.repeat(np.asarray(p.scales, np.float32), 32, axis=1)
    step = step.transpose(0, 2, 1).reshape(-1, 128)[:50]
    assert np.all(np.abs(np.asarray(cpu_matmul.unpack(p)) - w) <= step / 2 + 1e-7)
    ids = jnp.asarray([0, 49, 17])
    np.testing.assert_array_equal(np.asarray(cpu_matmul.rows(p, ids)),
                                  np.asarray(cpu_matmul.unpack(p))[np.asarray(ids)])


def test_int8_engine_is_batch_invariant_and_tracks_float32():
    """quantization="int8": int8 panels in the runner; batched tokens equal one-at-a-time
    tokens, and most greedy tokens equal float32's (int8 moves the tiny model's logits a
    little; a near-tie may flip, and then the rest of that sequence differs)."""
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(6))]
    q = engine(quantization="int8")
    assert q.runner.params["layers"][0]["w_qkv"].panels.dtype == jnp.int8
    same = batch_invariant(q, lambda: engine(quantization="int8"), engine(), reqs)
    assert same >= 4, f"int8 greedy equals float32 on only {same} of 6 prompts"


def batch_invariant(eng, fresh, f32, reqs) -> int:
    """Asserts `eng`'s batched tokens equal one-at-a-time tokens (each request on `fresh()`);
    returns on how many requests they equal the float32 engine `f32`'s."""
    batched = run(eng, reqs)
    single = {rid: run(fresh(), [(rid, p, sp)])[rid] for rid, p, sp in reqs}
    f32_out = run(f32, reqs)
    for rid, _, _ in reqs:
        assert tokens(batched, rid) == tokens(single, rid), f"prompt {rid}"
    return sum(tokens(batched, rid) == tokens(f32_out, rid) for rid, _, _ in reqs)


def test_int8_needs_the_cpu_kernel():
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="reads float weights"):
        EngineConfig(quantization="int8", matmul_backend="xla")


def bf16_parts():
    """The tiny model in bfloat16 (its float32 weights rounded), and the float32 model on
    exactly those rounded weights."""
    c = tiny_config()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_params(c))
    return (c, params, byte_tokenizer()), (c, jax.tree.map(
        lambda x: x.astype(jnp.float32), params), byte_tokenizer())


def test_bfloat16_engine_runs_packed_bfloat16_and_is_batch_invariant():
    """A bfloat16 model on CPU: bfloat16 panels in the C++ kernel (float32 activations, x
    rounded to bfloat16 in the kernel), bfloat16 K/V; batched tokens equal one-at-a-time
    tokens, and most greedy tokens equal the float32 model's on the same weights."""
    parts, f32_parts = bf16_parts()
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(6))]
    eng = engine(parts)
    assert eng.runner.matmul == "cpu" and eng.runner.weights == "bfloat16"
    assert eng.runner.params["layers"][0]["w_qkv"].panels.dtype == jnp.uint16
    assert eng.state.cache.dtype == jnp.bfloat16
    same = batch_invariant(eng, lambda: engine(parts), engine(f32_parts), reqs)
    assert same >= 4, f"bfloat16 greedy equals float32 on only {same} of 6 prompts"


def test_bfloat16_logits_track_float32_on_the_same_weights():
    """The packed bfloat16 forward's logits against float32's on the same (bfloat16) weights:
    only x's rounding to bfloat16 in each matmul differs, about 2^-9 of each input."""
    (c, params, _), (_, f32, _) = bf16_parts()
    logits = prefill_logits(c)
    got = logits(pack_params(prepare_params(params), "bfloat16"))
    want = logits(prepare_params(f32))
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).sum() >= 4


@pytest.mark.skipif(not cpu_matmul.isa_paths(str(compile_cache.kernel_folder()))
                    & cpu_matmul.PATH_AMX_BF16, reason="this build holds no AMX tiles")
@pytest.mark.parametrize("k", [64, 576])
def test_amx_rows_equal_at_every_batch(k):
    """With AMX every row count runs the same tiles, each row's sums in the same order: a row
    alone, in a batch of 5, 16, 33 or 97 (one or two tiles of rows, padded; one or several
    tasks) gives the same bits, and matches float64 on bfloat16-rounded x. The other paths
    agree only to rounding (one row widened in registers, vdpbf16ps from two)."""
    rng = np.random.default_rng(k)
    w = cpu_matmul.pack(rng.standard_normal((16 * 7 + 3, k), np.float32), "bfloat16")
    x = rng.standard_normal((97, k), np.float32)
    f = jax.jit(cpu_matmul.matmul)
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[i:i + 1]), w)) for i in range(97)])
    for m in (5, 16, 33, 97):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), w)), alone[:m])
    xs = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    want = xs @ np.asarray(cpu_matmul.unpack(w), np.float64).T
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("s, v", [(1, 5), (5, 32), (9, 1000), (64, 49152 + 7)])
def test_row_argmax_answers_as_jnp_argmax(s, v):
    """Greedy sampling's row kernel: ties go to the lowest id (inside a vector lane, across
    lanes and in the tail past the last 32), a row of -inf gives 0, a row with NaNs its first
    NaN, a row of equal values 0."""
    rng = np.random.default_rng(s + v)
    x = rng.standard_normal((s, v)).astype(np.float32)
    x[0, v - 1] = x[0, min(2, v - 1)] = 9.0  # a tie: the tail's copy loses
    if s > 1:
        x[1], x[2] = -np.inf, 3.0
        x[3, [v // 2, v - 1, v // 3]] = np.nan
        x[4, [v // 5, v // 7, v - 1]] = 50.0
    got = np.asarray(jax.jit(cpu_rows.row_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=1)))
    assert got.dtype == np.int32
