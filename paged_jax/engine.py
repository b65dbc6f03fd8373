"""The engine loop: the scheduler's plan, run on the device, its outputs handed out.

    add_request  -> engine_input (parse, check)  -> Scheduler.waiting
    step():  plan = scheduler.schedule()            host; may preempt (through the KV manager)
             kv.evict / kv.bring_live               room for the plan, slots going live
             plan.window?  decode_window(...)       W decode steps over the running rows
             otherwise     run_step(...)            one ragged step, admissions inside
             one device -> host read; kv.after_step (free count, prefix registration);
             engine_output.emit per row (append, detokenize, stop strings, logprobs);
             finished sequences released through the KV manager

Who owns what: the scheduler owns the queues and sequence states, the KV manager every slot
and block (and the device pool, page tables and K/V), the engine the parameters, the
sampling state and the step programs. batch.py turns a plan into padded device arrays.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import types
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import batch as batch_lib
from paged_jax import compile_cache, kv_quant, parallel
from paged_jax import engine_input as inp
from paged_jax import engine_output as io
from paged_jax import sampling as smp
from paged_jax.attention import default_backend
from paged_jax.config import EngineConfig
from paged_jax.kv_manager import KVManager
from paged_jax.models import ModelConfig, Params
from paged_jax.models.llama import prepare_params
from paged_jax.outputs import RequestMetrics, RequestOutput
from paged_jax.reservation import make_policy
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Plan, Scheduler, SchedulerConfig
from paged_jax.sequence import Request, Sequence, Status
from paged_jax.step import EngineState, StepConfig, run_step
from paged_jax.window import decode_window

if TYPE_CHECKING:
    from paged_jax.models.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "StepStats"]


def _to_host(out) -> types.SimpleNamespace:
    """One device -> host transfer of a step's outputs (numpy fields, same names; nested
    dataclasses become namespaces too)."""
    def fields(x):
        return ({f.name: fields(getattr(x, f.name)) for f in dataclasses.fields(x)}
                if dataclasses.is_dataclass(x) else x)

    def spaces(x):
        return types.SimpleNamespace(**{k: spaces(v) for k, v in x.items()}) \
            if isinstance(x, dict) else x

    return spaces(jax.device_get(fields(out)))


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

    def __init__(self, config: ModelConfig, params: Params, tokenizer: Tokenizer | None,
                 engine_config: EngineConfig):
        self.model_config, self.tokenizer = config, tokenizer
        self.params = prepare_params(params)  # the forward's fast layout, built once
        self.config = ec = engine_config
        cc = ec.cache
        kv_dtype = kv_quant.storage_dtype(ec.kv_cache_dtype, jax.tree.leaves(params)[0].dtype)
        self.mesh, kv_heads = None, config.num_kv_heads
        if ec.tensor_parallel_size > 1:  # paged_jax/parallel.py
            if jax.process_count() > 1 and ec.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' reads blocks to one host; over "
                                 "several processes use 'recompute'")
            lay = parallel.layout(config, ec.tensor_parallel_size)
            self.mesh = parallel.make_mesh(lay.n, ec.first_device)
            self.params = parallel.shard_params(self.params, config, self.mesh)
            kv_heads = lay.kv_heads_total
            placement = (parallel.replicated(self.mesh), parallel.by_head(self.mesh))
        else:
            device = parallel.devices(1, ec.first_device)[0]
            self.params = jax.device_put(self.params, device)  # no-op on device 0
            placement = (device, device)
        self.kv = KVManager(cc, config.num_layers, kv_heads, config.head_dim,
                            kv_dtype, prefix_caching=ec.enable_prefix_caching,
                            swap=ec.preemption_mode == "swap", swap_space=ec.swap_space,
                            placement=placement)
        self.sampling = jax.device_put(smp.init_sampling_state(cc.max_seqs, config.vocab_size),
                                       placement[0])
        self.step_cfg = StepConfig(config, ec.backend or default_backend(), self.mesh)
        self.scheduler = Scheduler(
            SchedulerConfig(ec.max_num_seqs, ec.max_num_batched_tokens, ec.block_size,
                            ec.admission, ec.max_skips, ec.decode_window),
            self.kv, make_policy(ec.reservation, ec.block_size, cc.usable_blocks,
                                 ec.max_model_len, ec.max_num_seqs))
        self.requests: dict[str, Request] = {}
        self.stats: list[StepStats] = []
        self.refused_steps = 0  # steps the device refused for lack of blocks (a planning bug)
        self._arrivals = itertools.count()
        self._device_time = 0.0
        self._programs = 0  # compiled step programs seen after the last step

    @property
    def state(self) -> EngineState:
        """Everything on the device, as the step programs take it."""
        return EngineState(self.kv.pool, self.kv.table, self.kv.cache, self.sampling)

    @state.setter
    def state(self, st: EngineState) -> None:
        self.kv.pool, self.kv.table, self.kv.cache, self.sampling = (
            st.pool, st.table, st.cache, st.sampling)

    @property
    def prefix(self):
        """The prefix cache (None when prefix caching is off)."""
        return self.kv.prefix

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queues a request; raises ValueError when it can never be served."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, ids = inp.prompt_ids(prompt, self.tokenizer)
        params = inp.check_fits(params, ids, self.config, self.model_config)
        inp.check_tokenizer(params, self.tokenizer)
        req = Request(request_id, text, ids, params,
                      arrival_time if arrival_time is not None else time.time(), order=-1)
        req.banned_ids = inp.bad_word_ids(params, self.tokenizer)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
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
        self.kv.release(req.seqs)
        for s in req.seqs:
            s.status, s.finish_reason = Status.FINISHED, "abort"
        self.scheduler.finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- sequences the caller drives (beam search) -----------------------------------------
    def compute(self, seqs: list[Sequence], top_logprobs: int) -> list[list[tuple[int, float]]]:
        """Computes the pending tokens of sequences outside the scheduler, greedily.

        For callers that pick every next token themselves (beam search): runs ragged steps of
        at most max_num_batched_tokens tokens until each sequence's K/V is cached, and returns
        each one's top `top_logprobs` next tokens as (token id, logprob), best first.
        Sequences without a slot get one. Their blocks are not registered in the prefix cache.

        Raises:
          ValueError: a sequence has no pending token.
          RuntimeError: sequence slots or KV blocks ran out.
        """
        if any(s.num_pending == 0 for s in seqs):
            raise ValueError("every sequence passed to compute needs a pending token")
        if not self.kv.can_allocate(seqs):
            raise RuntimeError(f"{len(seqs)} sequences need free slots; raise max_num_seqs")
        self.kv.allocate(seqs)
        admits = [batch_lib.Admit(s, True, 0, hit) for s, hit in self.kv.bring_live(seqs)]
        flags = smp.SampleFlags(random=False, filters=False, penalties=False, logprobs=True,
                                num_top_logprobs=top_logprobs, bias=False)
        top: dict[int, list[tuple[int, float]]] = {}
        while pending := [s for s in seqs if s.num_pending]:
            budget, chunks = self.config.max_num_batched_tokens, []
            for s in pending:
                if (n := min(s.num_pending, budget)) > 0:
                    chunks.append((s, n))
                    budget -= n
            self.kv.evict(chunks, decode_only=False)
            batch, shape, _, rows = batch_lib.build_step(
                Plan(chunks=chunks), self.config, admits, list(self.model_config.eos_token_ids),
                self.model_config.vocab_size, self.step_cfg.backend)
            admits = []
            self.state, out = run_step(self.params, self.state, batch, cfg=self.step_cfg,
                                       shape=dataclasses.replace(shape, flags=flags))
            out = _to_host(out)
            self._watch_programs()
            self.kv.after_step(int(out.num_free), [])
            if not out.ok:
                raise RuntimeError("the KV cache cannot hold these sequences")
            for seq, n in chunks:
                seq.num_computed += n
                seq.maybe_shared_last = False  # written: its last block is its own
            for i, seq in enumerate(rows):  # rows: the chunks reordered, long ones first
                if out.sampled[i]:
                    top[id(seq)] = list(zip(out.top_ids[i].tolist(),
                                            out.top_logprobs[i].tolist(), strict=True))
        return [top[id(s)] for s in seqs]

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children share all of `parent`'s blocks (copy-on-write); each gets its own slot.

        Their device sampling rows are not written (they keep the slot's last user's): fine
        for `compute`, which samples greedily from raw logits, without bias or penalties.
        """
        self.kv.fork(parent, children)

    def release(self, seqs: list[Sequence]) -> None:
        """Frees the blocks and slots of sequences outside the scheduler."""
        self.kv.release(seqs)
        for s in seqs:
            self.kv.free_slot(s)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step (or decode window); returns outputs of touched requests."""
        t0, preempted = time.perf_counter(), self.scheduler.num_preempted
        plan = self.scheduler.schedule()
        if not plan.chunks:
            self._record(t0, "idle", 0, 0, preempted)
            return []
        self.kv.evict(plan.chunks, plan.decode_only)  # before swap-ins: they take blocks
        admits = self._admissions(plan)
        if plan.window:
            touched, steps = self._run_window(plan)
            self._record(t0, "window", steps * len(plan.chunks), steps, preempted)
        else:
            touched = self._run_step(plan, admits)
            self._record(t0, "step", plan.num_tokens, 1, preempted)
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

    def _admissions(self, plan: Plan) -> list[batch_lib.Admit]:
        """Slots the plan brings live (swap-ins are restored by the KV manager; the others
        travel in the step's batch), with first-scheduled times and sampling seeds."""
        now, new = time.time(), set()
        for req in plan.admitted:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.time_in_queue = now - req.arrival_time
                new.add(id(req))
        admits = []
        for seq, hit in self.kv.bring_live([s for s, _ in plan.chunks]):
            fresh = id(seq.owner) in new and seq.index == 0
            seed = self.config.seed * 1_000_003 + next(self._arrivals) if fresh else 0
            admits.append(batch_lib.Admit(seq, fresh, seed, hit))
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
        if not out.ok:  # the estimate missed (should not happen): free memory, retry later
            self.kv.after_step(int(out.num_free), [])
            self.refused_steps += 1
            self.scheduler.preempt(max(self.scheduler.running, key=lambda r: r.order))
            return []
        new = {id(s): n for s, n in plan.chunks}  # rows: long chunks first, then children
        for i, seq in enumerate(rows[:len(new)] if shape.hidden else []):
            if seq.wants_hidden(new[id(seq)]):
                seq.owner.hidden_states = np.array(out.hidden[i])
        for seq, n in plan.chunks:
            seq.num_computed += n
            seq.maybe_shared_last = False  # written: its last block is its own (forks below)
        self.kv.after_step(int(out.num_free), [(s, s.num_computed - n) for s, n in plan.chunks])
        if shape.prompt_top is not None:
            io.prompt_logprobs(rows, plan.chunks, out.prompt, self.tokenizer)
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
                self.kv.mark_live(c)
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
        before = [(seq, seq.num_computed) for seq in rows]
        finished = []
        for i, seq in enumerate(rows):
            used, done = io.emit(seq, out, i, int(out.valid[:, i].sum()), self.tokenizer)
            seq.num_computed += used
            seq.maybe_shared_last &= not used  # written: its last block is its own
            if done:
                finished.append(seq)
        self.kv.after_step(int(out.num_free), before)
        return self._touched(plan, finished), int(out.steps)

    # ---- outputs -------------------------------------------------------------------------
    def _touched(self, plan: Plan, finished: list[Sequence]) -> list[Request]:
        """Requests with news after a step: finished ones (released now) and those that ran."""
        self.kv.release(finished)
        touched = []
        for seq in finished:
            seq.status = Status.FINISHED
            self.kv.free_slot(seq)
            req = seq.owner
            if req.finished:
                req.metrics.finished_time = time.time()
                self.scheduler.finish(req)
            if req not in touched:
                touched.append(req)
        for s, _ in plan.chunks:
            if s.owner not in touched:
                touched.append(s.owner)
        return touched

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[s.completion() for s in req.seqs], finished=req.finished,
            metrics=req.metrics, num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            hidden_states=req.hidden_states)

    def _record(self, t0: float, kind: str, tokens: int, steps: int, preempted: int) -> None:
        self.stats.append(StepStats(
            time=time.time(), duration=time.perf_counter() - t0, kind=kind, num_tokens=tokens,
            num_steps=steps, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), blocks_used=self.kv.blocks_used(),
            preempted=self.scheduler.num_preempted - preempted, device=self._device_time))
        self._device_time = 0.0
