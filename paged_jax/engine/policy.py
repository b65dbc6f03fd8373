"""Admission policy: whether the head of the waiting queue may start now.

The engine's own policy is on-demand paging: admit whatever the scheduler's block check
admits (this class). The vLLM paper's baselines (Orca's reservations, static batching) are
subclasses in paged_jax/study/reservation.py, passed in as `Engine(..., policy=...)`.
"""

from __future__ import annotations

import dataclasses

from paged_jax.engine.sequence import Request
from paged_jax.sizes import cdiv


@dataclasses.dataclass
class Policy:
    """On-demand paging: admits whatever the scheduler's block check admits.

    Attributes:
      name: the policy name (one of POLICIES).
      block_size: tokens per block.
      usable_blocks: blocks of the pool (block 0 excluded).
      max_model_len: longest prompt + output.
      max_batch: static batching's batch size B.
    """

    name: str
    block_size: int
    usable_blocks: int
    max_model_len: int
    max_batch: int

    def reserved_tokens(self, req: Request) -> int:
        """Tokens reserved per sequence at admission (0: nothing reserved ahead)."""
        return 0

    def reserved_blocks(self, req: Request) -> int:
        """Blocks reserved for the whole request at admission (all its sequences)."""
        return req.params.n * cdiv(self.reserved_tokens(req), self.block_size)

    def admits(self, req: Request, running: list[Request], waiting: list[Request]) -> bool:
        """Whether `req`, the head of the `waiting` queue, may be admitted now."""
        return True

    def on_admit(self, req: Request) -> None:
        """Called when `req` is admitted."""

    def on_finish(self, req: Request) -> None:
        """Called when `req` leaves the running set (finished, aborted or preempted)."""

    def external_fragmentation(self, head: Request | None) -> int:
        """Free blocks that the next waiting request cannot use (0 for paging)."""
        return 0
