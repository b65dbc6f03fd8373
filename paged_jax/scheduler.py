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

The scheduler plans; the KV manager (kv_manager.py) it holds owns the slots and blocks and
frees a preempted request's blocks; the engine runs the plan on the device. A plan of decodes
only runs as a decode window (several steps in one device call) unless something must join
the batch first: a slot going live, an n > 1 request to fork, or a waiting request that fits.
"""

from __future__ import annotations

import dataclasses
import itertools

from paged_jax import prefix_cache as pc
from paged_jax.kv_manager import KVManager, blocks_needed
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
    decode_window: int = 1  # decode steps per device call when only decodes run


@dataclasses.dataclass
class Plan:
    """What the next step computes: (sequence, tokens) chunks, in batch order."""

    chunks: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    admitted: list[Request] = dataclasses.field(default_factory=list)
    window: bool = False  # run as a decode window (decodes only, nothing joins)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def decode_only(self) -> bool:
        return bool(self.chunks) and all(n == 1 for _, n in self.chunks)


class Scheduler:
    """Queues and the scheduling rule above.

    Args:
      config: step limits.
      kv: the KV manager: slots (a request holds one per sequence from admission to finish,
        also while preempted, so its sampling state survives), blocks, prefix cache.
      policy: KV reservation policy (reservation.py), consulted before the block check when
        admitting; None = on-demand paging.
    """

    def __init__(self, config: SchedulerConfig, kv: KVManager, policy: Policy | None = None):
        self.config, self.kv = config, kv
        self.policy = policy or make_policy("paged", config.block_size, 0, 0, config.max_num_seqs)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.skips: dict[str, int] = {}  # cache-aware admission: times passed over
        self.num_preempted = 0
        self._orders = itertools.count()  # admission counters

    # ---- queues --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requeue_front(self, req: Request) -> None:
        """A preempted request waits ahead of every request admitted after it."""
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.waiting.sort(key=lambda r: (r.order < 0, r.order if r.order >= 0 else 0))

    def finish(self, req: Request) -> None:
        """Drops a finished or aborted request (its blocks must be released already)."""
        for s in req.seqs:
            self.kv.free_slot(s)
        self.policy.on_finish(req)
        for q in (self.running, self.waiting):
            if req in q:
                q.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------------
    def preempt(self, req: Request) -> int:
        """Frees a running request's blocks (the KV manager swaps them out first in swap mode)
        and puts it back at the front of the queue; returns the blocks a plan may use now."""
        seqs = [s for s in req.seqs if s.status is Status.RUNNING]
        free = self.kv.preempt(seqs)
        for s in seqs:
            s.status, s.maybe_shared_last = Status.WAITING, False
            if s.swapped is None:
                s.num_computed = 0  # recompute
        self.requeue_front(req)
        self.num_preempted += 1
        return free

    def schedule(self) -> Plan:
        """Plans one step (possibly empty when nothing fits yet); may preempt."""
        plan, budget, free = Plan(), self.config.max_num_batched_tokens, self.kv.free_total()
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
                        free = self.preempt(victim) - used
                    if blocks_needed(seq, n, k) > free or req not in self.running:
                        continue
                    used += blocks_needed(seq, n, k)
                    free -= blocks_needed(seq, n, k)
                    budget -= n
                    plan.chunks.append((seq, n))
        self._admit(plan, budget, free)
        plan.window = self._window(plan)
        return plan

    def _window(self, plan: Plan) -> bool:
        """Whether a plan runs as a decode window: decodes only, and nothing joins first."""
        if self.config.decode_window < 2 or not plan.decode_only or plan.admitted:
            return False
        for s, _ in plan.chunks:
            # going live, or a one-token prompt that must fork or asks for its hidden state
            # (a window returns neither)
            if not self.kv.slot_live[s.slot] or s.wants_hidden(1) or (
                    s.owner.params.n > 1 and not s.owner.forked):
                return False
        return not self._can_admit()

    def _can_admit(self) -> bool:
        """Whether a waiting request could join now (then a window would delay it)."""
        return bool(self.waiting) and any(
            r.seqs[0].slot >= 0 or self.kv.free_slots for r in self.waiting) and (
            self.policy.admits(self.waiting[0], self.running, self.waiting))

    def _victim(self, exclude: Request, planned: Plan) -> Request | None:
        """The most recently admitted running request other than `exclude` and not planned."""
        planned_reqs = {id(s) for s, _ in planned.chunks}
        cands = [r for r in self.running if r is not exclude
                 and not any(id(s) in planned_reqs for s in r.seqs)]
        return max(cands, key=lambda r: r.order) if cands else None

    def _admit(self, plan: Plan, budget: int, free: int) -> None:
        before = list(self.waiting)
        self._admit_queue(plan, budget, free)
        if self.config.admission == "cache-aware":
            pc.count_skips(before, plan.admitted, self.skips)

    def _queue(self) -> list[Request]:
        """Waiting requests in admission order."""
        if self.config.admission != "cache-aware" or self.kv.prefix is None:
            return list(self.waiting)
        return pc.cache_aware_order(self.waiting, self._cached_len, self.skips,
                                    self.config.max_skips)

    def _cached_len(self, req: Request) -> int:
        return self.kv.prefix.lookup(req.seqs[0]).num_tokens if self._may_hit(req) else 0

    def _may_hit(self, req: Request) -> bool:
        """Fresh requests may start at a cached prefix, except those that want prompt
        logprobs (every prompt token must be computed)."""
        return pc.fresh(req) and req.params.prompt_logprobs is None

    def _prefix_hit(self, req: Request) -> pc.Hit | None:
        """Starts a fresh request at its cached prefix (tentatively: undone if not admitted)."""
        if self.kv.prefix is None or not self._may_hit(req):
            return None
        hit = self.kv.prefix.lookup(req.seqs[0])
        if not hit.blocks:
            return None
        pc.apply_hit(req.seqs[0], hit, self.config.block_size)
        return hit

    def _admit_queue(self, plan: Plan, budget: int, free: int) -> None:
        k = self.config.block_size
        queue = self._queue()
        while queue and budget > 0:
            req = queue[0]
            first = req.live_seqs()[0] if req.forked else req.seqs[0]
            seqs = req.live_seqs() if req.forked else [req.seqs[0]]
            if not self.kv.can_allocate(req.seqs):
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
            prefix = self.kv.prefix
            if prefix is not None and req.order < 0:  # first admission, as vLLM reports
                req.num_cached_tokens = hit.num_tokens if hit else 0
                prefix.count(len(first.tokens), req.num_cached_tokens)
            if hit:
                prefix.acquire(hit)
            self.kv.allocate(req.seqs)
            for s in seqs:
                s.status = Status.RUNNING
            if req.order < 0:
                req.order = next(self._orders)
            self.running.append(req)
            self.policy.on_admit(req)
            plan.chunks.extend(chunks)
            plan.admitted.append(req)
            budget, free = left, free - need
