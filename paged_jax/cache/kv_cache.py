"""KVCache: the K and V pages of the whole pool, one array per layer, as a pytree.

Layout: ``k[l]`` is ``[H, N, K, D]`` (KV heads, blocks, block size, head dim), same for v.
One (KV head, block) page is a contiguous [K, D] tile, so a paged-attention kernel that walks
one sequence's block table for one KV head reads whole contiguous tiles; this is the layout
of JAX's own Pallas paged-attention kernels.

Why one array per layer rather than one stacked [L, H, N, K, D] array: the decoder runs its
layers unrolled (models/llama.py), and XLA turns a per-layer read or write of a stacked,
donated buffer into a copy of that layer's whole pool (measured: 4 s per step for a 1 GiB
pool, against 0.1 s with per-layer buffers). Separate buffers are written in place.

With KV cache groups (cache/groups.py) the arrays are *buffers* rather than layers: a layer
reads buffer `layer_buffer[i]` through the page tables of group `layer_group[i]`, and one
block id names a page in every buffer. Without groups the two maps are empty: buffer i is
layer i.

Quantized caches (kv_cache_dtype int8 / fp8, paged_jax/cache/kv_quant.py) store int8 or fp8 pages
and float32 scales beside them, one per group of 32 values of a token and KV head (kv_quant.GROUP):
``k_scale[l]`` is ``[H, N, K, Z]``, Z = D / 32.
Every operation here (write, copy-on-write copy, swap out / in) moves the scales with their
values; a layer's cache is handed to the model as a (K, V) pair of kernels.pages.Pages.
bfloat16 and fp8 pages are
stored as their bits (uint16 / uint8, see kv_quant.bits_dtype) and seen in their dtype only
when read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from kernels.pages import Pages
from paged_jax.cache import kv_quant
from paged_jax.cache.groups import KVGroups
from paged_jax.cache.page_table import PageTable
from paged_jax.types import NULL_BLOCK, Array, Float, Int, Shaped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K and V pages, one [H, N, K, D] array per layer, stored as `kv_quant.bits_dtype(dtype)`
    (float32 and int8 as themselves, bfloat16 / fp8 as their bits); int8 / fp8 pages have
    scales [H, N, K, Z] (Z groups per row, kv_quant.num_groups) in k_scale / v_scale (empty
    for float caches). Block 0 is the
    zero block: never written, so it stays all zeros."""

    k: tuple[Shaped[Array, "H N K D"], ...]
    v: tuple[Shaped[Array, "H N K D"], ...]
    k_scale: tuple[Float[Array, "H N K Z"], ...] = ()
    v_scale: tuple[Float[Array, "H N K Z"], ...] = ()
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.float32),
                                         metadata=dict(static=True))
    layer_group: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    layer_buffer: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def quantized(self) -> bool:
        return bool(self.k_scale)

    def buffer(self, b: int) -> tuple[Pages, Pages]:
        """Buffer b's (K, V) pages, as the model and the attention kernels take them."""
        ks, vs = (self.k_scale[b], self.v_scale[b]) if self.quantized else (None, None)
        return Pages(self.k[b], ks, self.dtype), Pages(self.v[b], vs, self.dtype)

    def layer(self, i: int) -> tuple[Pages, Pages]:
        """Layer i's (K, V) pages (its buffer's)."""
        return self.buffer(self.layer_buffer[i] if self.layer_buffer else i)

    def group_of(self, i: int) -> int:
        """The KV cache group whose page tables layer i reads."""
        return self.layer_group[i] if self.layer_group else 0

    def with_buffers(self, buffers: list[tuple[Pages, Pages]]) -> KVCache:
        """This cache with every buffer replaced (the inverse of `buffer`)."""
        ks, vs = zip(*buffers, strict=True)
        scales = ((tuple(x.scale for x in ks), tuple(x.scale for x in vs))
                  if ks[0].scale is not None else ((), ()))
        return KVCache(tuple(x.values for x in ks), tuple(x.values for x in vs), *scales,
                       dtype=ks[0].dtype, layer_group=self.layer_group,
                       layer_buffer=self.layer_buffer)

    @property
    def num_layers(self) -> int:
        """Buffers (the layers, without groups)."""
        return len(self.k)

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1]

    def stacked(self) -> tuple[Float[Array, "L H N K D"], Float[Array, "L H N K D"]]:
        """(k, v) stacked over buffers, float32 (dequantized): a copy, for inspection."""
        pairs = [self.buffer(i) for i in range(self.num_layers)]
        every = jnp.arange(self.num_blocks)
        return tuple(jnp.stack([p[j].take(every) for p in pairs]) for j in (0, 1))


def init_kv_cache(
    num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
    dtype: DTypeLike = jnp.float32, groups: KVGroups | None = None,
) -> KVCache:
    """An all-zero cache (with all-zero scales when `dtype` is int8 / fp8); with KV cache
    `groups`, one buffer per layer position in a group instead of one per layer."""
    if groups is None or not groups.hybrid:
        return _zeros(num_layers, (num_kv_heads, num_blocks, block_size, head_dim),
                      jnp.dtype(dtype))
    cache = _zeros(groups.num_buffers, (num_kv_heads, num_blocks, block_size, head_dim),
                   jnp.dtype(dtype))
    return dataclasses.replace(cache, layer_group=groups.layer_group,
                               layer_buffer=groups.layer_buffer)


def reading_group(cache: KVCache, group: int) -> KVCache:
    """`cache` with every layer (its own buffer) reading KV cache group `group`'s page tables:
    a draft model's pages beside a hybrid cache (engine/draft.py) follow a full group's."""
    n = len(cache.k)
    return dataclasses.replace(cache, layer_group=(group,) * n, layer_buffer=tuple(range(n)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(num_layers: int, shape: tuple[int, ...], dtype: jnp.dtype) -> KVCache:
    # One program fills every layer, on XLA's thread pool: 3-4x faster than one eager
    # jnp.zeros per array (a second of a fresh process's start with a 1 GiB pool).
    def many(shp, dt):
        return tuple(jnp.zeros(shp, dt) for _ in range(num_layers))

    pages = many(shape, kv_quant.bits_dtype(dtype)), many(shape, kv_quant.bits_dtype(dtype))
    if not kv_quant.is_quantized(dtype):
        return KVCache(*pages, dtype=dtype)
    scales = (*shape[:-1], kv_quant.num_groups(shape[-1]))
    return KVCache(*pages, many(scales, kv_quant.SCALE_DTYPE),
                   many(scales, kv_quant.SCALE_DTYPE), dtype=dtype)


def kv_cache_bytes(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: jnp.dtype
) -> int:
    """Bytes one block costs across all layers, K and V (scales included)."""
    return 2 * num_layers * num_kv_heads * block_size * kv_quant.bytes_per_token_head(
        dtype, head_dim)


def write_layer(
    k_pages: Pages,
    v_pages: Pages,
    cache_positions: Int[Array, "T"],
    k: Float[Array, "T H D"],
    v: Float[Array, "T H D"],
) -> tuple[Pages, Pages]:
    """Scatters the new tokens' K/V of one layer at their cache positions; padding (< 0) is
    dropped. For an int8 / fp8 cache each token's row is quantized on the way in, one scale per
    group of its values."""
    n, bs = k_pages.shape[1], k_pages.shape[2]
    # Positions inside the zero block are never handed out; a negative one is padding.
    block = jnp.where(cache_positions >= bs, cache_positions // bs, n)
    off = cache_positions % bs

    def put(pages, x):  # (block, off) next to each other keep their place: x is [H, T, ...]
        return pages.at[:, block, off].set(jnp.swapaxes(x, 0, 1), mode="drop")

    def one(pages: Pages, x: Float[Array, "T H D"]) -> Pages:
        if pages.scale is None:
            return dataclasses.replace(pages, values=put(pages.values,
                                                         kv_quant.to_bits(x, pages.dtype)))
        xq, xs = kv_quant.quantize(x, pages.dtype)
        return dataclasses.replace(pages, values=put(pages.values,
                                                     kv_quant.to_bits(xq, pages.dtype)),
                                   scale=put(pages.scale, xs))

    return one(k_pages, k), one(v_pages, v)


def write(
    cache: KVCache,
    layer: int,
    cache_positions: Int[Array, "T"],
    k: Float[Array, "T H D"],
    v: Float[Array, "T H D"],
) -> KVCache:
    """`write_layer` on layer `layer` (a static int) of the cache."""
    bufs = [cache.buffer(i) for i in range(cache.num_layers)]
    b = cache.layer_buffer[layer] if cache.layer_buffer else layer
    bufs[b] = write_layer(*bufs[b], cache_positions, k, v)
    return cache.with_buffers(bufs)


def copy_blocks(cache: KVCache, src: Int[Array, "C"], dst: Int[Array, "C"]) -> KVCache:
    """Copies blocks src[c] -> dst[c] in every layer (copy-on-write); dst == 0 is skipped."""
    dst = jnp.where(dst != NULL_BLOCK, dst, cache.num_blocks)
    cp = lambda x: x.at[:, dst].set(x[:, src], mode="drop")  # noqa: E731
    return jax.tree.map(cp, cache)  # values and scales alike


def read_blocks(cache: KVCache, blocks: Int[Array, "M"]) -> tuple[Array, ...]:
    """Every field's `blocks`, stacked over layers (swap out): (k, v), plus (k_scale,
    v_scale) for a quantized cache; values [L, H, M, K, D], scales [L, H, M, K, Z]."""
    return tuple(jnp.stack([x[:, blocks] for x in field]) for field in _fields(cache))


def write_blocks(cache: KVCache, blocks: Int[Array, "M"], *parts: Array) -> KVCache:
    """Writes whole blocks in every layer (swap in), `parts` as `read_blocks` returns them;
    entries with block 0 are skipped."""
    dst = jnp.where(blocks != NULL_BLOCK, blocks, cache.num_blocks)
    put = lambda x, y: x.at[:, dst].set(y.astype(x.dtype), mode="drop")  # noqa: E731
    fields = [tuple(put(x, y) for x, y in zip(field, part, strict=True))
              for field, part in zip(_fields(cache), parts, strict=True)]
    names = ("k", "v", "k_scale", "v_scale")[:len(fields)]
    return dataclasses.replace(cache, **dict(zip(names, fields, strict=True)))


def _fields(cache: KVCache) -> tuple[tuple[Array, ...], ...]:
    return (cache.k, cache.v, cache.k_scale, cache.v_scale) if cache.quantized else (
        cache.k, cache.v)


def gather_sequence(
    cache: KVCache, layer: int, table: PageTable, slot: int
) -> tuple[Float[Array, "T H D"], Float[Array, "T H D"]]:
    """K and V of sequence `slot` in logical order, its first seq_len tokens (host-side helper),
    as stored: the model writes int8 K/V rotated (kv_quant.rotation)."""
    n_tok = int(table.seq_lens[slot])
    blocks = table.block_tables[cache.group_of(layer), slot]

    def read(pages: Pages) -> Float[Array, "T H D"]:
        x = pages.take(blocks)  # [H, P, K, D]
        x = x.reshape(x.shape[0], -1, x.shape[-1])[:, :n_tok]
        return jnp.swapaxes(x, 0, 1)

    return tuple(read(x) for x in cache.layer(layer))
