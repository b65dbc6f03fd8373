"""Cost of allocate / free / fork for 256 sequences: jitted pytree ops vs a Python free list.

    python -m experiments.bench_allocator [--seqs 256] [--rounds 32]

Each measured loop runs inside one jitted `lax.fori_loop`, so the numbers are device work per
operation, not Python dispatch. The baseline is the obvious host-side design (a list used as a
free stack plus a refcount list), doing the same operations one block at a time.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from experiments.common import save_json
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.page_table import add_sequence, fork, init_page_table, release, reserve_tokens
from paged_jax.cache.pool import init_pool


def timed(fn, *args, repeats: int = 5) -> float:
    """Best wall time of `fn(*args)` after one warm-up call (compile excluded)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def build(seqs: int, rounds: int, block_size: int):
    cfg = CacheConfig(num_blocks=2 * seqs * rounds + 1, block_size=block_size,
                      max_seqs=2 * seqs, max_blocks_per_seq=rounds)
    table = init_page_table(cfg)
    for s in range(seqs):
        table = add_sequence(table, s)
    return cfg, init_pool(cfg.num_blocks), table


def jax_loops(seqs: int, rounds: int, block_size: int) -> dict:
    cfg, pool, table = build(seqs, rounds, block_size)
    grow = jnp.where(jnp.arange(cfg.max_seqs) < seqs, block_size, 0)  # one block per seq
    first = jnp.arange(cfg.max_seqs) < seqs

    @jax.jit
    def alloc_loop(pool, table):
        def body(_, c):
            p, t, _, _ = reserve_tokens(*c, grow, max_new_blocks=2)
            return p, t
        return jax.lax.fori_loop(0, rounds, body, (pool, table))

    @jax.jit
    def alloc_free_loop(pool, table):
        def body(_, c):
            p, t, _, _ = reserve_tokens(*c, grow, max_new_blocks=2)
            p, t = release(p, t, first)
            t = t.__class__(t.block_tables, t.seq_lens, t.live | first, t.block_size)
            return p, t
        return jax.lax.fori_loop(0, rounds, body, (pool, table))

    src = jnp.arange(seqs)
    dst = src + seqs
    forks = jnp.arange(cfg.max_seqs) >= seqs

    @jax.jit
    def fork_free_loop(pool, table):
        def body(_, c):
            p, t = fork(*c, src, dst)
            return release(p, t, forks)
        return jax.lax.fori_loop(0, rounds, body, (pool, table))

    full_pool, full_table = alloc_loop(pool, table)
    held = rounds  # blocks per sequence during the fork loop
    ops = seqs * rounds
    t_alloc = timed(alloc_loop, pool, table)
    t_cycle = timed(alloc_free_loop, pool, table)
    t_fork = timed(fork_free_loop, full_pool, full_table)
    return {
        "allocate_per_block_us": 1e6 * t_alloc / ops,
        "allocate_and_free_per_block_us": 1e6 * t_cycle / ops,
        "free_per_block_us (cycle - allocate)": 1e6 * (t_cycle - t_alloc) / ops,
        "fork_and_release_per_fork_us": 1e6 * t_fork / ops,
        "fork_blocks_per_sequence": held,
        "ops_per_loop": ops,
    }


def python_baseline(seqs: int, rounds: int) -> dict:
    """A host free list: list.pop()/append() and a refcount list, one block at a time."""
    n = 2 * seqs * rounds + 1
    free = list(range(n - 1, 0, -1))
    ref = [0] * n
    tables = [[] for _ in range(2 * seqs)]

    def alloc(s):
        b = free.pop()
        ref[b] = 1
        tables[s].append(b)

    def release_seq(s):
        for b in tables[s]:
            ref[b] -= 1
            if ref[b] == 0:
                free.append(b)
        tables[s] = []

    ops = seqs * rounds
    t0 = time.perf_counter()
    for _ in range(rounds):
        for s in range(seqs):
            alloc(s)
    t_alloc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for s in range(seqs):
            tables[seqs + s] = list(tables[s])
            for b in tables[s]:
                ref[b] += 1
        for s in range(seqs, 2 * seqs):
            release_seq(s)
    t_fork = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(seqs):
        release_seq(s)
    t_free = time.perf_counter() - t0
    return {
        "allocate_per_block_us": 1e6 * t_alloc / ops,
        "free_per_block_us": 1e6 * t_free / ops,
        "fork_and_release_per_fork_us": 1e6 * t_fork / ops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    res = {
        "config": vars(args),
        "jax": jax_loops(args.seqs, args.rounds, args.block_size),
        "python_free_list": python_baseline(args.seqs, args.rounds),
    }
    print(f"{'operation':44s} {'jax (jit loop)':>16s} {'python list':>12s}")
    pj, pp = res["jax"], res["python_free_list"]
    print(f"{'allocate, per block (us)':44s} {pj['allocate_per_block_us']:16.3f} "
          f"{pp['allocate_per_block_us']:12.3f}")
    print(f"{'free, per block (us)':44s} {pj['free_per_block_us (cycle - allocate)']:16.3f} "
          f"{pp['free_per_block_us']:12.3f}")
    print(f"{'fork + release, per fork of ' + str(args.rounds) + '-block seq (us)':44s} "
          f"{pj['fork_and_release_per_fork_us']:16.3f} {pp['fork_and_release_per_fork_us']:12.3f}")
    print(f"saved {save_json('bench_allocator', res)}")


if __name__ == "__main__":
    main()
