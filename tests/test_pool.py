"""BlockPool: exact block ids and refcounts for hand-written scenarios."""

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache.pool import allocate, decref, incref, init_pool, num_used


def ids_of(x):
    return np.asarray(x).tolist()


def test_fresh_pool_hands_out_blocks_from_one_upwards():
    pool = init_pool(8)
    assert int(pool.num_free) == 7
    pool, ids, ok = allocate(pool, jnp.array([2, 0, 3]), max_per_seq=4)
    assert bool(ok)
    assert ids_of(ids) == [[1, 2, 0, 0], [0, 0, 0, 0], [3, 4, 5, 0]]
    assert ids_of(pool.refcount) == [0, 1, 1, 1, 1, 1, 0, 0]
    assert int(pool.num_free) == 2 and int(num_used(pool)) == 5


def test_running_out_is_a_flag_and_leaves_pool_unchanged():
    pool = init_pool(4)
    pool2, ids, ok = allocate(pool, jnp.array([2, 2]), max_per_seq=2)
    assert not bool(ok)
    assert ids_of(ids) == [[0, 0], [0, 0]]
    for a, b in zip(jax.tree.leaves(pool), jax.tree.leaves(pool2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_decref_frees_only_at_zero_and_reuses_lifo():
    pool = init_pool(6)
    pool, _, _ = allocate(pool, jnp.array([3]), max_per_seq=3)  # blocks 1, 2, 3
    pool = incref(pool, jnp.array([2, 0]))  # 0 is ignored
    assert ids_of(pool.refcount) == [0, 1, 2, 1, 0, 0]
    pool = decref(pool, jnp.array([[1, 2], [3, 0]]))
    assert ids_of(pool.refcount) == [0, 0, 1, 0, 0, 0]
    assert int(pool.num_free) == 4
    # Freed blocks are pushed in id order, so the top of the stack is the largest: 3, then 1.
    pool, ids, ok = allocate(pool, jnp.array([3]), max_per_seq=3)
    assert bool(ok) and ids_of(ids) == [[3, 1, 4]]


def test_decref_of_repeated_id_pushes_it_once():
    pool = init_pool(4)
    pool, _, _ = allocate(pool, jnp.array([1]), max_per_seq=1)
    pool = incref(pool, jnp.array([1]))
    pool = decref(pool, jnp.array([1, 1]))
    assert int(pool.refcount[1]) == 0 and int(pool.num_free) == 3
    assert sorted(ids_of(pool.free_stack[:3])) == [1, 2, 3]
