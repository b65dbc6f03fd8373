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

Int8 (`pack(w, "int8")`): symmetric, round to nearest, a float16 scale per output column and
group of G = 32 consecutive inputs (G = K when 32 does not divide K): max |w| of the group /
127; 32 as int4, so that a group never straddles two devices' shards under tensor parallelism
when K / N is a multiple of 32 (parallel.pack_shards). Int4 (`pack(w, "int4")`): asymmetric,
4-bit codes with a float16 scale and min per column and 32 inputs; each group's grid is
searched (`_int4_groups`), so weights that came from a GGUF Q4 block (dequantized at load)
are coded on that block's own grid, nearly losslessly.
Against either, the kernel quantizes x per row and 32 inputs to int8 (`quantized_rows`, as
llama.cpp quantizes activations to Q8): one row (batch-1 decode) then runs integer dot
products on the codes, several rows the float micro-kernel on decoded panels.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "paged_jax_cpu_packed_matmul"
TARGET_INT8 = "paged_jax_cpu_packed_matmul_int8"
TARGET_INT4 = "paged_jax_cpu_packed_matmul_int4"
NR = 16  # output columns per panel (cpu_matmul.cc's kNR)
GROUP = 32  # inputs per scale (int8 and int4; GGUF's Q4 block): never straddles a TP shard of 32
WEIGHT_TYPES = ("float32", "int8", "int4")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels", "scales", "mins"],
                   meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class Packed:
    """A [n, K] weight packed for `matmul`: panels [ceil(n / 16), K, 16], float32 or int8
    (blocks of 4 k) with float16 scales [ceil(n / 16), K / G, 16]; or int4, panels
    [ceil(n / 16), K, 8] of two codes a byte (blocks of 8 k) with float16 scales and mins
    [ceil(n / 16), K / 32, 16]."""

    panels: jax.Array
    n: int
    scales: jax.Array | None = None
    mins: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.panels.shape[1]

    @property
    def dtype(self):
        """The compute dtype (float32 for int8 panels too)."""
        return jnp.dtype(jnp.float32)


def pack(w, weights: str = "float32", device=None) -> Packed:
    """Packs a float [N, K] weight on the host (numpy) as `weights` ("float32", "int8" or
    "int4") and places it on `device` (default: the default device)."""
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
    if weights == "int4":
        return Packed(*_pack_int4(panels, n, put))
    if k % 4:
        raise ValueError(f"int8 weights need an input width that is a multiple of 4, got {k}")
    g = GROUP if k % GROUP == 0 else k
    groups = panels.reshape(p, k // g, g, NR)
    scales = (np.abs(groups).max(axis=2) / 127.0).astype(np.float16)  # [P, K / G, 16]
    s32 = scales.astype(np.float32)
    q = np.rint(groups / np.where(s32 > 0, s32, 1.0)[:, :, None, :])
    q = np.clip(q, -127, 127).astype(np.int8).reshape(p, k // 4, 4, NR)
    q = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).reshape(p, k, NR)  # blocks of 4 k
    return Packed(put(q), n, put(scales))


def _pack_int4(panels: np.ndarray, n: int, put, chunk: int = 256) -> tuple:
    """Int4 panels of float [P, K, 16] ones, `chunk` panels at a time (bounded host memory):
    Packed's fields, placed with `put`."""
    p, k, _ = panels.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need an input width that is a multiple of {GROUP}, "
                         f"got {k}")
    parts = [_int4_groups(panels[i:i + chunk].reshape(-1, k // GROUP, GROUP, NR))
             for i in range(0, p, chunk)]
    q, scales, mins = (np.concatenate(x) for x in zip(*parts, strict=True))
    # Blocks of 8 k (cpu_matmul_quant.h): byte (b, c, j) = q[8b + j, c] | q[8b + 4 + j, c] << 4.
    q = q.reshape(p, k // 8, 2, 4, NR).transpose(0, 1, 2, 4, 3)  # [P, K/8, half, c, j]
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8).reshape(p, k, 8)
    return put(nibbles), n, put(scales), put(mins)


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


def _int4_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit codes of groups x [.., G, 16]: w = scale * q + min, q in 0..15.

    The min is the group's; the scale (max - min) / j for the j in 15..1 with the least
    squared error, so a group that already sits on a grid of j + 1 levels (a GGUF Q4 block,
    dequantized) is coded on that grid, nearly losslessly. Scales and mins are float16."""
    lo, hi = x.min(axis=-2), x.max(axis=-2)  # [.., 16]
    best_err, scale = None, None
    for j in range(15, 0, -1):
        d = (hi - lo) / j
        q = np.clip(np.rint((x - lo[..., None, :]) / np.where(d > 0, d, 1)[..., None, :]), 0, j)
        err = ((q * d[..., None, :] + lo[..., None, :] - x) ** 2).sum(axis=-2)
        if best_err is None:
            best_err, scale = err, d
        else:  # a coarser grid only where it is clearly better
            scale = np.where(err < 0.999 * best_err, d, scale)
            best_err = np.minimum(best_err, err)
    scale, lo = scale.astype(np.float16), lo.astype(np.float16)
    s32, lo32 = scale.astype(np.float32)[..., None, :], lo.astype(np.float32)[..., None, :]
    q = np.clip(np.rint((x - lo32) / np.where(s32 > 0, s32, 1)), 0, 15).astype(np.uint8)
    return q, scale, lo


def _panels_f32(w: Packed) -> jax.Array:
    """The panels as float32 [P, K, 16] (int8 ones times their scales; int4 ones decoded)."""
    if w.scales is None:
        return w.panels
    p, k, _ = w.panels.shape
    scales = jnp.repeat(w.scales.astype(jnp.float32), k // w.scales.shape[1], axis=1)
    if w.mins is None:
        return _codes8(w.panels).astype(jnp.float32) * scales
    q = _codes4(w.panels).astype(jnp.float32)
    return q * scales + jnp.repeat(w.mins.astype(jnp.float32), k // w.mins.shape[1], axis=1)


def quantized_rows(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the kernel multiplies it against int8 / int4 weights (numpy, float32):
    int8 codes per group of 32 inputs, round to nearest even, times the group's max |x| / 127.
    (Int8 weights with K not a multiple of 32 keep x as it is.)"""
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
    if w.scales is None:
        return w.panels[p, :, c]
    g = w.panels.shape[1] // w.scales.shape[1]
    scale = jnp.repeat(w.scales[p, :, c].astype(jnp.float32), g, axis=1)
    k = w.panels.shape[1]
    if w.mins is None:
        got = w.panels.reshape(-1, k // 4, NR, 4)[p, :, c].reshape(-1, k)
        return got.astype(jnp.float32) * scale
    byte = w.panels.reshape(-1, k // 8, 16, 4)[p, :, c]  # [T, K/8, j]
    q = jnp.concatenate([byte & 15, byte >> 4], axis=-1).reshape(-1, k).astype(jnp.float32)
    return q * scale + jnp.repeat(w.mins[p, :, c].astype(jnp.float32), g, axis=1)


@functools.cache
def load(folder: str) -> bool:
    """Builds (if needed) and registers the kernel with XLA; False when it cannot be built."""
    return cpp_build.load(SOURCE, Path(folder), "CPU matmul kernel", "XLA's dot",
                          {TARGET: "PackedMatmul", TARGET_INT8: "PackedMatmulInt8",
                           TARGET_INT4: "PackedMatmulInt4"})


def matmul(x: jax.Array, w: Packed) -> jax.Array:
    """x [..., K] @ w.T -> [..., n] in float32 (call `load` first)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.panels.shape[1]:
        raise ValueError(f"packed matmul: x has {k} features, the weight {w.panels.shape[1]}")
    m = int(np.prod(lead, dtype=np.int64))
    out_shape = jax.ShapeDtypeStruct((m, w.n), jnp.float32)
    x2 = x.reshape(m, k).astype(jnp.float32)
    if w.scales is None:
        out = jax.ffi.ffi_call(TARGET, out_shape)(x2, w.panels)
    elif w.mins is None:
        out = jax.ffi.ffi_call(TARGET_INT8, out_shape)(x2, w.panels, w.scales)
    else:
        out = jax.ffi.ffi_call(TARGET_INT4, out_shape)(x2, w.panels, w.scales, w.mins)
    return out.reshape(*lead, w.n)


def main() -> None:
    """Checks the kernel against XLA's dot and times it, float32 and int8 panels, beside XLA
    (alternating, median of rounds) on SmolLM2-135M's projection shapes: q|k|v, o, gate|up,
    down and the LM head."""
    import time

    assert load(str(cpp_build.default_folder())), "the kernel did not build"
    rng = np.random.default_rng(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "head": (49152, 576)}
    ours = jax.jit(matmul)
    xla = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    print(f"{'rows':>5} {'weight':>8} {'packed ms':>10} {'int8 ms':>8} {'int4 ms':>8} "
          f"{'XLA ms':>8}  "
          f"max |diff|")
    for m in (1, 16, 64, 256):
        for name, (n, k) in shapes.items():
            w = rng.standard_normal((n, k), np.float32) / np.sqrt(k)
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            sides = {"packed": (ours, pack(w)), "int8": (ours, pack(w, "int8")),
                     "int4": (ours, pack(w, "int4")), "xla": (xla, jnp.asarray(w))}
            err = float(jnp.abs(ours(x, sides["packed"][1]) - xla(x, sides["xla"][1])).max())
            reps = 3 if name == "head" else 30
            t: dict = {k: [] for k in sides}
            for _ in range(7):
                for k, (fn, wk) in sides.items():
                    t[k].append(_timed(fn, (x, wk), reps, time))
            widths = (10, 8, 8, 8)
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
