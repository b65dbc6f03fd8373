"""Shape of the paged KV cache: frozen and hashable, so it can be a static jit argument."""

from __future__ import annotations

import dataclasses

from paged_jax.sizes import cdiv


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache and of the page tables.

    Attributes:
      num_blocks: physical blocks in the pool, including the reserved zero block 0.
      block_size: token positions per block (K).
      max_seqs: sequence slots in the page table (S).
      max_blocks_per_seq: page-table width (P); a sequence holds at most P * K tokens.
    """

    num_blocks: int
    block_size: int = 16
    max_seqs: int = 8
    max_blocks_per_seq: int = 32

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved): {self.num_blocks}")
        for name in ("block_size", "max_seqs", "max_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds: ceil(n / K)."""
        return cdiv(num_tokens, self.block_size)
