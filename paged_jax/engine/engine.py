"""The engine loop: one step = schedule -> send -> read -> update.

    add_request  -> engine/input.py (parse, check)  -> Scheduler.waiting
    step():  plan = scheduler.schedule()             host: who runs, admissions, queued ops
             p = runner.dispatch(plan)               one jitted call, queued on the device
             scheduler.sent(plan)                    its tokens count as computed
             out = runner.collect(p)                 its one device -> host read
             scheduler.update_from_output(plan, out) the one place results land
             -> a RequestOutput per request with news

Async scheduling (EngineConfig.async_scheduling, vLLM's name) reads each step one step late:

    step():  plan n+1 = schedule()      while the device runs step n (its sampled tokens are
             dispatch(plan n+1)         placeholders; step n+1 takes them from the device)
             collect(step n), update    while the device runs step n+1
             -> the outputs of step n

A sequence that step n finishes (stop token, stop string, abort) may compute one more token in
step n+1, which is discarded. What needs exact counts waits for the step in flight first: a
plan that would preempt, an n > 1 request forking, an engine going idle; and while a
request with structured outputs or a beam search runs, no step is planned ahead at all (its
next mask, or next beams, follow from what the step in flight returns).

Who owns what: the scheduler the queues, sequence states and a step's results; the KV
manager every host fact of the KV cache (slots, free counts, prefix cache, queued ops); the
runner the parameters, the device state and the compiled programs. An engine that runs out
of work applies the ops it still owes (releases of the last finished sequences) at once.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING

from paged_jax.engine import beam_search as beams
from paged_jax.engine import input as inp
from paged_jax.engine import warmup
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.constraints import Constraints
from paged_jax.engine.kv_manager import KVManager
from paged_jax.engine.plan import Plan
from paged_jax.engine.policy import Policy
from paged_jax.engine.runner import Pending, Runner, StepOutput
from paged_jax.engine.scheduler import Scheduler, SchedulerConfig
from paged_jax.engine.sequence import Request
from paged_jax.engine.speculative import check_draft
from paged_jax.engine.state import Sleeping
from paged_jax.lora.request import LoRARequest
from paged_jax.models import ModelConfig, Params
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from paged_jax.models.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "StepStats"]

RECENT_STEPS = 256
"""Steps `Engine.stats` keeps (latency estimates read the recent ones); a long-running
server holds no more. Experiments that want every step set `Engine.recorder` to a list."""


@dataclasses.dataclass
class StepStats:
    """One engine step, for experiments."""

    time: float
    duration: float
    kind: str  # "step", "window", "verify", "ops" or "idle"
    num_tokens: int
    num_steps: int
    running: int
    waiting: int
    blocks_used: int
    preempted: int
    device: float = 0.0  # seconds from sending the call to its read
    wait: float = 0.0  # seconds the host was blocked reading it (the device's share)


class Engine:
    """Continuous batching over the paged KV cache for one model.

    Args:
      config: the model's config.
      params: its parameters.
      tokenizer: None runs on token ids only (vLLM's skip_tokenizer_init).
      engine_config: the engine's knobs.
      policy: admission policy (default: on-demand paging; the paper's baselines are in
        paged_jax/study/reservation.py).
      check: after every step, assert the KV manager's host mirror equals the device
        (a device -> host read per step: for tests).
      draft: the draft model (config, parameters) of speculative_config method
        "draft_model" (engine/draft.py); it must share the model's vocabulary.
      forward: a user's own model's forward (paged_jax/nn: `split_model`); None: ours.
    """

    def __init__(self, config: ModelConfig, params: Params, tokenizer: Tokenizer | None,
                 engine_config: EngineConfig, policy: Policy | None = None,
                 check: bool = False, draft: tuple[ModelConfig, Params] | None = None,
                 forward=None):
        self.model_config, self.tokenizer, self.config = config, tokenizer, engine_config
        ec, self.check = engine_config, check
        check_draft(ec, config, draft)
        self.runner = Runner(config, params, ec, draft, forward)
        self.kv = KVManager(ec.cache, self.runner.block_bytes, self.runner,
                            prefix_caching=ec.enable_prefix_caching,
                            swap=ec.preemption_mode == "swap", swap_space=ec.swap_space)
        self.scheduler = Scheduler(
            SchedulerConfig(ec.max_num_seqs, ec.max_num_batched_tokens, ec.block_size,
                            ec.admission, ec.max_skips, ec.decode_window, ec.seed,
                            async_scheduling=ec.async_scheduling,
                            long_prefill_token_threshold=ec.long_prefill_token_threshold,
                            speculative=ec.speculative,
                            max_loras=ec.lora.max_loras if ec.lora else 0),
            self.kv, policy, tokenizer)
        self.requests: dict[str, Request] = {}
        self._in_flight: tuple[Plan, Pending] | None = None  # async: sent, not read yet
        self.stats: collections.deque[StepStats] = collections.deque(maxlen=RECENT_STEPS)
        self.recorder: list[StepStats] | None = None
        self.constraints = Constraints(tokenizer, config.vocab_size)  # structured outputs
        self.asleep = None  # sleep mode's host copies while asleep (engine/sleep.py)

    def warm_up(self, level: str = "auto", progress=None) -> warmup.Report:
        """Builds the programs this configuration meets at `level` ("none", "auto",
        "full": engine/warmup.py) before any request runs; returns what it built.
        `progress(phase, done, total)` is called after each program."""
        return warmup.run(self.runner, level, list(self.model_config.eos_token_ids),
                          self.model_config.vocab_size, progress)

    def check_warm_up(self, level: str) -> int:
        """Refuses (ValueError, naming why) a warm-up `level` this engine cannot do: an
        unknown level, or more programs than the memory-mapping limit holds; else returns
        how many programs it would build."""
        return len(warmup.missing(self.runner, level, list(self.model_config.eos_token_ids),
                                  self.model_config.vocab_size)[0])

    @property
    def state(self):
        """Everything on the device (EngineState), as the step programs take it."""
        return self.runner.state

    @property
    def params(self) -> Params:
        return self.runner.params

    @property
    def prefix(self):
        """The prefix cache (None when prefix caching is off)."""
        return self.kv.prefix

    @property
    def refused_steps(self) -> int:
        return self.scheduler.refused_steps

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
        arrival_time: float | None = None, lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queues a request (with `lora_request`, under that adapter: paged_jax/lora); raises
        ValueError when it can never be served."""
        self._check_new(request_id)
        req = inp.make_request(request_id, prompt, params or SamplingParams(), self.tokenizer,
                               self.config, self.model_config,
                               arrival_time if arrival_time is not None else time.time())
        if req.params.structured_outputs is not None:
            self.constraints.attach(req)  # ValueError when it is invalid
        return self._queue(req, lora_request)

    def add_beam_request(
        self, request_id: str, prompt: str | list[int] | dict, params: BeamSearchParams,
        arrival_time: float | None = None, lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queues a beam search (engine/beam_search.py), scheduled beside other requests; its
        outputs are its best beams, best first (`beam_search.output` gives vLLM's form)."""
        self._check_new(request_id)
        req = beams.make_request(request_id, prompt, params, self.tokenizer, self.config,
                                 self.model_config,
                                 arrival_time if arrival_time is not None else time.time())
        return self._queue(req, lora_request)

    def _check_new(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        Sleeping.check(self.asleep)

    def _queue(self, req: Request, lora_request: LoRARequest | None) -> Request:
        req.lora = self.check_adapter(lora_request)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def check_adapter(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """`lora_request` once its adapter is read (a bad one fails here, not in a step)."""
        if lora_request is not None:
            if self.config.lora is None:
                raise ValueError("lora_request needs an engine built with enable_lora=True")
            self.runner.adapters.check(lora_request)
        return lora_request

    def _place_adapters(self, seqs) -> None:
        """The sequences' adapters into device slots (lora/manager.py), before a step runs
        them; the runner's params re-read when a slot or a row's adapter changed."""
        if self.config.lora is None:
            return  # no adapters: nothing to place (and no list built every step)
        if self.runner.adapters.place([(s.slot, s.owner.lora) for s in seqs if s.slot >= 0]):
            self.runner.params = {**self.runner.params, "lora": self.runner.adapters.device_tree()}

    def narrow_outputs(self, request_id: str, logprobs: int | None,
                       return_hidden_states: bool) -> None:
        """From its next step on, a running request reports only `logprobs` and the hidden
        state if asked (a router's probe asks for more to decide, and nothing of it once
        decided): its steps then run without those outputs, on the device and the host. Its
        tokens do not change (they report, never steer); a finished or unknown request:
        nothing to do."""
        req = self.requests.get(request_id)
        if req is not None:
            req.params = dataclasses.replace(req.params, logprobs=logprobs,
                                             return_hidden_states=return_hidden_states)

    def abort(self, request_id: str) -> None:
        """Drops a request wherever it is and frees everything it holds."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req)
            self.settle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def step_to_wait_for(self) -> object | None:
        """The device outputs of the step in flight (async scheduling) when a request arriving
        before it ends could join the next step (a free slot, nobody waiting); else None.

        A server waits for these to be ready before planning: planned at once, the next step
        would already be queued behind this one when a request arrives, and the request
        would wait for both (a whole step more to its first token than sync scheduling).
        """
        if self._in_flight is None or self.scheduler.waiting:
            return None
        if len(self.scheduler.running) >= self.config.max_num_seqs:
            return None
        return self._in_flight[1].out

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step (or decode window); returns outputs of touched requests
        (with async scheduling: sends the next step, then reads the one before)."""
        t0, preempted = time.perf_counter(), self.scheduler.num_preempted
        if self.config.async_scheduling and not self.scheduler.host_picks_running():
            plan, out, touched = self._step_ahead()
        else:  # a row the host picks for needs the last step's output first
            touched = self._drain()
            plan = self.scheduler.schedule()
            out, news = self._read(plan, self._send(plan))
            touched = list(dict.fromkeys(touched + news))
        self.settle()
        self._record(t0, plan, out, preempted)
        return self._outputs(touched)

    def _send(self, plan: Plan) -> Pending | None:
        if plan.empty:
            self.kv.forget(plan.sent)
            return None
        self._place_adapters(s for seq, _ in plan.chunks for s in seq.owner.seqs)
        pending = self.runner.dispatch(plan)
        self.scheduler.sent(plan, [c for _, cs in pending.call.forks for c in cs])
        return pending

    def _read(self, plan: Plan, pending: Pending | None) -> tuple[StepOutput | None, list]:
        out = None if pending is None else self.runner.collect(pending)
        return out, self.scheduler.update_from_output(plan, out)

    def _step_ahead(self) -> tuple[Plan, StepOutput | None, list[Request]]:
        """Async scheduling: plans and sends a step, then reads the one in flight (the
        outputs returned are that one's)."""
        touched = []
        plan = self.scheduler.schedule(can_preempt=self._in_flight is None)
        if plan is None:  # it would preempt: read the step in flight, plan on exact counts
            touched += self._drain()
            plan = self.scheduler.schedule()
        pending = self._send(plan)
        before, self._in_flight = self._in_flight, (plan, pending) if pending else None
        out = None
        if before is not None:
            plan, (out, news) = before[0], self._read(*before)
            if not out.ok and self._in_flight is not None:
                raise RuntimeError("a step was refused while the next was in flight: the "
                                   "async plan counted blocks wrongly (a bug)")
            touched += news
        if self._in_flight is not None and (pending.call.forks or not self.scheduler.has_work()):
            touched += self._drain()  # children exist only once read; idle: nothing to hide
        return plan, out, touched

    def drain(self) -> list[RequestOutput]:
        """Reads the step in flight, if any (async scheduling), and settles: afterwards the
        host's counts are exact (`KVManager.check` may run). Returns its outputs."""
        touched = self._drain()
        self.settle()
        return self._outputs(touched)

    def _drain(self) -> list[Request]:
        """Reads the step in flight, if any (async scheduling)."""
        if self._in_flight is None:
            return []
        before, self._in_flight = self._in_flight, None
        return self._read(*before)[1]

    def settle(self) -> None:
        """An idle engine applies the allocator ops it still owes (an ops-only call), so its
        pool is exact between bursts; a busy one sends them with its next step."""
        if self._in_flight is not None:
            return  # the next step() reads it (and settles then)
        if not self.scheduler.has_work() and self.kv.has_ops():
            ops, sent = self.kv.take_ops()
            self.kv.update_from_output([], self.runner.run(Plan(ops=ops, sent=sent)), sent)
        if self.check:
            self.kv.check()

    # ---- outputs -------------------------------------------------------------------------
    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """Outputs of the touched requests still in the engine (an aborted one reports no
        more, though a step in flight computed for it)."""
        return [self._output(r) for r in touched if self.requests.get(r.request_id) is r]

    def _output(self, req: Request) -> RequestOutput:
        if req.finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[s.completion() for s in req.seqs] if req.beam is None
            else beams.completions(req, self.tokenizer), finished=req.finished,
            metrics=req.metrics, num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            hidden_states=req.hidden_states, num_preemptions=req.num_preemptions)

    def _record(self, t0: float, plan: Plan, out: StepOutput | None, preempted: int) -> None:
        kind = "idle" if out is None else out.kind
        steps = out.steps if out is not None and out.ok else 0
        tokens = plan.num_tokens if kind in ("step", "verify") else steps * len(plan.chunks)
        st = StepStats(
            time=time.time(), duration=time.perf_counter() - t0, kind=kind,
            num_tokens=tokens if steps else 0, num_steps=steps,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            blocks_used=self.kv.blocks_used(),
            preempted=self.scheduler.num_preempted - preempted,
            device=out.seconds if out is not None else 0.0,
            wait=out.wait if out is not None else 0.0)
        self.stats.append(st)
        if self.recorder is not None:
            self.recorder.append(st)
