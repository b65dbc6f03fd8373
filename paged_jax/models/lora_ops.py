"""The batched LoRA delta: rows of different adapters in one matmul pass (Punica's shrink /
expand over a batch that mixes adapters).

Every adapter sits in a slot of stacked weights: `a` [N, k*R, I] (the k targets of one fused
projection side by side: q|k|v, or gate|up) and `b`, one [N, R, O_i] per target, the scale
already folded in (lora/weights.py). A token's delta for slot j is, per target i,

    (x @ a[j, i*R:(i+1)*R].T) @ b_i[j]            the "shrink" to R, then the "expand" to O_i

and the k expands are laid side by side like the fused projection's output. Tokens of no
adapter (slot -1) get zeros.

    grouped    (the engine's elsewhere) tokens sorted by slot; each slot runs its own rows in
               tiles of `tile` rows, as many tiles as it got, all in one loop whose trip
               count is the batch's tiles (data-dependent, so no recompilation as the mix of
               adapters changes). Work: the tokens times the rank, plus at most one partial tile per
               adapter in the batch; each adapter's weights read once per tile, in place.
    cpu        (the engine's on CPU, where it builds) the C++ kernel of kernels/cpu_lora.py:
               the same grouping inside one call per fused projection, which also adds the
               delta into the projection's output (`with_delta`). A trip of the grouped
               form's loop costs XLA:CPU about 20 us whatever its work, and with four fused
               projections a layer the loop, not the arithmetic, set the step's cost
    pallas     (the engine's on a GPU whose JAX has Pallas' Triton backend) the kernel of
               kernels/lora_pallas.py: tokens in tiles of one slot each, one program per tile
               and block of outputs reading its slot's weights by index
    reference  each token's slot weights gathered, one einsum: the tokens times the rank too,
               but the gathered copies cost [T, R, I] of memory (what tests compare against).

`prepare` picks: the slots as they are for either kernel, else their grouped `plan`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import cpu_lora, lora_pallas
from kernels.paged_attention import TRITON
from paged_jax import compile_cache
from paged_jax.types import Array, Float, Int


def _dot(x: Array, w: Array) -> Array:
    """x @ w.T for an [out, in] w, accumulated in float32."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _expand(h: Float[Array, "M kR"], bs: tuple[Array, ...]) -> Float[Array, "M O"]:
    r = bs[0].shape[-2]
    return jnp.concatenate([jnp.dot(h[:, i * r:(i + 1) * r].astype(b.dtype), b,
                                    preferred_element_type=jnp.float32)
                            for i, b in enumerate(bs)], axis=1)


def tile_rows(tokens: int, num_slots: int) -> int:
    """Rows per tile: every token of a decode step in one tile per adapter (the loop's
    iterations, not the tiny dots, are what cost on XLA:CPU), at most 32 for prefill chunks."""
    return int(min(32, max(8, 1 << (tokens - 1).bit_length())))


class Plan(NamedTuple):
    """Where each slot's tokens lie once sorted (the same for every projection of a step,
    so computed once per forward): `order` [T] sorts the tokens by slot, `inverse` [T] puts
    them back; per slot its token count, first sorted row, tiles and the running total of
    tiles."""

    order: Int[Array, "T"]
    inverse: Int[Array, "T"]
    sizes: Int[Array, "N"]
    starts: Int[Array, "N"]
    tiles: Int[Array, "N"]
    ends: Int[Array, "N"]


def plan(slots: Int[Array, "T"], num_slots: int) -> Plan:
    """The grouped delta's plan for tokens of `slots` (-1: no adapter, never computed), in
    tiles of tile_rows(T, N) rows (a function of the shapes: static)."""
    group = jnp.where(slots >= 0, slots, num_slots)
    order = jnp.argsort(group, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(group, length=num_slots + 1)[:num_slots]
    m = tile_rows(slots.shape[0], num_slots)
    tiles = (sizes + m - 1) // m
    return Plan(order, inverse, sizes, jnp.cumsum(sizes) - sizes, tiles, jnp.cumsum(tiles))


@functools.cache
def cpu_kernel() -> bool:
    """Whether this process runs the delta on the C++ CPU kernel (a CPU platform, and the
    kernel built; decided once)."""
    return jax.default_backend() == "cpu" and cpu_lora.load(str(compile_cache.kernel_folder()))


@functools.cache
def gpu_kernel() -> bool:
    """Whether this process runs the delta on the Pallas kernel (a GPU, and Pallas' Triton
    backend in this JAX; decided once)."""
    return jax.default_backend() == "gpu" and TRITON


def prepare(slots: Int[Array, "T"], num_slots: int) -> Int[Array, "T"] | Plan:
    """What a step's projections take as their tokens' slots (computed once per forward):
    the slots for either kernel, else their grouped plan."""
    return slots if cpu_kernel() or gpu_kernel() else plan(slots, num_slots)


def with_delta(y: Float[Array, "T O"], x: Float[Array, "T I"], a: Float[Array, "N kR I"],
               bs: tuple[Array, ...], slots: Int[Array, "T"] | Plan) -> Float[Array, "T O"]:
    """y (a projection's output for x) plus each token's adapter delta: on the C++ kernel,
    which adds in place, when `slots` are given as they are and it runs here."""
    if not isinstance(slots, Plan) and cpu_kernel() and y.dtype in cpu_lora.FLOATS:
        return cpu_lora.add(y, x, a, bs, slots)
    return y + lora_delta(x, a, bs, slots)


def lora_delta(x: Float[Array, "T I"], a: Float[Array, "N kR I"], bs: tuple[Array, ...],
               slots: Int[Array, "T"] | Plan) -> Float[Array, "T O"]:
    """The delta of each token's adapter (module docstring), in x's dtype: on a kernel
    when `slots` are given as they are and one runs here, else grouped (in the slots' dtype;
    `slots` may be given as their `plan`, once for a step's projections)."""
    if not isinstance(slots, Plan) and cpu_kernel():
        return cpu_lora.delta(x, a, bs, slots)
    if not isinstance(slots, Plan) and gpu_kernel():
        return lora_pallas.delta(x, a, bs, slots)
    return grouped_delta(x, a, bs, slots)


def grouped_delta(x: Float[Array, "T I"], a: Float[Array, "N kR I"], bs: tuple[Array, ...],
                  slots: Int[Array, "T"] | Plan) -> Float[Array, "T O"]:
    """The grouped delta (module docstring) on XLA, whatever the platform."""
    p = slots if isinstance(slots, Plan) else plan(slots, a.shape[0])
    (t, width), m = x.shape, tile_rows(x.shape[0], a.shape[0])
    rows = jnp.concatenate([x[p.order].astype(a.dtype), jnp.zeros((m, width), a.dtype)])
    width_out = sum(b.shape[-1] for b in bs)

    def one_tile(k, out):
        j = jnp.searchsorted(p.ends, k, side="right")  # the slot whose tiles hold tile k
        i = k - (p.ends[j] - p.tiles[j])
        at = p.starts[j] + i * m
        h = _dot(jax.lax.dynamic_slice_in_dim(rows, at, m), a[j])
        # rows past this slot's belong to a later tile (tiles run in sorted order), which
        # overwrites them: no read of `out`, so the loop updates it in place
        return jax.lax.dynamic_update_slice_in_dim(out, _expand(h, tuple(b[j] for b in bs)),
                                                   at, 0)

    out = jax.lax.fori_loop(0, p.ends[-1], one_tile, jnp.zeros((t + m, width_out), jnp.float32))
    done = jnp.arange(t) < p.sizes.sum()  # sorted rows of no adapter: never written
    return jnp.where(done[:, None], out[:t], 0.0)[p.inverse].astype(x.dtype)


def lora_delta_reference(x: Float[Array, "T I"], a: Float[Array, "N kR I"],
                         bs: tuple[Array, ...], slots: Int[Array, "T"]) -> Float[Array, "T O"]:
    """Each token's slot weights gathered (slot -1: zeros), then one einsum per side."""
    j = jnp.clip(slots, 0)
    h = jnp.einsum("ti,tri->tr", x.astype(jnp.float32), a[j].astype(jnp.float32))
    r = bs[0].shape[-2]
    y = jnp.concatenate([jnp.einsum("tr,tro->to", h[:, i * r:(i + 1) * r],
                                    b[j].astype(jnp.float32)) for i, b in enumerate(bs)], 1)
    return jnp.where((slots >= 0)[:, None], y, 0.0).astype(x.dtype)
