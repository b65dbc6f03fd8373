"""Host-side scheduler: who runs in the next step.

THE RULE. There is no prefill or decode phase: every running sequence's computed tokens catch
up with its total tokens. Each step has a budget of `max_num_batched_tokens` tokens and at most
`max_num_seqs` sequences:
  1. running sequences needing one token (decodes) go first, oldest request first;
  2. running sequences with more pending tokens (prefill, or recompute after preemption) get
     chunks of what budget is left, oldest first (chunked prefill);
  3. waiting requests are admitted first come first served (preempted ones at the front) while
     slots, budget and blocks allow; the first that does not fit stops admission. With prefix
     caching, a request starts at its longest cached prefix: hit blocks cost no new blocks
     (only cached-free ones reduce the free count), and `admission="cache-aware"` admits the
     longest cached prefix first, no request passed over more than `max_skips` times.
When the free blocks cannot cover steps 1-2, the most recently admitted running request is
preempted (all its sequences): its blocks are freed and it goes back to the front of the
queue, to be recomputed (default) or swapped back in. A preempted request loses nothing.

The scheduler only plans; the engine executes the plan on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from paged_jax import prefix_cache as pc
from paged_jax.reservation import Policy, make_policy
from paged_jax.sequence import Request, Sequence, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    admission: str = "fcfs"  # or "cache-aware" (longest cached prefix first)
    max_skips: int = 8  # cache-aware: the most times a request may be passed over


@dataclasses.dataclass
class Plan:
    """What the next step computes: (sequence, tokens) chunks, in batch order."""

    chunks: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    admitted: list[Request] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def decode_only(self) -> bool:
        return bool(self.chunks) and all(n == 1 for _, n in self.chunks)


def blocks_needed(seq: Sequence, n: int, block_size: int) -> int:
    """Upper bound on the blocks `seq` gains by computing `n` more tokens (copy included)."""
    have = -(-seq.num_computed // block_size)
    restore = have if seq.swapped is not None else 0  # swapped blocks come back first
    grow = -(-(seq.num_computed + n) // block_size) - have
    copy = int(seq.maybe_shared_last and seq.num_computed % block_size != 0 and n > 0)
    return restore + grow + copy


class Scheduler:
    """Queues and the scheduling rule above.

    Args:
      config: step limits.
      num_slots: page-table slots (a request holds one per sequence from admission to finish,
        also while preempted, so its sampling state survives).
      policy: KV reservation policy (reservation.py), consulted before the block check when
        admitting; None = on-demand paging.
    """

    def __init__(self, config: SchedulerConfig, num_slots: int, policy: Policy | None = None):
        self.config = config
        self.policy = policy or make_policy("paged", config.block_size, 0, 0, num_slots)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.prefix: pc.PrefixCache | None = None  # set by the engine when caching is on
        self.skips: dict[str, int] = {}  # cache-aware admission: times passed over

    # ---- queues --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requeue_front(self, req: Request) -> None:
        """A preempted request waits ahead of every request admitted after it."""
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.waiting.sort(key=lambda r: (r.order < 0, r.order if r.order >= 0 else 0))

    def finish(self, req: Request) -> None:
        for s in req.seqs:
            if s.slot >= 0:
                self.free_slots.append(s.slot)
                s.slot = -1
        self.policy.on_finish(req)
        for q in (self.running, self.waiting):
            if req in q:
                q.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------------
    def schedule(
        self, num_free: int, preempt: Callable[[Request], int], next_order: Callable[[], int]
    ) -> Plan:
        """Plans one step.

        Args:
          num_free: free blocks in the pool now.
          preempt: frees a running request's blocks on the device; returns the new num_free.
          next_order: hands out admission counters.

        Returns:
          The plan (possibly empty when nothing fits yet).
        """
        plan, budget, free = Plan(), self.config.max_num_batched_tokens, num_free
        used = 0  # blocks this plan has already claimed (not yet taken on the device)
        k = self.config.block_size
        for want_decode in (True, False):
            for req in sorted(self.running, key=lambda r: r.order):
                for seq in [s for s in req.seqs if s.status is Status.RUNNING]:
                    if budget == 0 or (seq.num_pending == 1) != want_decode:
                        continue
                    n = min(seq.num_pending, budget)
                    while blocks_needed(seq, n, k) > free:
                        victim = self._victim(exclude=req, planned=plan)
                        if victim is None:
                            break
                        # preempt() reports the device's free count, which does not yet
                        # know about the blocks planned above.
                        free = preempt(victim) - used
                    if blocks_needed(seq, n, k) > free or req not in self.running:
                        continue
                    used += blocks_needed(seq, n, k)
                    free -= blocks_needed(seq, n, k)
                    budget -= n
                    plan.chunks.append((seq, n))
        self._admit(plan, budget, free, next_order)
        return plan

    def _victim(self, exclude: Request, planned: Plan) -> Request | None:
        """The most recently admitted running request other than `exclude` and not planned."""
        planned_reqs = {id(s) for s, _ in planned.chunks}
        cands = [r for r in self.running if r is not exclude
                 and not any(id(s) in planned_reqs for s in r.seqs)]
        return max(cands, key=lambda r: r.order) if cands else None

    def _admit(self, plan: Plan, budget: int, free: int, next_order: Callable[[], int]) -> None:
        before = list(self.waiting)
        self._admit_queue(plan, budget, free, next_order)
        if self.config.admission == "cache-aware":
            pc.count_skips(before, plan.admitted, self.skips)

    def _queue(self) -> list[Request]:
        """Waiting requests in admission order."""
        if self.config.admission != "cache-aware" or self.prefix is None:
            return list(self.waiting)
        return pc.cache_aware_order(self.waiting, self._cached_len, self.skips,
                                    self.config.max_skips)

    def _cached_len(self, req: Request) -> int:
        return self.prefix.lookup(req.seqs[0]).num_tokens if pc.fresh(req) else 0

    def _prefix_hit(self, req: Request) -> pc.Hit | None:
        """Starts a fresh request at its cached prefix (tentatively: undone if not admitted)."""
        if self.prefix is None or not pc.fresh(req):
            return None
        hit = self.prefix.lookup(req.seqs[0])
        if not hit.blocks:
            return None
        pc.apply_hit(req.seqs[0], hit, self.config.block_size)
        return hit

    def _admit_queue(
        self, plan: Plan, budget: int, free: int, next_order: Callable[[], int]
    ) -> None:
        k = self.config.block_size
        queue = self._queue()
        while queue and budget > 0:
            req = queue[0]
            first = req.live_seqs()[0] if req.forked else req.seqs[0]
            seqs = req.live_seqs() if req.forked else [req.seqs[0]]
            slots_needed = sum(1 for s in req.seqs if s.slot < 0)
            if slots_needed > len(self.free_slots):
                return
            if not self.policy.admits(req, self.running, self.waiting):
                return  # a baseline's reservation does not fit (or static batch closed)
            hit = self._prefix_hit(req)
            chunks, need, left = [], hit.num_evictable if hit else 0, budget
            for s in seqs:
                n = min(s.num_pending, left)
                if n == 0:
                    break
                chunks.append((s, n))
                need += blocks_needed(s, n, k)
                left -= n
            if not chunks or need > free or chunks[0][0] is not first:
                if hit:
                    pc.undo_hit(first)
                return
            queue.pop(0)
            self.waiting.remove(req)
            if self.prefix is not None and req.order < 0:  # first admission, as vLLM reports
                req.num_cached_tokens = hit.num_tokens if hit else 0
                self.prefix.count(len(first.tokens), req.num_cached_tokens)
            if hit:
                self.prefix.acquire(hit)
            for s in req.seqs:
                if s.slot < 0:
                    s.slot = self.free_slots.pop()
            for s in seqs:
                s.status = Status.RUNNING
            if req.order < 0:
                req.order = next_order()
            self.running.append(req)
            self.policy.on_admit(req)
            plan.chunks.extend(chunks)
            plan.admitted.append(req)
            budget, free = left, free - need
