"""The device-side order of an engine step's KV bookkeeping, for allocator state machines."""

import jax
import jax.numpy as jnp

from paged_jax.cache.config import CacheConfig
from paged_jax.cache.kv_cache import copy_blocks, write
from paged_jax.cache.page_table import cache_positions, reserve_tokens


def make_append(cfg: CacheConfig, max_new: int, v_sign: float = -1.0):
    """A jitted reserve -> copy-on-write -> write K/V of up to `max_new` tokens per sequence.

    The K value of each new token is `values[token]`, its V value `v_sign * values[token]`.
    Returns (pool, table, cache, ok, number of copy-on-write copies).
    """

    @jax.jit
    def append(pool, table, cache, num_new, values):
        old = table.seq_lens
        pool, table, (src, dst), ok = reserve_tokens(pool, table, num_new)
        cache = copy_blocks(cache, src, dst)
        seq = jnp.repeat(jnp.arange(cfg.max_seqs), max_new)
        i = jnp.tile(jnp.arange(max_new), cfg.max_seqs)
        real = (i < num_new[seq]) & ok
        slots = cache_positions(table, jnp.where(real, seq, -1), old[seq] + i)
        kv = values[:, None, None]
        return pool, table, write(cache, 0, slots[0], kv, v_sign * kv), ok, (dst != 0).sum()

    return append
