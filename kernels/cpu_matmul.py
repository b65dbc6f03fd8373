"""Float32 matmuls on CPUs against weights packed in panels: a C++ kernel (cpu_matmul.cc)
called through XLA's FFI.

Why: at serving batch sizes (a few to a few dozen rows) XLA:CPU's dot runs far below the
machine's FMA peak, because it repacks the whole weight matrix on every call; the weights do
not change, so they are packed once, at load (`pack`), into the layout the kernel's
micro-kernel streams. `python -m kernels.cpu_matmul` checks the kernel against XLA's dot and
times both on SmolLM2-135M's projection shapes (the numbers are in its output; on the 2-core
Zen 3 machine the kernel took 0.55 ms where XLA took 1.0-1.25 ms for the 16-row gate|up
projection, and 12.5 ms against 29 ms for the 16-row LM head).

    Packed     panels [P, K, 16] of w [N, K] (the runtime form's [out, in] projections),
               P = ceil(N / 16), zero-padded past N; n = N (static)
    matmul     x [..., K] @ w.T -> [..., N], float32
    rows       w[ids] read back from the panels (a tied embedding's lookup)
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "paged_jax_cpu_packed_matmul"
NR = 16  # output columns per panel (cpu_matmul.cc's kNR)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels"],
                   meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class Packed:
    """A [n, K] weight packed for `matmul`: panels [ceil(n / 16), K, 16]."""

    panels: jax.Array
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.panels.shape[1]

    @property
    def dtype(self):
        return self.panels.dtype


def pack(w) -> Packed:
    """Packs a float32 [N, K] weight on the host (numpy) and places it on the device."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    p = -(-n // NR)
    padded = np.zeros((p * NR, k), np.float32)
    padded[:n] = w
    return Packed(jax.device_put(np.ascontiguousarray(
        padded.reshape(p, NR, k).transpose(0, 2, 1))), n)


def unpack(w: Packed) -> jax.Array:
    """The [n, K] weight back (tests, and code that needs the plain layout)."""
    p, k, _ = w.panels.shape
    return w.panels.transpose(0, 2, 1).reshape(p * NR, k)[:w.n]


def rows(w: Packed, ids: jax.Array) -> jax.Array:
    """w[ids] ([T, K]) gathered from the panels: an embedding lookup on a packed tied head."""
    return w.panels[ids // NR, :, ids % NR]


@functools.cache
def load(folder: str) -> bool:
    """Builds (if needed) and registers the kernel with XLA; False when it cannot be built."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(cpp_build.build(SOURCE, Path(folder),
                                                          "CPU matmul kernel")))
    except (RuntimeError, OSError) as err:
        import warnings

        warnings.warn(f"CPU matmul kernel unavailable, using XLA's dot: {err}", stacklevel=2)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PackedMatmul), platform="cpu")
    return True


def matmul(x: jax.Array, w: Packed) -> jax.Array:
    """x [..., K] @ w.T -> [..., n] in float32 (call `load` first)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.panels.shape[1]:
        raise ValueError(f"packed matmul: x has {k} features, the weight {w.panels.shape[1]}")
    m = int(np.prod(lead, dtype=np.int64))
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, w.n), jnp.float32))(
        x.reshape(m, k).astype(jnp.float32), w.panels)
    return out.reshape(*lead, w.n)


def main() -> None:
    """Checks the kernel against XLA's dot and times both (alternating, median of rounds) on
    SmolLM2-135M's projection shapes: q|k|v, o, gate|up, down and the LM head."""
    import time

    assert load(str(cpp_build.default_folder())), "the kernel did not build"
    rng = np.random.default_rng(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "head": (49152, 576)}
    ours = jax.jit(matmul)
    xla = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    print(f"{'rows':>5} {'weight':>8} {'packed ms':>10} {'XLA ms':>8}  max |diff|")
    for m in (1, 16, 64, 256):
        for name, (n, k) in shapes.items():
            w = rng.standard_normal((n, k), np.float32) / np.sqrt(k)
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            wp, wj = pack(w), jnp.asarray(w)
            err = float(jnp.abs(ours(x, wp) - xla(x, wj)).max())
            reps = 3 if name == "head" else 30
            t_ours, t_xla = [], []
            for _ in range(7):
                t_ours.append(_timed(ours, (x, wp), reps, time))
                t_xla.append(_timed(xla, (x, wj), reps, time))
            print(f"{m:5d} {name:>8} {np.median(t_ours) * 1e3:10.3f} "
                  f"{np.median(t_xla) * 1e3:8.3f}  {err:.1e}")


def _timed(fn, args, reps: int, time) -> float:
    fn(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps


if __name__ == "__main__":
    main()
