"""Shape of the paged KV cache: frozen and hashable, so it can be a static jit argument."""

from __future__ import annotations

import dataclasses

from paged_jax.cache.groups import blocks_held
from paged_jax.sizes import cdiv


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache and of the page tables.

    Attributes:
      num_blocks: physical blocks in the pool, including the reserved zero block 0.
      block_size: token positions per block (K).
      max_seqs: sequence slots in the page table (S).
      max_blocks_per_seq: page-table width (P); a sequence holds at most P * K tokens.
      windows: per KV cache group (cache/groups.py), its sliding window or None; one
        full-attention group by default.
    """

    num_blocks: int
    block_size: int = 16
    max_seqs: int = 8
    max_blocks_per_seq: int = 32
    windows: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved): {self.num_blocks}")
        for name in ("block_size", "max_seqs", "max_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.windows or any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows must name >= 1 group, each None or >= 1: {self.windows}")

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` computed tokens holds over its groups: ceil(n / K)
        per full-attention group, its window's blocks per sliding one."""
        return sum(blocks_held(num_tokens, w, self.block_size) for w in self.windows)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence growing to `num_tokens` tokens, `chunk` at a time, holds
        at once: a sliding group also holds a step's whole chunk before the step's slide."""
        whole = cdiv(num_tokens, self.block_size)
        return sum(whole if w is None else min(whole, cdiv(w - 1 + chunk, self.block_size) + 1)
                   for w in self.windows)
