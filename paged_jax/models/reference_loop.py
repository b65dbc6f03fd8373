"""A reference loop over the paged cache without the engine: every sequence in its own slot,
every step one ragged batch (`reserve_tokens` grows each sequence by its new tokens, the
model writes their K/V at `cache_positions` and attends through the block tables).

Model tests use it to compare the decoder with `transformers` (and backends with each other)
with no scheduler in between; serving goes through the engine (paged_jax/engine).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache import kv_quant
from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.kv_cache import KVCache, init_kv_cache
from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import Params, make_forward, prepare_params
from paged_jax.sizes import cdiv, next_pow2
from paged_jax.types import Array, Int


@dataclasses.dataclass
class PagedLoop:
    """Paged state of S sequences plus the model; `step` feeds each sequence new tokens."""

    config: ModelConfig
    params: Params
    cache_cfg: CacheConfig
    backend: str = "reference"
    shuffle_seed: int | None = None  # permute the free list: blocks handed out in random order
    kv_dtype: str = "auto"  # the cache's kv_cache_dtype (kv_quant.py): "auto" = the params'
    last_load: np.ndarray | None = None  # MoE: [L, X] tokens per expert of the last step

    def __post_init__(self) -> None:
        c, m = self.cache_cfg, self.config
        self.params = prepare_params(self.params)  # the forward's fast layout, built once
        self.pool = pool_lib.init_pool(c.num_blocks)
        if self.shuffle_seed is not None:
            perm = np.random.default_rng(self.shuffle_seed).permutation(c.num_blocks - 1) + 1
            stack = jnp.asarray(np.concatenate([perm, [0]]), jnp.int32)
            self.pool = dataclasses.replace(self.pool, free_stack=stack)
        self.table = pt.init_page_table(c)
        for s in range(c.max_seqs):
            self.table = pt.add_sequence(self.table, s)
        dtype = kv_quant.storage_dtype(self.kv_dtype, self.params["embed"].dtype)
        self.cache: KVCache = init_kv_cache(
            m.num_layers, m.num_kv_heads, c.num_blocks, c.block_size, m.head_dim, dtype
        )

    def step(self, new_tokens: list[list[int]], all_logits: bool = False) -> np.ndarray:
        """Appends `new_tokens[s]` to sequence s; returns fp32 logits [S, V] (or [T, V])."""
        s_max = self.cache_cfg.max_seqs
        if len(new_tokens) > s_max:
            raise ValueError(f"{len(new_tokens)} sequences, runner has {s_max} slots")
        num_new = np.zeros(s_max, np.int32)
        num_new[: len(new_tokens)] = [len(t) for t in new_tokens]
        t = int(num_new.sum())
        width = t if all_logits else next_pow2(t)  # padding tokens would get logits rows too
        seq_ids = np.full(width, -1, np.int32)
        seq_ids[:t] = np.repeat(np.arange(s_max), num_new)
        tokens = np.zeros(width, np.int32)
        tokens[:t] = np.concatenate([np.asarray(x, np.int64) for x in new_tokens])
        self.pool, self.table, positions, cache_pos, query_start, ok = _plan(
            self.pool, self.table, jnp.asarray(num_new), jnp.asarray(seq_ids)
        )
        if not bool(ok):
            raise RuntimeError("KV pool or page table too small for this step")
        fwd = make_forward(self.config, next_pow2(int(num_new.max())), self.backend, all_logits,
                           router_load=self.config.is_moe)
        logits, self.cache = fwd(
            self.params, self.cache, jnp.asarray(tokens), positions, cache_pos,
            self.table.block_tables, self.table.seq_lens, query_start,
        )
        if self.config.is_moe:  # tokens per expert per layer in this step, kept for studies
            logits, self.last_load = logits[0], np.asarray(logits[1])
        return np.asarray(logits[:t] if all_logits else logits[: len(new_tokens)])


@jax.jit
def _plan(
    pool: pool_lib.BlockPool, table: pt.PageTable, num_new: Int[Array, "S"],
    seq_ids: Int[Array, "T"],
) -> tuple:
    """Grows the sequences, then the positions, cache positions and query offsets of the tokens."""
    old_lens = table.seq_lens
    pool, table, _, ok = pt.reserve_tokens(pool, table, num_new)
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_new)])
    sid = jnp.clip(seq_ids, 0)
    positions = old_lens[sid] + jnp.arange(seq_ids.shape[0]) - query_start[sid]
    positions = jnp.where(seq_ids >= 0, positions, 0).astype(jnp.int32)
    cache_pos = pt.cache_positions(table, seq_ids, positions)
    return pool, table, positions, cache_pos, query_start.astype(jnp.int32), ok


def greedy(
    runner: PagedLoop, prompts: list[list[int]], max_tokens: int, stop_ids: tuple[int, ...] = ()
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Batched greedy decoding: one prefill step, then one token per sequence per step.

    Returns:
      (generated ids per prompt, cut after the first stop id; logits [S, V] of every step).
    """
    logits = runner.step(prompts)
    steps = [logits]
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(max_tokens - 1):
        if stop_ids and all(any(t in stop_ids for t in o) for o in out):
            break
        logits = runner.step([[o[-1]] for o in out])
        steps.append(logits)
        for o, t in zip(out, logits.argmax(-1), strict=True):
            o.append(int(t))
    return [_cut(o, stop_ids) for o in out], steps


def _cut(ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids


def paged_loop(
    config: ModelConfig, params: Params, num_seqs: int, max_len: int, block_size: int = 16,
    backend: str = "reference", shuffle_seed: int | None = None,
) -> PagedLoop:
    """A PagedLoop with just enough blocks for `num_seqs` sequences of `max_len` tokens."""
    per_seq = cdiv(max_len, block_size)
    cfg = CacheConfig(
        num_blocks=num_seqs * per_seq + 1, block_size=block_size, max_seqs=num_seqs,
        max_blocks_per_seq=per_seq,
    )
    return PagedLoop(config, params, cfg, backend, shuffle_seed)


__all__ = ["PagedLoop", "greedy", "paged_loop"]
