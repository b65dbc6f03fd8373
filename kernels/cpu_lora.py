# ruff: noqa: F821  (jaxtyping axis strings such as "T" read as undefined names)
"""The batched LoRA delta on CPUs, added to a projection's output: a C++ kernel (cpu_lora.cc)
called through XLA's FFI.

Why: models/lora_ops.py's grouped delta is a loop over tiles of each adapter's tokens, and a
loop trip on XLA:CPU costs about 20 us whatever it computes; with four fused projections a
layer the loop set the step time (results/lora.json before this kernel: 4 adapters in a batch
of 16 at 0.51x the base model). One call per fused projection sorts its tokens by slot, runs
each slot's tokens against that slot's weights while they are in cache, and adds the delta
into the projection's output (the casts, concatenation and add around an XLA delta were
passes of their own).

    add      y + delta: delta[t] = (x[t] @ a[slot].T) split in k rank-R parts, part i @ b_i[slot],
             side by side (a [N, kR, I], b_i [N, R, O_i]); slot -1 (no adapter) keeps y
    delta    the delta alone (add onto zeros), as lora_ops.lora_delta

x and y float32 or bfloat16, weights float32 or bfloat16 (read as stored), sums float32, each
token's the same alone or in any batch. `python -m kernels.cpu_lora` checks the kernel against
lora_ops' reference and times it beside the XLA grouped delta on SmolLM2-135M's shapes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_lora.cc")
TARGET = "paged_jax_cpu_lora_add"
NO_REORDER = ("-fno-associative-math", "-ffp-contract=off")
"""The kernel's sums are vectorized by hand (cpu_lora.cc): fast-math's reordering, and
contraction into multiply-adds where the compiler chooses, would let a token's sum differ
beside three others from alone (batch variance)."""
FLOATS = (jnp.float32, jnp.bfloat16)


def load(folder: str, isa: str | None = None) -> bool:
    """Builds (if needed) and registers the kernel with XLA (cpp_build.load); False when it
    cannot be built."""
    return _load(folder, cpp_build.isa(isa))


@functools.cache
def _load(folder: str, isa: str) -> bool:
    return cpp_build.load(SOURCE, Path(folder), "CPU LoRA kernel", "the XLA grouped delta",
                          {TARGET: "LoraAdd"}, isa, NO_REORDER)


def add(y: Float[Array, "T O"], x: Float[Array, "T I"], a: Float[Array, "N kR I"],
        bs: tuple[Array, ...], slots: Int[Array, "T"], isa: str | None = None
        ) -> Float[Array, "T O"]:
    """y + each token's adapter delta, in y's dtype (float32 or bfloat16; y's buffer is
    reused where XLA lets it); call `load` first."""
    if y.dtype not in FLOATS:
        raise ValueError(f"lora add: y must be float32 or bfloat16, got {y.dtype}")
    wdt = a.dtype if a.dtype in FLOATS and all(b.dtype == a.dtype for b in bs) else jnp.float32
    call = jax.ffi.ffi_call(cpp_build.target(TARGET, isa), jax.ShapeDtypeStruct(y.shape, y.dtype),
                            input_output_aliases={1: 0})
    return call(x if x.dtype in FLOATS else x.astype(jnp.float32), y, slots.astype(jnp.int32),
                a.astype(wdt), *(b.astype(wdt) for b in bs))


def delta(x: Float[Array, "T I"], a: Float[Array, "N kR I"], bs: tuple[Array, ...],
          slots: Int[Array, "T"], isa: str | None = None) -> Float[Array, "T O"]:
    """The delta alone (lora_ops.lora_delta's contract), in x's dtype."""
    zeros = jnp.zeros((x.shape[0], sum(b.shape[-1] for b in bs)), jnp.float32)
    return add(zeros, x, a, bs, slots, isa).astype(x.dtype)


def reference(x: np.ndarray, a: np.ndarray, bs: tuple, slots: np.ndarray) -> np.ndarray:
    """The delta in numpy, float64 (each token's slot weights gathered)."""
    j, r = np.clip(slots, 0, None), bs[0].shape[1]
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    h = np.einsum("ti,tri->tr", x, a[j])
    y = np.concatenate([np.einsum("tr,tro->to", h[:, i * r:(i + 1) * r],
                                  np.asarray(b, np.float64)[j]) for i, b in enumerate(bs)], 1)
    return np.where((slots >= 0)[:, None], y, 0.0)


def main() -> None:
    """Checks the kernel against `reference` and times it (float32 and bfloat16 weights) on
    SmolLM2-135M's fused projections, 16 slots of rank 16, per batch and adapters in it."""
    import time

    assert load(str(cpp_build.default_folder())), "the kernel did not build"
    rng, n, r = np.random.default_rng(0), 16, 16
    shapes = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1536, 1536)),
              "down": (1536, (576,))}
    fn = jax.jit(delta)
    print(f"{'tokens':>6} {'adapters':>8} {'proj':>8} {'f32 ms':>8} {'bf16 ms':>8}  "
          "max |f32 - reference|")
    for t, used in ((16, 1), (16, 4), (16, 16), (64, 16), (256, 4)):
        for name, (i, outs) in shapes.items():
            a = rng.standard_normal((n, len(outs) * r, i)).astype(np.float32)
            bs = tuple(rng.standard_normal((n, r, o)).astype(np.float32) for o in outs)
            x = rng.standard_normal((t, i)).astype(np.float32)
            slots = (np.arange(t) % used).astype(np.int32)
            err = np.abs(np.asarray(fn(x, a, bs, slots)) - reference(x, a, bs, slots)).max()
            ms = []
            for dtype in (jnp.float32, jnp.bfloat16):
                w = jax.tree.map(lambda v: jnp.asarray(v, dtype), (a, bs))  # noqa: B023
                fn(x, *w, slots).block_until_ready()
                t0 = time.perf_counter()
                for _ in range(50):
                    out = fn(x, *w, slots)
                out.block_until_ready()
                ms.append((time.perf_counter() - t0) / 50 * 1e3)
            print(f"{t:6d} {used:8d} {name:>8} {ms[0]:8.3f} {ms[1]:8.3f}  {err:.1e}")


if __name__ == "__main__":
    main()
