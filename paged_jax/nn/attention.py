"""`PagedAttention`: a Flax NNX layer that reads and writes the paged KV cache.

It holds no weights: the model projects q, k, v (and rotates them, or not: positional
encoding is the model's), and this layer writes the step's K/V into its layer's pages and
attends over them through `models.attention.cached_attention`, the path our functional
decoders take. So every attention backend ("reference", "pallas", "cpu"), KV dtype (float,
bfloat16, int8 / fp8 with their rotation and scales), sliding window and KV cache group works
for a user's module as for ours.
"""

from __future__ import annotations

from flax import nnx
from jaxtyping import Float

from kernels.pages import Pages
from paged_jax.cache.kv_cache import KVCache
from paged_jax.models.attention import cached_attention
from paged_jax.nn.interface import RaggedStep
from paged_jax.types import Array


class PagedAttention(nnx.Module):
    """Causal attention of layer `layer` over the paged cache.

    Args:
      layer: the layer's index: which KV buffer it writes and which KV cache group's pages it
        reads (`KVCache.layer`, `KVCache.group_of`).
      window: a sliding window (keys i - window + 1 .. i); None: every earlier key. It must
        be the model config's `window(layer)`: the engine keeps a window's blocks by it.
      scale: the softmax scale; None: head_dim ** -0.5.
    """

    def __init__(self, layer: int, *, window: int | None = None, scale: float | None = None):
        self.layer, self.window, self.scale = layer, window, scale

    def __call__(
        self, q: Float[Array, "T Q D"], k: Float[Array, "T H D"], v: Float[Array, "T H D"],
        cache: KVCache, step: RaggedStep,
    ) -> tuple[Float[Array, "T Q D"], KVCache]:
        """The step's k, v written at their cache positions, then q's attention over every
        cached key of its sequence up to its own position (zeros for padding tokens).

        Returns:
          ([T, Q, D] output, the cache with this layer's pages updated).
        """
        cache_positions, tables = step.paging(cache.group_of(self.layer))
        o, kv = cached_attention(q, k, v, cache.layer(self.layer), cache_positions, tables,
                                 step.seq_lens, step.query_start, window=self.window,
                                 scale=self.scale, **step.attention_kwargs())
        return o, with_layer(cache, self.layer, kv)


def with_layer(cache: KVCache, layer: int, kv: tuple[Pages, Pages]) -> KVCache:
    """`cache` with layer `layer`'s buffer replaced by `kv` (a new pytree; no copy of the
    other buffers' arrays)."""
    bufs = [cache.buffer(b) for b in range(cache.num_layers)]
    bufs[cache.layer_buffer[layer] if cache.layer_buffer else layer] = kv
    return cache.with_buffers(bufs)
