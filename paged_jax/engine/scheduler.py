"""Host-side scheduler: who runs in the next step, and where a step's results land.

THE RULE. There is no prefill or decode phase: every running sequence's computed tokens catch
up with its total tokens. Each step has a budget of `max_num_batched_tokens` tokens and at most
`max_num_seqs` sequences:
  1. running sequences needing one token (decodes) go first, oldest request first;
  2. running sequences with more pending tokens (prefill, or recompute after preemption) get
     chunks of what budget is left, oldest first (chunked prefill), each chunk at most
     `long_prefill_token_threshold` tokens when set (a long prompt then shares steps with
     the decodes instead of filling them: fair prefill); a chunk the free blocks cannot
     cover shrinks to what they cover before anyone is preempted for it (with sliding-window
     groups a chunk's columns are taken in every group until the step's slide frees the old
     ones, so a long prompt's last chunk in a nearly full pool needs more than it will hold);
  3. waiting requests are admitted first come first served (preempted ones at the front) while
     slots, budget, blocks and LoRA adapter slots allow; the first that does not fit stops
     admission. With prefix caching a request starts at its longest cached prefix (only
     cached-free hit blocks cost free ones); "cache-aware" admission (engine/admission.py).
  4. only blocks the device has confirmed free count: a release queued for the next call
     (finish, abort, preemption) gives its blocks back when that call's output says so. A
     sequence whose blocks only a queued release can give waits one step.
When even the queued releases cannot cover steps 1-2, the most recently admitted running
request is preempted (all its sequences): its blocks are released and it goes back to the
front of the queue, to be recomputed (default) or swapped back in. Nothing is lost.

    schedule()                     -> Plan: chunks, admissions, the KV manager's queued ops
    update_from_output(plan, out)  -> the requests with news. The one place a step's results
        land: tokens appended and detokenized, stop strings (engine/output.py); counts and
        prefix registrations (the KV manager); finished sequences freed (`free`)

A plan of decodes only runs as a decode window (several steps in one device call) unless
something must join the batch first: a slot going live, an n > 1 request to fork, or a
waiting request that fits. With speculative decoding (engine/speculative.py), a plan of
decodes that admits nothing gets drafts instead and runs as one verify call.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import TYPE_CHECKING

from paged_jax.engine import admission
from paged_jax.engine import beam_search as beams
from paged_jax.engine import output as out_lib
from paged_jax.engine import speculative as spec_lib
from paged_jax.engine.kv_manager import KVManager
from paged_jax.engine.plan import Plan
from paged_jax.engine.policy import Policy
from paged_jax.engine.sequence import Request, Sequence, Status
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.sizes import largest_fitting

if TYPE_CHECKING:
    from paged_jax.engine.runner import StepOutput
    from paged_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    admission: str = "fcfs"  # or "cache-aware" (longest cached prefix first)
    max_skips: int = 8  # cache-aware: the most times a request may be passed over
    decode_window: int = 1  # decode steps per device call when only decodes run
    seed: int = 0  # engine seed: requests without their own get seed * 1_000_003 + arrival
    async_scheduling: bool = False  # steps are planned one ahead: no decode windows
    long_prefill_token_threshold: int = 0  # most tokens of one prefill chunk; 0 = no cap
    speculative: SpeculativeConfig | None = None  # drafts for decode-only plans
    max_loras: int = 0  # distinct LoRA adapters among running requests (paged_jax/lora)


class Scheduler:
    """Queues, the scheduling rule above, and the results of each step.

    Args:
      config: step limits.
      kv: the KV manager: slots (a request holds one per sequence from admission to finish,
        also while preempted, so its sampling state survives), blocks, prefix cache.
      policy: admission policy (engine/policy.py); None = on-demand paging.
      tokenizer: detokenizes outputs and finds stop strings (None: token ids only).
    """

    def __init__(self, config: SchedulerConfig, kv: KVManager, policy: Policy | None = None,
                 tokenizer: Tokenizer | None = None):
        self.config, self.kv, self.tokenizer = config, kv, tokenizer
        self.policy = policy or Policy("paged", config.block_size, 0, 0, config.max_num_seqs)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.skips: dict[str, int] = {}  # cache-aware admission: times passed over (waiting)
        self.num_preempted = 0
        self.refused_steps = 0  # steps the device refused for lack of blocks (a planning bug)
        self.spec = spec_lib.SpecCounts()  # speculative decoding, this engine's totals
        self._orders = itertools.count()  # admission counters
        self._arrivals = itertools.count()  # sampling seeds of requests without their own

    # ---- queues --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requeue_front(self, req: Request) -> None:
        """A preempted request waits ahead of every request admitted after it."""
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.waiting.sort(key=lambda r: (r.order < 0, r.order if r.order >= 0 else 0))

    def free(self, seqs: list[Sequence]) -> None:
        """Sequences done for good (finished, aborted, or a caller's beams): the only caller
        of KVManager.free."""
        self.kv.free(seqs)
        for s in seqs:
            s.status = Status.FINISHED

    def abort(self, req: Request) -> None:
        """Drops a request wherever it is; everything it holds is freed."""
        for s in req.live_seqs():
            s.finish_reason = "abort"
        self.free(req.held_seqs())
        self._drop(req)

    def _drop(self, req: Request) -> None:
        self.policy.on_finish(req)
        self.skips.pop(req.request_id, None)
        for q in (self.running, self.waiting):
            if req in q:
                q.remove(req)

    # ---- planning ------------------------------------------------------------------------
    def preempt(self, req: Request) -> int:
        """Releases a running request's blocks (swapped out first in swap mode) and puts it
        back at the front of the queue; returns what the release may give back (at most)."""
        seqs = [s for s in req.seqs if s.status is Status.RUNNING]
        freed = self.kv.preempt(seqs, swap=req.beam is None)  # beams recompute (beam_search.py)
        if req.beam is not None:
            req.beam.tops.clear()  # each beam computes its last token again
        for s in seqs:
            s.status = Status.WAITING
        self.requeue_front(req)
        self.num_preempted += 1
        req.num_preemptions += 1
        return freed

    def schedule(self, can_preempt: bool = True) -> Plan | None:
        """Plans one device call (possibly empty when nothing fits yet); may preempt.

        With a step in flight (async scheduling), its sampled tokens are placeholders: a
        sequence whose output they complete (max_tokens) is not planned again. A plan that
        would preempt returns None, before any change, unless `can_preempt` (the caller
        reads the step in flight first, then plans with exact counts)."""
        plan, budget = Plan(), self.config.max_num_batched_tokens
        free, maybe = self.kv.free_total(), self.kv.pending_free()
        for want_decode in (True, False):
            for req in sorted(self.running, key=lambda r: r.order):
                for seq in [s for s in req.seqs if s.status is Status.RUNNING]:
                    if budget == 0 or (seq.num_pending == 1) != want_decode or (
                            seq.num_placeholders and seq.at_max_tokens()) or not seq.num_pending:
                        continue
                    n = self._chunk(seq, budget)
                    need = self.kv.blocks_needed(seq, n)
                    if need > free and not want_decode:  # a prefill chunk shrinks (rule 2)
                        n = largest_fitting(n, lambda m, s=seq, f=free: self.kv.blocks_needed(
                            s, m) <= f) or n
                        need = self.kv.blocks_needed(seq, n)
                    if need > free and not can_preempt:
                        return None
                    while need > free + maybe and (victim := self._victim(req, plan)):
                        maybe += self.preempt(victim)
                    if need > free:
                        plan.deferred += 1  # rule 4 (or nothing left to preempt)
                        continue
                    free, budget = free - need, budget - n
                    plan.chunks.append((seq, n))
        budget, free = self._admit(plan, budget, free)
        if self.config.speculative is not None:
            spec_lib.add_drafts(plan, self.config.speculative, self.kv, budget, free,
                                self.config.max_num_batched_tokens)
        plan.window = self._window(plan)
        self._finish_plan(plan)
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` the step computes: what is pending, within the budget and, for a
        prefill chunk, the long-prefill cap."""
        cap = self.config.long_prefill_token_threshold
        n = min(seq.num_pending, budget)
        return cap if 0 < cap < n else n

    def _finish_plan(self, plan: Plan) -> None:
        """Room for the plan (evictions), its admissions and the queued ops."""
        now = time.time()
        new = set()
        for req in plan.admitted:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.time_in_queue = now - req.arrival_time
                new.add(id(req))
        self.kv.room_for(plan.chunks, plan.decode_only)
        plan.admits, plan.restores = self.kv.bring_live([s for s, _ in plan.chunks])
        for a in plan.admits:
            a.new_request = id(a.seq.owner) in new and a.seq.index == 0
            if a.new_request:
                a.seed = self.config.seed * 1_000_003 + next(self._arrivals)
        plan.ops, plan.sent = self.kv.take_ops()

    def _window(self, plan: Plan) -> bool:
        """Whether a plan runs as a decode window: decodes only, and nothing joins first."""
        if (self.config.decode_window < 2 or self.config.async_scheduling
                or not plan.decode_only or plan.admitted or self._speculating(plan)
                or plan.host_picks):
            return False
        for s, _ in plan.chunks:
            # a one-token prefill chunk (budget or long-prefill cap) is not a decode; going
            # live, or a one-token prompt that must fork or asks for its hidden state (a
            # window returns neither)
            if s.num_pending != 1 or not self.kv.slot_live[s.slot] or s.wants_hidden(1) or (
                    s.owner.params.n > 1 and not s.owner.forked):
                return False
        return not self._can_admit()

    def _speculating(self, plan: Plan) -> bool:
        """Speculative decoding applies to the plan's batch size: every step is planned
        (and may draft), none runs as a window."""
        spec = self.config.speculative
        return spec is not None and spec.applies(len(plan.chunks))

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

    def _admit(self, plan: Plan, budget: int, free: int) -> tuple[int, int]:
        """Admits waiting requests in order while they fit; returns the budget and the free
        blocks left."""
        before = list(self.waiting)
        queue = admission.queue(self.waiting, self.kv, self.config.admission, self.skips,
                                self.config.max_skips)
        while queue and budget > 0:
            left = self._admit_one(queue[0], plan, budget, free)
            if left is None:
                break
            queue.pop(0)
            budget, free = left
        if self.config.admission == "cache-aware":
            admission.count_skips(before, plan.admitted, self.skips)
        return budget, free

    def _admit_one(self, req: Request, plan: Plan, budget: int,
                   free: int) -> tuple[int, int] | None:
        """Admits `req` into the plan if slots, policy, budget and blocks allow; returns the
        budget and free blocks left, or None (admission stops here)."""
        first = req.live_seqs()[0] if req.forked else req.seqs[0]
        seqs = req.live_seqs() if req.forked else [req.seqs[0]]
        if not (self.kv.can_allocate(req.held_seqs()) and self.kv.settled(req)
                and admission.adapter_fits(req, self.running, self.config.max_loras)
                and self.policy.admits(req, self.running, self.waiting)):
            return None
        hit = self.kv.try_hit(req)
        chunks, need, left = [], hit.num_evictable if hit else 0, budget
        for s in seqs:
            n = self._chunk(s, left)
            if n == 0:
                break
            chunks.append((s, n))
            need += self.kv.blocks_needed(s, n)
            left -= n
        if not chunks or need > free or chunks[0][0] is not first:
            if hit:
                self.kv.undo_hit(first)
            return None
        self.waiting.remove(req)
        self.skips.pop(req.request_id, None)
        self.kv.admit_hit(req, hit, first_time=req.order < 0)
        self.kv.allocate(req.held_seqs())  # not finished ones: their slots are gone for good
        for s in seqs:
            s.status = Status.RUNNING
        if req.order < 0:
            req.order = next(self._orders)
        self.running.append(req)
        self.policy.on_admit(req)
        plan.chunks.extend(chunks)
        plan.admitted.append(req)
        return left, free - need

    def host_picks_running(self) -> bool:
        """Whether a running request's next tokens follow from the last step's output on the
        host (structured outputs' masks, beam search's beams): the engine then plans no step
        ahead (async off)."""
        return any(r.beam is not None or any(s.matcher is not None for s in r.seqs)
                   for r in self.running)

    # ---- results -------------------------------------------------------------------------
    def sent(self, plan: Plan, children: list[Sequence]) -> None:
        """The plan's call is on its way: a step's tokens count as computed now (the next
        plan may follow before its output is read), and each row that samples holds a
        placeholder until then (`children`: n > 1 children the step creates, which sample).
        A window's counts wait for its output (how many steps ran is known only then), and
        so do a verify step's rows with drafts (how many tokens they keep)."""
        for seq, n in plan.chunks:
            plan.starts[id(seq)], plan.slots[id(seq)] = seq.num_computed, seq.slot
            if seq.wants_hidden(n):
                plan.hidden.add(id(seq))
            if seq.num_computed + n == seq.length:
                plan.samples.add(id(seq))
        for c in children:
            plan.starts[id(c)], plan.slots[id(c)] = 0, c.slot
            plan.samples.add(id(c))
        if plan.window:
            return
        self.kv.advance([(s, n) for s, n in plan.chunks if id(s) not in plan.drafts],
                        draft=not (plan.drafts or plan.catchup))  # a ragged step: draft.py
        for seq, _ in plan.chunks:
            seq.num_placeholders += id(seq) in plan.samples
        for c in children:
            c.num_placeholders += 1

    def update_from_output(self, plan: Plan, out: StepOutput | None) -> list[Request]:
        """Applies one call's results; returns the requests with news (finished ones, whose
        sequences are freed, and those that ran). A row whose sequence finished while the
        call ran (stop string, abort: async scheduling) is skipped: its token is discarded."""
        if out is None:
            return []
        if out.kind == "ops" or not out.ok:
            self.kv.update_from_output([], out, plan.sent)
            if not out.ok:  # the plan missed (should not happen): free memory, retry later
                self._undo(plan)
                self.refused_steps += 1
                self.preempt(max(self.running, key=lambda r: r.order))
            return []
        if out.hidden is not None:
            out_lib.hidden_states(out.rows, plan.hidden, out.hidden)
        rows, finished, dead = [], [], {}
        counts = {id(s): n for s, n in plan.chunks}
        for i, seq in enumerate(out.rows):
            if seq.status is Status.FINISHED:
                seq.num_placeholders = 0
                dead[i] = plan.slots.get(id(seq), -1)
                rows.append((seq, plan.starts.get(id(seq), 0), counts.get(id(seq), 0)))
                continue
            seq.num_placeholders -= id(seq) in plan.samples and out.kind != "window"
            emitted = int(out.valid[:, i].sum())
            if seq.owner.beam is not None:  # candidates, not a token (engine/beam_search.py)
                beams.record(seq, out, i, self.tokenizer)
                rows.append((seq, plan.starts[id(seq)], counts[id(seq)]))
                continue
            used, done = out_lib.emit(seq, out, i, emitted, self.tokenizer)
            start = plan.starts.get(id(seq), seq.num_computed)
            if out.kind == "window" or id(seq) in plan.drafts:
                self.kv.advance([(seq, used)])
            if id(seq) in plan.catchup:
                self.kv.advance_draft(seq, plan.catchup[id(seq)],
                                      len(plan.drafts.get(id(seq), ())), start)
            if id(seq) in plan.drafts:
                made = len(plan.drafts[id(seq)]) if out.drafted is None else int(out.drafted[i])
                self.spec.count(seq.owner, made, emitted - 1)
            rows.append((seq, start, seq.num_computed - start))
            if done:
                finished.append(seq)
        self.kv.update_from_output(rows, out, plan.sent, dead=dead)
        if out.prompt is not None:
            out_lib.prompt_logprobs(out.rows, plan.chunks, plan.starts, out.prompt,
                                    self.tokenizer)
        for parent, children in out.forks:
            self.kv.live_children(parent, children)
            for c in children:
                c.status = Status.RUNNING
            parent.owner.forked = True
        for req in dict.fromkeys(s.owner for s in out.rows if s.owner.beam is not None):
            finished += beams.advance(req, self.kv, self.free, self.tokenizer)
        return self._finish(finished, plan)

    def _undo(self, plan: Plan) -> None:
        """A refused step computed nothing: its counts and placeholders go back."""
        for seq, _ in plan.chunks:
            if id(seq) in plan.starts:
                seq.num_computed = plan.starts[id(seq)]
                seq.num_placeholders -= id(seq) in plan.samples

    def _finish(self, finished: list[Sequence], plan: Plan) -> list[Request]:
        """Frees finished sequences; the requests with news, finished ones first."""
        self.free(finished)
        touched = list(dict.fromkeys(s.owner for s in finished))
        for req in touched:
            if req.finished:
                req.metrics.finished_time = time.time()
                self._drop(req)
        return list(dict.fromkeys(touched + [s.owner for s, _ in plan.chunks]))
