"""KVCache: the per-layer K and V pages of the whole pool, as a pytree.

Layout: ``k[L, H, N, K, D]`` (layers, KV heads, blocks, block size, head dim), same for v.
One (layer, KV head, block) page is a contiguous [K, D] tile, so a paged-attention kernel that
walks one sequence's block table for one KV head reads whole contiguous tiles; this is the
layout of JAX's own Pallas paged-attention kernels. Layers are stacked so one donated buffer
holds the cache and per-layer writes are in-place dynamic updates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.page_table import PageTable
from paged_jax.types import NULL_BLOCK, Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K and V pages. Block 0 is the zero block: never written, so it stays all zeros."""

    k: Float[Array, "L H N K D"]
    v: Float[Array, "L H N K D"]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]


def init_kv_cache(
    num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
    dtype: jnp.dtype = jnp.float32,
) -> KVCache:
    """An all-zero cache."""
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def kv_cache_bytes(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: jnp.dtype
) -> int:
    """Bytes one block costs across all layers, K and V."""
    return 2 * num_layers * num_kv_heads * block_size * head_dim * jnp.dtype(dtype).itemsize


def write(
    cache: KVCache,
    layer: int | Int[Array, ""],
    slot_mapping: Int[Array, "T"],
    k: Float[Array, "T H D"],
    v: Float[Array, "T H D"],
) -> KVCache:
    """Scatters the new tokens' K/V into their slots; padding slots (< 0) are dropped."""
    n, bs = cache.num_blocks, cache.block_size
    # Slots inside the zero block are never handed out; a negative slot is padding.
    block = jnp.where(slot_mapping >= bs, slot_mapping // bs, n)
    off = slot_mapping % bs
    kc = cache.k.at[layer, :, block, off].set(k.astype(cache.k.dtype), mode="drop")
    vc = cache.v.at[layer, :, block, off].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(kc, vc)


def copy_blocks(cache: KVCache, src: Int[Array, "C"], dst: Int[Array, "C"]) -> KVCache:
    """Copies blocks src[c] -> dst[c] in every layer (copy-on-write); dst == 0 is skipped."""
    dst = jnp.where(dst != NULL_BLOCK, dst, cache.num_blocks)
    kc = cache.k.at[:, :, dst].set(cache.k[:, :, src], mode="drop")
    vc = cache.v.at[:, :, dst].set(cache.v[:, :, src], mode="drop")
    return KVCache(kc, vc)


def gather_sequence(
    cache: KVCache, layer: int, table: PageTable, slot: int
) -> tuple[Float[Array, "T H D"], Float[Array, "T H D"]]:
    """K and V of sequence `slot` in logical order, its first seq_len tokens (host-side helper)."""
    n_tok = int(table.seq_lens[slot])
    blocks = table.block_tables[slot]

    def read(pages: Float[Array, "H N K D"]) -> Float[Array, "T H D"]:
        x = pages[:, blocks]  # [H, P, K, D]
        x = x.reshape(x.shape[0], -1, x.shape[-1])[:, :n_tok]
        return jnp.swapaxes(x, 0, 1)

    return read(cache.k[layer]), read(cache.v[layer])
