"""The engine: joins the host-side scheduler and the jitted device step.

    add_request -> Scheduler.waiting
    step():  plan = Scheduler.schedule(...)          (host; may preempt)
             admissions: slots going live (swap-ins run first, in their own call)
             decode-only plan?  decode_window(...)    (W steps over the running rows, one sync)
             otherwise          run_step(...)         (one ragged step, admissions inside)
             read the outputs once; per request: append tokens, detokenize once, stop
             strings; release finished blocks
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import batch as batch_lib
from paged_jax import compile_cache
from paged_jax import engine_io as io
from paged_jax import engine_prefix as epc
from paged_jax import page_table as pt
from paged_jax import sampling as smp
from paged_jax.attention import default_backend
from paged_jax.config import CacheConfig
from paged_jax.kv_cache import init_kv_cache
from paged_jax.models import ModelConfig, Params, Tokenizer
from paged_jax.models.llama import prepare_params
from paged_jax.outputs import RequestMetrics, RequestOutput
from paged_jax.pool import init_pool
from paged_jax.prefix_cache import PrefixCache
from paged_jax.reservation import make_policy
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Plan, Scheduler, SchedulerConfig
from paged_jax.sequence import Request, Sequence, Status
from paged_jax.step import EngineState, StepConfig, decode_window, release_slots, run_step


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs (vLLM's names where they exist).

    Attributes:
      block_size: tokens per KV block.
      num_kv_blocks: blocks in the pool (block 0 is the reserved zero block).
      max_num_seqs: sequence slots, the most sequences in a step.
      max_num_batched_tokens: token budget of a step.
      max_model_len: longest prompt + output.
      preemption_mode: "recompute" or "swap".
      decode_window: decode steps per device call when only decodes run (1 = every step).
      backend: attention backend; None picks by platform.
      max_logprobs: the most top logprobs a request may ask for (static).
      seed: engine seed, used for requests without their own.
      reservation: KV reservation policy: "paged" (on demand, ours), or the baselines
        "static", "orca-max", "orca-pow2", "orca-oracle" (see reservation.py).
      enable_prefix_caching: reuse cached full blocks across requests (prefix_cache.py).
      admission: "fcfs", or "cache-aware" (longest cached prefix first; needs caching).
      max_skips: cache-aware admission passes a request over at most this many times.
    """

    block_size: int = 16
    num_kv_blocks: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    preemption_mode: str = "recompute"
    decode_window: int = 8
    backend: str | None = None
    max_logprobs: int = 0
    seed: int = 0
    reservation: str = "paged"
    enable_prefix_caching: bool = True
    admission: str = "fcfs"
    max_skips: int = 8

    def __post_init__(self) -> None:
        if self.admission not in ("fcfs", "cache-aware"):
            raise ValueError(f"admission must be 'fcfs' or 'cache-aware', got {self.admission!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {self.preemption_mode!r}")
        if self.max_model_len > self.max_num_batched_tokens * 1024:
            raise ValueError("max_model_len is implausibly large for the token budget")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "decode_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def cache(self) -> CacheConfig:
        return CacheConfig(num_blocks=self.num_kv_blocks, block_size=self.block_size,
                           max_seqs=self.max_num_seqs,
                           max_blocks_per_seq=-(-self.max_model_len // self.block_size))


def _to_host(out) -> types.SimpleNamespace:
    """One device -> host transfer of a step's outputs (numpy fields, same names)."""
    host = jax.device_get({f.name: getattr(out, f.name) for f in dataclasses.fields(out)})
    return types.SimpleNamespace(**host)


@dataclasses.dataclass
class StepStats:
    """One engine step, for experiments."""

    time: float
    duration: float
    kind: str  # "step", "window" or "idle"
    num_tokens: int
    num_steps: int
    running: int
    waiting: int
    blocks_used: int
    preempted: int
    device: float = 0.0  # seconds inside the jitted call + the one device -> host transfer


class Engine:
    """Continuous batching over the paged KV cache for one model."""

    def __init__(self, config: ModelConfig, params: Params, tokenizer: Tokenizer,
                 engine_config: EngineConfig):
        self.model_config, self.tokenizer = config, tokenizer
        self.params = prepare_params(params)  # the forward's fast layout, built once
        self.config = ec = engine_config
        dtype = jax.tree.leaves(params)[0].dtype
        cc = ec.cache
        self.state = EngineState(
            pool=init_pool(cc.num_blocks), table=pt.init_page_table(cc),
            cache=init_kv_cache(config.num_layers, config.num_kv_heads, cc.num_blocks,
                                cc.block_size, config.head_dim, dtype),
            sampling=smp.init_sampling_state(cc.max_seqs, config.vocab_size),
        )
        # Commit the state to the device now: jit keys on placement, so uncommitted initial
        # arrays would make the second step compile everything again.
        self.state = jax.device_put(self.state, jax.devices()[0])
        self.step_cfg = StepConfig(config, ec.backend or default_backend())
        self.scheduler = Scheduler(
            SchedulerConfig(ec.max_num_seqs, ec.max_num_batched_tokens, ec.block_size,
                            ec.admission, ec.max_skips),
            ec.max_num_seqs, make_policy(ec.reservation, ec.block_size, cc.usable_blocks,
                                         ec.max_model_len, ec.max_num_seqs))
        self.prefix = PrefixCache(ec.block_size) if ec.enable_prefix_caching else None
        self.scheduler.prefix = self.prefix
        self.requests: dict[str, Request] = {}
        self.num_free = cc.usable_blocks  # the device free stack (cached-free not included)
        self.slot_live = np.zeros(cc.max_seqs, bool)
        self.stats: list[StepStats] = []
        self.refused_steps = 0  # steps the device refused for lack of blocks (a planning bug)
        self.copy_hits: list[Sequence] = []  # prefix hits whose last cached block is copied
        self._orders = itertools.count()
        self._arrivals = itertools.count()
        self._preempted_now = 0
        self._device_time = 0.0
        self._programs = 0  # compiled step programs seen after the last step

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queues a request; raises ValueError when it can never be served."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, ids = io.prompt_ids(prompt, self.tokenizer)
        params = io.check_fits(params, ids, self.config, self.model_config)
        req = Request(request_id, text, ids, params,
                      arrival_time if arrival_time is not None else time.time(), order=-1)
        req.seqs = [Sequence(i, list(ids), len(ids), owner=req) for i in range(params.n)]
        req.metrics = RequestMetrics(arrival_time=req.arrival_time)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Drops a request wherever it is and frees everything it holds."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._release([s for s in req.seqs if s.slot >= 0])
        for s in req.seqs:
            s.status, s.finish_reason = Status.FINISHED, "abort"
        self.scheduler.finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step (or decode window); returns outputs of touched requests."""
        t0 = time.perf_counter()
        self._preempted_now = 0
        plan = self.scheduler.schedule(epc.free_total(self), self._preempt,
                                       lambda: next(self._orders))
        if not plan.chunks:
            self._record(t0, "idle", 0, 0)
            return []
        epc.make_room(self, plan)  # before swap-ins, which allocate from the free stack
        admits = self._admissions(plan)
        # A one-token prompt of an n > 1 request looks like a decode but must fork: ragged step.
        forks = any(s.owner.params.n > 1 and not s.owner.forked for s, _ in plan.chunks)
        if plan.decode_only and self.config.decode_window > 1 and not admits and not forks \
                and not self._can_admit():
            touched, steps = self._run_window(plan)
            self._record(t0, "window", steps * len(plan.chunks), steps)
        else:
            touched = self._run_step(plan, admits)
            self._record(t0, "step", plan.num_tokens, 1)
        self._watch_programs()
        outs = [self._output(r) for r in touched]
        for r in touched:
            if r.finished:
                self.requests.pop(r.request_id, None)
        return outs

    def _watch_programs(self) -> None:
        """After a step that compiled a new program, keeps the process under the kernel's
        limit on memory mappings (compile_cache.relieve_jit_mappings)."""
        programs = run_step._cache_size() + decode_window._cache_size()
        if programs != self._programs and compile_cache.relieve_jit_mappings():
            programs = 0
        self._programs = programs

    def _can_admit(self) -> bool:
        """Whether a waiting request could join now (then a window would delay it)."""
        sch = self.scheduler
        return bool(sch.waiting) and any(
            r.seqs[0].slot >= 0 or sch.free_slots for r in sch.waiting) and (
            sch.policy.admits(sch.waiting[0], sch.running, sch.waiting))  # baselines may refuse

    def _admissions(self, plan: Plan) -> list[batch_lib.Admit]:
        """Slots the plan brings live; swapped-out sequences are restored here, the others
        travel in the step's batch."""
        now, new = time.time(), set()
        for req in plan.admitted:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.time_in_queue = now - req.arrival_time
                new.add(id(req))
        admits = []
        for seq, _ in plan.chunks:
            if self.slot_live[seq.slot]:
                continue
            self.slot_live[seq.slot] = True
            if seq.swapped is not None:
                self.state, self.num_free = io.swap_in(self.state, seq)
                continue
            fresh = id(seq.owner) in new and seq.index == 0
            seed = self.config.seed * 1_000_003 + next(self._arrivals) if fresh else 0
            admits.append(batch_lib.Admit(seq, fresh, seed, epc.take_hit(self, seq)))
        return admits

    def _run_step(self, plan: Plan, admits: list[batch_lib.Admit]) -> list[Request]:
        batch, shape, forks, rows = batch_lib.build_step(
            plan, self.config, admits, list(self.model_config.eos_token_ids),
            self.model_config.vocab_size, self.step_cfg.backend)
        t0 = time.perf_counter()
        self.state, out = run_step(self.params, self.state, batch, cfg=self.step_cfg,
                                   shape=shape)
        out = _to_host(out)
        self._device_time = time.perf_counter() - t0
        self.num_free = int(out.num_free)
        if not out.ok:  # the estimate missed (should not happen): free memory, retry later
            self.refused_steps += 1
            self._preempt(max(self.scheduler.running, key=lambda r: r.order))
            return []
        for seq, n in plan.chunks:
            seq.num_computed += n
            seq.maybe_shared_last = False  # written: its last block is its own (forks below)
        epc.register(self, [(s, s.num_computed - n) for s, n in plan.chunks])
        self._forked(forks)
        finished = []
        for i, seq in enumerate(rows):
            if out.sampled[i] and io.emit(seq, out, i, 1, self.tokenizer)[1]:
                finished.append(seq)
        return self._touched(plan, finished)

    def _forked(self, forks: list[tuple[Sequence, list[Sequence]]]) -> None:
        """Host bookkeeping of the children a step created (their slots are live now)."""
        for parent, children in forks:
            shared = parent.num_computed % self.config.block_size != 0
            parent.maybe_shared_last = shared
            for c in children:
                c.num_computed, c.status = parent.num_computed, Status.RUNNING
                c.maybe_shared_last = shared
                self.slot_live[c.slot] = True
            parent.owner.forked = True

    def _run_window(self, plan: Plan) -> tuple[list[Request], int]:
        row_slots, tokens, shape, rows = batch_lib.build_window(plan, self.config,
                                                                self.step_cfg.backend)
        t0 = time.perf_counter()
        self.state, out = decode_window(self.params, self.state, jnp.asarray(row_slots),
                                        jnp.asarray(tokens), cfg=self.step_cfg,
                                        window=self.config.decode_window, shape=shape)
        out = _to_host(out)
        self._device_time = time.perf_counter() - t0
        self.num_free = int(out.num_free)
        before = [(seq, seq.num_computed) for seq in rows]
        finished = []
        for i, seq in enumerate(rows):
            used, done = io.emit(seq, out, i, int(out.valid[:, i].sum()), self.tokenizer)
            seq.num_computed += used
            seq.maybe_shared_last &= not used  # written: its last block is its own
            if done:
                finished.append(seq)
        epc.register(self, before)
        return self._touched(plan, finished), int(out.steps)

    # ---- outputs -------------------------------------------------------------------------
    def _touched(self, plan: Plan, finished: list[Sequence]) -> list[Request]:
        """Requests with news after a step: finished ones (released now) and those that ran."""
        touched = self._finish(finished)
        return touched + [r for r in self._reqs_of([s for s, _ in plan.chunks])
                          if r not in touched]

    def _finish(self, finished: list[Sequence]) -> list[Request]:
        self._release(finished)
        touched = []
        for seq in finished:
            seq.status = Status.FINISHED
            self.scheduler.free_slots.append(seq.slot)
            seq.slot = -1
            req = self._req_of(seq)
            if req.finished:
                req.metrics.finished_time = time.time()
                self.scheduler.finish(req)
            if req not in touched:
                touched.append(req)
        return touched

    def _release(self, seqs: list[Sequence]) -> None:
        mask = np.zeros(self.config.max_num_seqs, bool)
        for s in seqs:
            if s.slot >= 0 and self.slot_live[s.slot]:
                mask[s.slot] = True
                self.slot_live[s.slot] = False
        if mask.any():
            order = epc.release_order(self, [s for s in seqs if s.slot >= 0 and mask[s.slot]])
            pool, table = release_slots(self.state.pool, self.state.table, jnp.asarray(mask))
            self.state = dataclasses.replace(self.state, pool=pool, table=table)
            self.num_free = int(pool.num_free)
            epc.after_release(self, order)  # cached blocks stay, off the free stack

    def _preempt(self, req: Request) -> int:
        """Frees a running request's blocks (swapping them out first in swap mode)."""
        seqs = [s for s in req.seqs if s.status is Status.RUNNING]
        if self.config.preemption_mode == "swap":
            for s in seqs:
                s.swapped = io.swap_out(self.state, s)
        self._release(seqs)
        for s in seqs:
            s.status = Status.WAITING
            s.maybe_shared_last = False
            if s.swapped is None:
                s.num_computed = 0
        self.scheduler.requeue_front(req)
        self._preempted_now += 1
        return epc.free_total(self)

    @staticmethod
    def _req_of(seq: Sequence) -> Request:
        return seq.owner

    def _reqs_of(self, seqs: list[Sequence]) -> list[Request]:
        out = []
        for s in seqs:
            if s.owner not in out:
                out.append(s.owner)
        return out

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[s.completion() for s in req.seqs], finished=req.finished,
            metrics=req.metrics, num_cached_tokens=req.num_cached_tokens)

    def _record(self, t0: float, kind: str, tokens: int, steps: int) -> None:
        self.stats.append(StepStats(
            time=time.time(), duration=time.perf_counter() - t0, kind=kind, num_tokens=tokens,
            num_steps=steps, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks_used=self.config.num_kv_blocks - 1 - epc.free_total(self),  # cached-free: free
            preempted=self._preempted_now, device=self._device_time))
        self._device_time = 0.0
