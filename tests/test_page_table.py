"""PageTable: exact block ids for hand-written scenarios; eager == jit; no recompiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.cache.config import CacheConfig
from paged_jax.cache.invariants import InvariantError, check_invariants
from paged_jax.cache.page_table import (
    add_sequence,
    cache_positions,
    fork,
    init_page_table,
    release,
    reserve_tokens,
)
from paged_jax.cache.pool import init_pool

CFG = CacheConfig(num_blocks=10, block_size=4, max_seqs=3, max_blocks_per_seq=4)


def fresh():
    return init_pool(CFG.num_blocks), init_page_table(CFG)


def rows(table):
    return np.asarray(table.block_tables[0]).tolist()


def test_blocks_allocated_only_at_boundaries():
    pool, t = fresh()
    t = add_sequence(t, 0)
    pool, t, _, ok = reserve_tokens(pool, t, jnp.array([3, 0, 0]))
    assert bool(ok) and rows(t)[0] == [1, 0, 0, 0]
    pool, t, _, ok = reserve_tokens(pool, t, jnp.array([1, 0, 0]))  # fills block 1 exactly
    assert rows(t)[0] == [1, 0, 0, 0] and int(pool.num_free) == 8
    pool, t, _, ok = reserve_tokens(pool, t, jnp.array([1, 0, 0]))  # crosses the boundary
    assert rows(t)[0] == [1, 2, 0, 0] and int(t.seq_lens[0]) == 5
    check_invariants(pool, t)


def test_fork_shares_blocks_and_cow_copies_partial_last_block():
    pool, t = fresh()
    t = add_sequence(t, 0)
    pool, t, _, _ = reserve_tokens(pool, t, jnp.array([6, 0, 0]))  # blocks 1, 2 (2 partly full)
    pool, t = fork(pool, t, jnp.array([0]), jnp.array([1]))
    assert rows(t)[:2] == [[1, 2, 0, 0], [1, 2, 0, 0]]
    assert np.asarray(pool.refcount).tolist()[:3] == [0, 2, 2]
    check_invariants(pool, t)
    # Only seq 1 writes: it gets a private copy (block 3) of the shared block 2.
    pool, t, (src, dst), ok = reserve_tokens(pool, t, jnp.array([0, 1, 0]))
    assert bool(ok) and rows(t)[:2] == [[1, 2, 0, 0], [1, 3, 0, 0]]
    assert np.asarray(src).tolist() == [0, 2, 0] and np.asarray(dst).tolist() == [0, 3, 0]
    assert np.asarray(pool.refcount).tolist()[:4] == [0, 2, 1, 1]
    check_invariants(pool, t)


def test_when_all_sharers_write_the_first_keeps_the_block():
    pool, t = fresh()
    t = add_sequence(t, 0)
    pool, t, _, _ = reserve_tokens(pool, t, jnp.array([2, 0, 0]))
    pool, t = fork(pool, t, jnp.array([0, 0]), jnp.array([1, 2]))
    pool, t, (src, dst), ok = reserve_tokens(pool, t, jnp.array([1, 1, 1]))
    assert rows(t) == [[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]]
    assert np.asarray(dst).tolist() == [0, 2, 3]
    check_invariants(pool, t)


def test_exhaustion_and_overlong_leave_state_unchanged():
    pool, t = fresh()
    t = add_sequence(add_sequence(t, 0), 1)
    pool, t, _, _ = reserve_tokens(pool, t, jnp.array([16, 12, 0]))  # 7 of 9 blocks
    for want in ([0, 1, 0], [5, 5, 0], [1, 9, 0]):  # 8 blocks needed; second too long (> P*K)
        p2, t2, _, ok = reserve_tokens(pool, t, jnp.array(want))
        if want == [0, 1, 0]:
            assert bool(ok)
            continue
        assert not bool(ok)
        for a, b in zip(jax.tree.leaves((pool, t)), jax.tree.leaves((p2, t2)), strict=True):
            np.testing.assert_array_equal(a, b)


def test_release_returns_every_block():
    pool, t = fresh()
    t = add_sequence(t, 0)
    pool, t, _, _ = reserve_tokens(pool, t, jnp.array([9, 0, 0]))
    pool, t = fork(pool, t, jnp.array([0]), jnp.array([2]))
    pool, t = release(pool, t, jnp.array([True, False, False]))
    assert int(pool.num_free) == 6
    pool, t = release(pool, t, jnp.array([False, False, True]))
    assert int(pool.num_free) == 9 and not bool(t.live.any())
    check_invariants(pool, t)


def test_cache_positions_and_padding():
    pool, t = fresh()
    t = add_sequence(t, 1)
    pool, t, _, _ = reserve_tokens(pool, t, jnp.array([0, 6, 0]))
    sm = cache_positions(t, jnp.array([1, 1, -1]), jnp.array([0, 5, 0]))
    assert np.asarray(sm).tolist() == [[4, 9, -1]]


def test_checker_catches_a_corrupted_refcount():
    pool, t = fresh()
    t = add_sequence(t, 0)
    pool, t, _, _ = reserve_tokens(pool, t, jnp.array([5, 0, 0]))
    bad = dataclasses.replace(pool, refcount=pool.refcount.at[1].add(1))
    with pytest.raises(InvariantError, match="refcount"):
        check_invariants(bad, t)


def scenario(pool, t, lens, forks_src, forks_dst, grow, drop):
    """add -> reserve -> fork -> reserve (cow) -> release, as one pure function."""
    t = add_sequence(add_sequence(t, 0), 1)
    pool, t, _, ok1 = reserve_tokens(pool, t, lens)
    pool, t = fork(pool, t, forks_src, forks_dst)
    pool, t, cow, ok2 = reserve_tokens(pool, t, grow)
    pool, t = release(pool, t, drop)
    return pool, t, cow, ok1 & ok2


def test_eager_equals_jit_and_values_do_not_recompile():
    traces = []

    def counted(*args):
        traces.append(1)
        return scenario(*args)

    jitted = jax.jit(counted, donate_argnums=(0, 1))
    cases = [
        ([5, 3, 0], [0], [2], [1, 1, 2], [False, True, False]),
        ([8, 1, 0], [1], [2], [3, 0, 1], [True, False, False]),
        ([2, 7, 0], [-1], [2], [0, 9, 0], [False, False, False]),
    ]
    for lens, fs, fd, grow, drop in cases:
        args = [jnp.array(x) for x in (lens, fs, fd, grow, drop)]
        eager = scenario(*fresh(), *args)
        jit_out = jitted(*fresh(), *args)
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jit_out), strict=True):
            np.testing.assert_array_equal(a, b)
        check_invariants(jit_out[0], jit_out[1])
    assert len(traces) == 1
