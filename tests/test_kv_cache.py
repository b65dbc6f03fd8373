"""KVCache: writes land in the right slots, padding is dropped, block 0 stays zero."""

import jax.numpy as jnp
import numpy as np

from paged_jax.cache.kv_cache import copy_blocks, init_kv_cache, write


def test_write_scatters_to_block_and_offset_and_drops_padding():
    cache = init_kv_cache(num_layers=2, num_kv_heads=2, num_blocks=4, block_size=4, head_dim=3)
    slots = jnp.array([5, 14, -1])  # block 1 offset 1; block 3 offset 2; padding
    k = jnp.arange(18, dtype=jnp.float32).reshape(3, 2, 3) + 1
    cache = write(cache, 1, slots, k, -k)
    ck, cv = cache.stacked()
    np.testing.assert_array_equal(ck[1, :, 1, 1], k[0])
    np.testing.assert_array_equal(cv[1, :, 3, 2], -k[1])
    assert float(jnp.abs(ck[0]).sum()) == 0.0  # other layer untouched
    assert float(jnp.abs(ck[:, :, 0]).sum()) == 0.0  # zero block untouched
    # Exactly two token rows were written in layer 1.
    assert int((ck[1] != 0).any(axis=(0, 3)).sum()) == 2


def test_slot_inside_zero_block_is_never_written():
    cache = init_kv_cache(1, 1, 3, 4, 2)
    cache = write(cache, 0, jnp.array([0, 3]), jnp.ones((2, 1, 2)), jnp.ones((2, 1, 2)))
    assert float(jnp.abs(cache.stacked()[0]).sum()) == 0.0


def test_copy_blocks_copies_every_layer_and_skips_null_dst():
    cache = init_kv_cache(2, 1, 4, 2, 2)
    cache = cache.__class__(tuple(x.at[:, 1].set(7.0) for x in cache.k),
                            tuple(x.at[:, 1].set(8.0) for x in cache.v))
    out = copy_blocks(cache, jnp.array([1, 1]), jnp.array([3, 0]))
    ok, ov = out.stacked()
    assert float(ok[:, :, 3].min()) == 7.0 and float(ov[:, :, 3].min()) == 8.0
    assert float(jnp.abs(ok[:, :, 0]).sum()) == 0.0
