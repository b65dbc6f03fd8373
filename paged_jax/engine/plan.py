"""What the scheduler hands the runner: one device call's work, on the host.

    Plan.chunks    (sequence, tokens) to compute, in batch order
    Plan.admits    slots going live in the call (first admissions, resumes after recompute)
    Plan.ops       the KV manager's queued allocator work (cache/ops.py), host arrays
    Plan.restores  swapped-out sequences coming back (swap preemption mode only)
    Plan.window    run the decodes as a decode window (several steps in one call)
    Plan.drafts    speculative decoding: draft tokens a row verifies (a verify call)
    Plan.catchup   ... with a draft model: the tokens it reads first, per row

A plan with no chunks but with ops is an ops-only call (an engine going idle, or a step
whose sequences all wait for blocks a pending release gives back).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.cache.prefix_cache import Hit
from paged_jax.engine.sequence import Request, Sequence


@dataclasses.dataclass
class Admit:
    """A slot going live in the next call (an Admissions row, host side).

    Attributes:
      seq: the sequence taking the slot.
      new_request: its request is admitted for the first time: write its sampling row.
      seed: the seed used when the request has none of its own.
      hit: the prefix-cache hit to attach (None: none).
    """

    seq: Sequence
    new_request: bool
    seed: int
    hit: Hit | None = None


@dataclasses.dataclass(eq=False)
class Sent:
    """What one call takes and gives that the host learns only from its output: the
    releases it carries, the blocks its plan may take (at most), the cached-free blocks it
    evicts onto the free stack, and the cached blocks its prefix hits take back into use
    (an earlier call's refcounts do not show them yet)."""

    releases: list[tuple[Sequence, int]]
    need: int
    evicted: int
    acquired: set[int] = dataclasses.field(default_factory=set)  # cached blocks its hits took


@dataclasses.dataclass
class Plan:
    """One device call's work (see the module docstring)."""

    chunks: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    admitted: list[Request] = dataclasses.field(default_factory=list)
    admits: list[Admit] = dataclasses.field(default_factory=list)
    ops: dict[str, np.ndarray] | None = None
    restores: list[tuple] = dataclasses.field(default_factory=list)  # (slot, tokens, parts)
    window: bool = False  # run as a decode window (decodes only, nothing joins)
    # id(seq) -> its draft tokens (engine/speculative.py); its chunk is 1 + len(drafts)
    drafts: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # id(seq) -> (draft_computed, tokens) the draft model reads first (engine/draft.py)
    catchup: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    deferred: int = 0  # sequences that wait for blocks a pending release gives back
    sent: Sent | None = None  # the KV manager's record of the call (take_ops)
    # Filled when the call is sent (Scheduler.sent), read when its output lands: each row's
    # computed count before the call, the rows that sample (a placeholder each until read),
    # and the rows whose request asked for the prompt's hidden state.
    starts: dict[int, int] = dataclasses.field(default_factory=dict)  # id(seq) -> start
    slots: dict[int, int] = dataclasses.field(default_factory=dict)  # id(seq) -> its slot
    samples: set[int] = dataclasses.field(default_factory=set)
    hidden: set[int] = dataclasses.field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def decode_only(self) -> bool:
        """Every row decodes: one token, its last. A one-token prefill chunk (the budget's
        last token, or a chunk shrunk to the free blocks) is not a decode: a verify step or
        window would sample after it."""
        return bool(self.chunks) and all(n == 1 == s.num_pending for s, n in self.chunks)

    @property
    def host_picks(self) -> bool:
        """Some row's next token follows from this call's output on the host: structured
        outputs (its next mask) or beam search (its next beams). No window then."""
        return any(s.matcher is not None or s.owner.beam is not None for s, _ in self.chunks)

    @property
    def empty(self) -> bool:
        """Nothing to run on the device at all."""
        return not self.chunks and self.ops is None
