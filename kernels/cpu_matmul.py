"""Float32 matmuls on CPUs against weights packed in panels: a C++ kernel (cpu_matmul.cc)
called through XLA's FFI.

Why: at serving batch sizes (a few to a few dozen rows) XLA:CPU's dot runs far below the
machine's FMA peak, because it repacks the whole weight matrix on every call; the weights do
not change, so they are packed once, at load (`pack`), into the layout the kernel's
micro-kernel streams. `python -m kernels.cpu_matmul` checks the kernel against XLA's dot and
times both on SmolLM2-135M's projection shapes (the numbers are in its output; on the 2-core
Zen 3 machine, in one run, the 16-row gate|up projection took 0.76 ms against XLA's 1.0 ms
and the 16-row LM head 14.7 against 23.5 ms; on a 2-core AVX-512 Zen 5, with the two-panel
AVX-512 micro-kernel, the 64-row LM head 11.3 ms against XLA's 13.2, where the 8-float tile
took 27.3 against 15.1).

    Packed     panels [P, K, 16] of w [N, K] (the runtime form's [out, in] projections),
               P = ceil(N / 16), zero-padded past N; n = N (static); int8 and int4 panels
               hold codes in blocks of k and carry group scales (cpu_matmul_quant.h)
    matmul     x [..., K] @ w.T -> [..., N], float32
    rows       w[ids] read back from the panels (a tied embedding's lookup)

Int8 (`pack(w, "int8")`, W8A8): symmetric, round to nearest, a float16 scale per output
column and group of G = 32 consecutive inputs (G = K when 32 does not divide K): max |w| of
the group / 127; 32 as int4, so that a group never straddles two devices' shards under tensor
parallelism when K / N is a multiple of 32 (parallel.pack_shards). The kernel quantizes x per
row and 32 inputs as for int4 (below) and, on CPUs with AVX-512 VNNI, multiplies the codes
in integers (512-bit vpdpbusd, two panels and up to six rows per block of codes; `python -m
kernels.cpu_matmul` times it beside the other panels); elsewhere the float paths multiply x's
quantized values. With G = K, x stays as it is (weight-only). A
weight whose every group already lies on a 4-bit grid (a GGUF Q4 tensor, dequantized at
load) keeps that grid instead, as int4 codes with a float16 scale and min per group
(kernels/weight_codes.py): moving each weight to a symmetric 8-bit grid would only add error.
Its x is quantized as for any int8 weight, and the codes multiply in integers on int4's path
(W4A8). Kept weight-only (W4A16), two rows or more ran the float micro-kernel on each decoded
panel: on SmolLM2's Q4_1 file, whose every projection keeps its grid, int8 decoded 16 rows at
0.64x int4's speed and prefilled at 0.45x (`python -m experiments.step_profile --batches 16
--dtypes int8 int4`, 2-core AMD EPYC Zen 4).
Int4 (`pack(w, "int4")`, W4A8): asymmetric 4-bit codes per 32 inputs on each group's best
4-bit grid (a GGUF Q4 block's own, where it came from one), the group's scale and min coded in
8 bits against float16 units per column and up to 8 groups (4.6 bits a weight in all, as
GGUF's Q4_K). Against int4 weights the kernel quantizes x per row and 32 inputs to int8
(`quantized_rows`, as llama.cpp quantizes activations to Q8) and multiplies the codes in
integers: on AVX-512 VNNI two panels and up to six rows at a time in 512-bit vpdpbusd, on AVX2
one panel in 256-bit (AVX-VNNI or vpmaddubsw).

The library is built for the ISA that `$PAGED_JAX_CPU_ISA` names (kernels/cpp_build.py: native,
or the portable x86-64-v3 / x86-64-v2 whose AVX2 / scalar paths the tests also run);
`load(folder, isa)` and `matmul(..., isa=)` pick one explicitly.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpp_build, weight_codes

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "paged_jax_cpu_packed_matmul"
TARGET_INT8 = "paged_jax_cpu_packed_matmul_int8"
TARGET_INT4 = "paged_jax_cpu_packed_matmul_int4"
TARGET_INT4_CODED = "paged_jax_cpu_packed_matmul_int4_coded"
TARGET_BF16 = "paged_jax_cpu_packed_matmul_bf16"
TARGET_ARGMAX = "paged_jax_cpu_row_argmax"
TARGET_LOGPROBS = "paged_jax_cpu_row_logprobs"
TARGET_ARGMAX_BLOCKED = "paged_jax_cpu_row_argmax_blocked"
NR = 16  # output columns per panel (cpu_matmul.cc's kNR)
GROUP = weight_codes.GROUP  # inputs per scale (GGUF's Q4 block): never straddles a TP shard of 32
WEIGHT_TYPES = ("float32", "bfloat16", "int8", "int4")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["panels", "scales", "mins", "supers"],
                   meta_fields=["n", "quantize_x"])
@dataclasses.dataclass(frozen=True)
class Packed:
    """A [n, K] weight packed for `matmul`: panels [ceil(n / 16), K, 16], float32, bfloat16
    bits (uint16, pairs of k interleaved: cpu_matmul_bf16.h; a panel's 16 pairs of k are
    one AMX B tile as stored) or int8 (blocks of 4 k) with
    float16 scales [ceil(n / 16), K / G, 16]; or int4, panels
    [ceil(n / 16), K, 8] of two codes a byte (blocks of 8 k) with float16 scales and mins
    [ceil(n / 16), K / 32, 16], or (two-level) uint8 scale codes and int8 min codes of that
    shape and float16 units `supers` [ceil(n / 16), K / (32 S), 2, 16]. `quantize_x`: the
    kernel multiplies x's int8 codes (W4A8) rather than x."""

    panels: jax.Array
    n: int
    scales: jax.Array | None = None
    mins: jax.Array | None = None
    supers: jax.Array | None = None
    quantize_x: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.panels.shape[1]

    @property
    def dtype(self):
        """The compute dtype (float32 for int8 panels too)."""
        return jnp.dtype(jnp.float32)


def pack(w, weights: str = "float32", device=None, keep_grid: bool = True,
         per_super: int | None = None) -> Packed:
    """Packs a float [N, K] weight on the host (numpy) as `weights` ("float32", "int8" or
    "int4") and places it on `device` (default: the default device). `keep_grid`: int8
    keeps a 4-bit source grid (module docstring). `per_super`: int4's groups per unit
    (default weight_codes.per_super of K / 32; a tensor-parallel shard passes its whole
    weight's)."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"packed weights are one of {WEIGHT_TYPES}, got {weights!r}")
    w = np.asarray(w, np.float32)
    n, k = w.shape
    p = -(-n // NR)
    padded = np.zeros((p * NR, k), np.float32)
    padded[:n] = w
    panels = padded.reshape(p, NR, k).transpose(0, 2, 1)  # [P, K, 16]
    put = functools.partial(jax.device_put, device=device)
    if weights == "float32":
        return Packed(put(np.ascontiguousarray(panels)), n)
    if weights == "bfloat16":
        return Packed(put(_bf16_pairs(panels)), n)
    if weights == "int4":
        s = per_super or weight_codes.per_super(k // GROUP)
        return Packed(*_pack_int4(panels, n, put, coded=s), quantize_x=True)
    if k % 4:
        raise ValueError(f"int8 weights need an input width that is a multiple of 4, got {k}")
    if keep_grid and k % GROUP == 0 and _on_grid(panels[:16]):  # W4A8 on the source's grid
        kept = _pack_int4(panels, n, put, coded=0, on_grid=True)  # None: a later panel is off
        if kept is not None:
            return Packed(*kept, quantize_x=True)
    g = GROUP if k % GROUP == 0 else k
    q, scales = weight_codes.int8_groups(panels.reshape(p, k // g, g, NR))  # [P, K / G, 16]
    q = q.reshape(p, k // 4, 4, NR)
    q = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).reshape(p, k, NR)  # blocks of 4 k
    return Packed(put(q), n, put(scales), quantize_x=g == GROUP)


def _bf16_pairs(panels: np.ndarray) -> np.ndarray:
    """Float [P, K, 16] panels as bfloat16 bits (round to nearest even), each pair of k of a
    column side by side: memory [P, K / 2, 16, 2], returned as [P, K, 16] uint16."""
    p, k, _ = panels.shape
    if k % 2:
        raise ValueError(f"bfloat16 weights need an even input width, got {k}")
    bits = np.asarray(jnp.asarray(panels, jnp.bfloat16)).view(np.uint16)
    return np.ascontiguousarray(bits.reshape(p, k // 2, 2, NR).transpose(0, 1, 3, 2)
                                ).reshape(p, k, NR)


def _bf16_panels(panels: jax.Array) -> jax.Array:
    """bfloat16 pair panels (uint16 [P, K, 16]) back to float32 [P, K, 16] in k order."""
    p, k, _ = panels.shape
    pairs = panels.reshape(p, k // 2, NR, 2).transpose(0, 1, 3, 2).reshape(p, k, NR)
    return jax.lax.bitcast_convert_type(pairs, jnp.bfloat16).astype(jnp.float32)


def _on_grid(panels: np.ndarray) -> bool:
    """Every 32-input group of float [P, K, 16] panels on a 4-bit grid (`pack` asks of a
    tensor's first panels: one off any grid is told there, before it is searched whole)."""
    x = panels.reshape(-1, panels.shape[1] // GROUP, GROUP, NR)
    return weight_codes.on_grid(x, *weight_codes.grid4(x))


def _pack_int4(panels: np.ndarray, n: int, put, coded: int, chunk: int = 256,
               on_grid: bool = False) -> tuple | None:
    """Int4 panels of float [P, K, 16] ones, `chunk` panels at a time (bounded host memory):
    Packed's fields from panels on, placed with `put`; group scales and mins in float16, or
    (`coded` = S > 0) as codes and units per S groups. `on_grid`: None unless every group
    lies on its 4-bit grid (each chunk's grids found once, for the check and the codes)."""
    p, k, _ = panels.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need an input width that is a multiple of {GROUP}, "
                         f"got {k}")
    parts = []
    for i in range(0, p, chunk):
        parts.append(_int4_chunk(panels[i:i + chunk].reshape(-1, k // GROUP, GROUP, NR), coded,
                                 on_grid))
        if parts[-1] is None:
            return None
    q, *params = (np.concatenate(x) for x in zip(*parts, strict=True))
    # Blocks of 8 k (cpu_matmul_quant.h): byte (b, c, j) = q[8b + j, c] | q[8b + 4 + j, c] << 4.
    q = q.reshape(p, k // 8, 2, 4, NR).transpose(0, 1, 2, 4, 3)  # [P, K/8, half, c, j]
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8).reshape(p, k, 8)
    return (put(nibbles), n, *(put(x) for x in params))


def _int4_chunk(x: np.ndarray, coded: int, on_grid: bool = False) -> tuple | None:
    """Codes [.., K / 32, 32, 16] and the group parameters of groups x of that shape (None
    when `on_grid` asks for every group on its grid and one is not)."""
    scale, lo = weight_codes.grid4(x)
    if on_grid and not weight_codes.on_grid(x, scale, lo):
        return None
    if not coded:
        scale, lo = scale.astype(np.float16), lo.astype(np.float16)
        q = weight_codes.codes4(x, scale.astype(np.float32), lo.astype(np.float32))
        return q, scale, lo
    _, su = weight_codes.two_level(scale, weight_codes.SCALE_LEVELS, False, coded)
    _, mu = weight_codes.two_level(lo, weight_codes.MIN_LEVELS, True, coded)
    each = lambda u: np.repeat(u.astype(np.float32), coded, axis=-2)  # noqa: E731
    q, sc, mc = weight_codes.nearest_pair(x, scale, lo, each(su), each(mu))
    return q, sc, mc, np.stack([su, mu], axis=-2)  # units [.., K / (32 S), 2, 16]


def _codes8(panels: jax.Array) -> jax.Array:
    """Int8 panels [P, K, 16] (blocks of 4 k: byte (b, c, j) = q[4b + j, c]) back to codes
    [P, K, 16] in k order."""
    p, k, _ = panels.shape
    return panels.reshape(p, k // 4, NR, 4).transpose(0, 1, 3, 2).reshape(p, k, NR)


def _codes4(panels: jax.Array) -> jax.Array:
    """Int4 panels [P, K, 8] (blocks of 8 k) back to codes [P, K, 16]."""
    p, k, _ = panels.shape
    b = panels.reshape(p, k // 8, 16, 4)  # [P, K/8, c, j]
    q = jnp.stack([b & 15, b >> 4], axis=2)  # [P, K/8, half, c, j]
    return q.transpose(0, 1, 2, 4, 3).reshape(p, k, NR)


def group_params(scales: jax.Array, mins: jax.Array, supers: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array]:
    """An int4 weight's group scales and mins [X, K / 32, ...] as float32: as they are, or
    decoded from codes and `supers` units [X, K / (32 S), 2, ...]."""
    if supers is None:
        return scales.astype(jnp.float32), mins.astype(jnp.float32)
    units = jnp.repeat(supers.astype(jnp.float32), scales.shape[1] // supers.shape[1], axis=1)
    return (scales.astype(jnp.float32) * units[:, :, 0],
            mins.astype(jnp.float32) * units[:, :, 1])


def _panels_f32(w: Packed) -> jax.Array:
    """The panels as float32 [P, K, 16] (bfloat16 widened; int8 ones times their scales;
    int4 ones decoded)."""
    if w.panels.dtype == jnp.uint16:
        return _bf16_panels(w.panels)
    if w.scales is None:
        return w.panels
    p, k, _ = w.panels.shape
    if w.mins is None:
        scales = jnp.repeat(w.scales.astype(jnp.float32), k // w.scales.shape[1], axis=1)
        return _codes8(w.panels).astype(jnp.float32) * scales
    scale, lo = group_params(w.scales, w.mins, w.supers)
    g = k // scale.shape[1]
    q = _codes4(w.panels).astype(jnp.float32)
    return q * jnp.repeat(scale, g, axis=1) + jnp.repeat(lo, g, axis=1)


def quantized_rows(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the kernel multiplies it against int8 / int4 weights (numpy, float32):
    int8 codes per group of 32 inputs, round to nearest even, times the group's max |x| / 127;
    a group holding a NaN or Inf comes out NaN, as the kernel's (and numpy warns). (Int8
    weights with K not a multiple of 32 keep x as it is.)"""
    x = np.asarray(x, np.float32)
    g = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
    return (np.rint(g * inv) * (amax / np.float32(127))).reshape(x.shape)


def unpack(w: Packed) -> jax.Array:
    """The [n, K] weight back, as float32 (tests, and code that needs the plain layout)."""
    p, k, _ = w.panels.shape
    return _panels_f32(w).transpose(0, 2, 1).reshape(p * NR, k)[:w.n]


def rows(w: Packed | jax.Array, ids: jax.Array) -> jax.Array:
    """w[ids] ([T, K]): gathered from the panels of a packed table (an embedding lookup on a
    packed head or quantized embedding), or simply indexed in a plain one."""
    if not isinstance(w, Packed):
        return w[ids]
    p, c = ids // NR, ids % NR
    if w.panels.dtype == jnp.uint16:  # pairs of k: [P, K / 2, 16, 2]
        k = w.panels.shape[1]
        bits = w.panels.reshape(-1, k // 2, NR, 2)[p, :, c].reshape(-1, k)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)
    if w.scales is None:
        return w.panels[p, :, c]
    k = w.panels.shape[1]
    g = k // w.scales.shape[1]
    if w.mins is None:
        scale = jnp.repeat(w.scales[p, :, c].astype(jnp.float32), g, axis=1)
        got = w.panels.reshape(-1, k // 4, NR, 4)[p, :, c].reshape(-1, k)
        return got.astype(jnp.float32) * scale
    supers = None if w.supers is None else w.supers[p, :, :, c]  # [T, K / (32 S), 2]
    scale, lo = group_params(w.scales[p, :, c], w.mins[p, :, c], supers)
    byte = w.panels.reshape(-1, k // 8, 16, 4)[p, :, c]  # [T, K/8, j]
    q = jnp.concatenate([byte & 15, byte >> 4], axis=-1).reshape(-1, k).astype(jnp.float32)
    return q * jnp.repeat(scale, g, axis=1) + jnp.repeat(lo, g, axis=1)


def load(folder: str, isa: str | None = None) -> bool:
    """Builds (if needed) and registers the kernel for an ISA (cpp_build.isa: `isa`, else
    `$PAGED_JAX_CPU_ISA`, else native) with XLA; False when it cannot be built."""
    return _load(folder, cpp_build.isa(isa))


@functools.cache
def _load(folder: str, isa: str) -> bool:
    return cpp_build.load(SOURCE, Path(folder), "CPU matmul kernel", "XLA's dot",
                          {TARGET: "PackedMatmul", TARGET_BF16: "PackedMatmulBf16",
                           TARGET_INT8: "PackedMatmulInt8",
                           TARGET_INT4: "PackedMatmulInt4",
                           TARGET_INT4_CODED: "PackedMatmulInt4Coded",
                           TARGET_ARGMAX: "RowArgmax", TARGET_LOGPROBS: "RowLogprobs",
                           TARGET_ARGMAX_BLOCKED: "RowArgmaxBlocked"}, isa)


PATH_BF16_DOT = 32  # PagedJaxIsaPaths' bit: AVX-512 BF16 dot products compiled in
PATH_AMX_BF16 = 64  # PagedJaxIsaPaths' bit: AMX bfloat16 tiles compiled in
PATH_INT8_ROWS = 128  # PagedJaxIsaPaths' bit: int8 W8A8 rows on 512-bit vpdpbusd compiled in


def isa_paths(folder: str, isa: str | None = None) -> int:
    """The ISA-specific paths the built library holds (PagedJaxIsaPaths' bits; 0 when the
    kernel does not build)."""
    import ctypes

    if not load(folder, isa):
        return 0
    path = cpp_build.library_path(SOURCE, Path(folder), cpp_build.flags(cpp_build.isa(isa)))
    return int(ctypes.CDLL(str(path)).PagedJaxIsaPaths())


def matmul(x: jax.Array, w: Packed, isa: str | None = None) -> jax.Array:
    """x [..., K] @ w.T -> [..., n] in float32 on `isa`'s build (call `load` first). A NaN or
    Inf in a row of x gives NaN or Inf in that row of the result (int4's quantized x too)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.panels.shape[1]:
        raise ValueError(f"packed matmul: x has {k} features, the weight {w.panels.shape[1]}")
    m = int(np.prod(lead, dtype=np.int64))
    call = lambda name: jax.ffi.ffi_call(cpp_build.target(name, isa),  # noqa: E731
                                         jax.ShapeDtypeStruct((m, w.n), jnp.float32))
    x2 = x.reshape(m, k).astype(jnp.float32)
    if w.panels.dtype == jnp.uint16:
        out = call(TARGET_BF16)(x2, w.panels)
    elif w.scales is None:
        out = call(TARGET)(x2, w.panels)
    elif w.mins is None:  # int8: W8A8 (x's codes per 32 inputs) or, K not a multiple of 32, x
        out = call(TARGET_INT8)(x2, w.panels, w.scales, quantize_x=np.int32(w.quantize_x))
    else:
        target, ops = ((TARGET_INT4, (w.mins,)) if w.supers is None
                       else (TARGET_INT4_CODED, (w.mins, w.supers)))
        out = call(target)(x2, w.panels, w.scales, *ops)  # W4A8: x always quantized
    return out.reshape(*lead, w.n)


def main() -> None:
    """Checks the kernel against XLA's dot and times it, float32, bfloat16 (AMX tiles where the
    CPU has them), int8 and int4 panels, beside XLA
    (alternating, median of rounds) on SmolLM2-135M's projection shapes: q|k|v, o, gate|up,
    down and the LM head."""
    import time

    assert load(str(cpp_build.default_folder())), "the kernel did not build"
    rng = np.random.default_rng(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "head": (49152, 576)}
    ours = jax.jit(matmul)
    xla = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    print(f"{'rows':>5} {'weight':>8} {'packed ms':>10} {'bf16 ms':>8} {'int8 ms':>8} "
          f"{'int4 ms':>8} "
          f"{'XLA ms':>8}  "
          f"max |diff|")
    for m in (1, 16, 64, 256):
        for name, (n, k) in shapes.items():
            w = rng.standard_normal((n, k), np.float32) / np.sqrt(k)
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            sides = {"packed": (ours, pack(w)), "bf16": (ours, pack(w, "bfloat16")),
                     "int8": (ours, pack(w, "int8")),
                     "int4": (ours, pack(w, "int4")), "xla": (xla, jnp.asarray(w))}
            err = float(jnp.abs(ours(x, sides["packed"][1]) - xla(x, sides["xla"][1])).max())
            reps = 3 if name == "head" else 30
            t: dict = {k: [] for k in sides}
            for _ in range(7):
                for k, (fn, wk) in sides.items():
                    t[k].append(_timed(fn, (x, wk), reps, time))
            widths = (10, 8, 8, 8, 8)
            ms = [f"{np.median(t[k]) * 1e3:{w_}.3f}" for k, w_ in zip(t, widths, strict=True)]
            print(f"{m:5d} {name:>8} {' '.join(ms)}  {err:.1e}")


def _timed(fn, args, reps: int, time) -> float:
    fn(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps


if __name__ == "__main__":
    main()
