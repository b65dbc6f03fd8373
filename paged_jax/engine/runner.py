"""The device side of an engine (vLLM's model runner): parameters, the device state, and one
jitted call per step with one device -> host read of its output.

    dispatch(plan) -> batch.build(plan)                     host: pad into a Call
                      run_step | decode_window | run_verify | run_ops
                                                              one jitted call, state donated
                   -> Pending                                 the call's output, on the device
    collect(pending) -> output.wire                           the one read (waits for the call)
                   -> StepOutput                              numpy, [W, R] per-row fields
    run(plan) = collect(dispatch(plan))

Dispatch returns as soon as the call is queued (JAX dispatches asynchronously), so the host
can plan the next step while this one runs (async scheduling, engine/engine.py).

The state (pool, page tables, K/V, sampling) lives only here; the KV manager owns every
host fact about it and reaches the device only to swap a sequence out or to `check` itself.
Swap-ins (swap preemption mode only) are their own calls after the plan's ops.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import compile_cache
from paged_jax.cache import kv_cache as kv_lib
from paged_jax.cache import kv_quant
from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.cache.kv_cache import KVCache
from paged_jax.engine import batch as batch_lib
from paged_jax.engine import draft as draft_lib
from paged_jax.engine import wire
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.plan import Plan
from paged_jax.engine.programs import PROGRAMS, layout_of
from paged_jax.engine.sequence import Sequence
from paged_jax.engine.settle import run_ops
from paged_jax.engine.state import EngineState, StepConfig
from paged_jax.engine.step import run_step
from paged_jax.engine.verify import run_verify
from paged_jax.engine.weights import (  # noqa: F401 (matmul_backend: re-exported)
    choose_matmul,
    matmul_backend,
    params_dtype,
    refuse_for_own_model,
    shared_weights,
)
from paged_jax.engine.window import decode_window
from paged_jax.lora.manager import AdapterManager
from paged_jax.models import ModelConfig, Params, parallel
from paged_jax.models.attention import default_backend
from paged_jax.models.llama import pack_params, prepare_params, quantize_params
from paged_jax.sample import sampler as smp
from paged_jax.sizes import next_pow2
from paged_jax.types import Array, Bool, Int


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per token of a step: the next prompt token's logprob and rank, and the top J'."""

    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass
class StepOutput:
    """One call's results on the host. Per-row fields have a leading W axis (1 for a step,
    the window's length for a decode window): row r's i-th token is tokens[i, r] where
    valid[i, r].

    Attributes:
      kind: "step", "window", "verify" (speculative decoding: W = K + 1) or "ops".
      rows: the sequence of each row (batch order).
      forks: (parent, children) the step forked (n > 1 requests whose prompt completed).
      ok: False when the pool could not cover a step (nothing ran but ops and admissions). A
        window that runs out of blocks stops early and keeps what it computed: ok.
      num_free: the device free stack's size after the call.
      steps: decode steps the call ran (1 for a step, 0 for ops).
      full_blocks: [R, G * F] blocks each row filled in the call, per KV cache group
        (prefix caching; else [R, 0]).
      refcount: [N] refcounts after the call (prefix caching; else None).
      prompt: per-token prompt logprobs ([T] arrays; None unless a row asked).
      hidden: [R, E] last hidden state per row (None unless asked).
      drafted: [R] the drafts each row verified in a draft model's verify call (it may
        stop a row before k: draft.propose); None otherwise.
      seconds: wall time from sending the call to its read.
      wait: the part of it the host spent blocked in the read (the rest it had for itself).
    """

    kind: str
    rows: list[Sequence]
    forks: list[tuple[Sequence, list[Sequence]]]
    ok: bool
    num_free: int
    steps: int
    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    valid: np.ndarray
    finished: np.ndarray
    reason: np.ndarray
    full_blocks: np.ndarray
    refcount: np.ndarray | None
    prompt: PromptLogprobs | None = None
    hidden: np.ndarray | None = None
    drafted: np.ndarray | None = None  # [R] a draft model's drafts per row (verify)
    seconds: float = 0.0
    wait: float = 0.0


@dataclasses.dataclass
class Pending:
    """A call sent to the device whose output has not been read."""

    call: batch_lib.Call
    out: object  # the call's output pytree (device arrays, or a dict for ops)
    t0: float


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _restore(
    pool: pool_lib.BlockPool, table: pt.PageTable, cache: KVCache,
    slot: Int[Array, ""], n_tokens: Int[Array, ""], where: Int[Array, "M"], *parts: Array,
) -> tuple[pool_lib.BlockPool, pt.PageTable, KVCache, Bool[Array, ""]]:
    """Swap-in on the device: the slot gets fresh blocks for its tokens (in each group, those
    its window keeps), and `parts` (K, V [B, H, M, K, D], and scales [B, H, M, K, Z] for a
    quantized cache) are written back; part m is the block at flat (group, column) index
    where[m] of the slot's rows (out of range: padding)."""
    num_new = jnp.zeros_like(table.seq_lens).at[slot].set(n_tokens)
    table = pt.add_sequence(table, slot)
    pool, table, _, ok = pt.reserve_tokens(pool, table, num_new, skip_slid=True)
    blocks = table.block_tables[:, slot].reshape(-1).at[where].get(mode="fill", fill_value=0)
    return pool, table, kv_lib.write_blocks(cache, blocks, *parts), ok


class Runner:
    """Parameters and device state of one engine, and the calls that change them.

    Args:
      model: the model's config.
      params: its parameters (checkpoint form; laid out here for the forward, and sharded
        over a mesh under tensor parallelism: models/parallel.py).
      ec: the engine config.
      draft: speculative decoding's draft model (config, parameters): its K/V pages sit
        beside the target's under the same block ids (engine/draft.py).
      forward: a user's own model's forward (paged_jax/nn/engine_forward.py), with
        models.llama.forward's signature; its params run as given. None: our decoder.
    """

    def __init__(self, model: ModelConfig, params: Params, ec: EngineConfig,
                 draft: tuple[ModelConfig, Params] | None = None, forward=None):
        self.model, self.config, self._held = model, ec, []
        if forward is not None:
            refuse_for_own_model(ec, draft)
        dtype = params_dtype(params)
        kv_dtype = kv_quant.storage_dtype(ec.kv_cache_dtype, dtype)
        self.matmul, self.weights = choose_matmul(ec, dtype, forward is not None)
        self.mesh, kv_heads = None, model.num_kv_heads
        if ec.tensor_parallel_size > 1:
            params = prepare_params(params)  # the forward's fast layout, built once
            if jax.process_count() > 1 and ec.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' reads blocks to one host; over "
                                 "several processes use 'recompute'")
            lay = parallel.layout(model, ec.tensor_parallel_size)
            self.mesh = parallel.make_mesh(lay.n, ec.first_device)
            params, kv_heads = parallel.shard_params(params, model, self.mesh), lay.kv_heads_total
            if self.matmul == "cpu":
                params = parallel.pack_shards(params, self.mesh, self.weights)
            books, pages = parallel.replicated(self.mesh), parallel.by_head(self.mesh)
        else:
            books = pages = parallel.devices(1, ec.first_device)[0]
            params = (self._lay_out(params, books) if forward is None
                      else jax.device_put(params, books))
        self.params, cc = params, ec.cache
        if ec.lora is not None:  # adapter slots, placed per step by the engine (lora/manager.py)
            self.adapters = AdapterManager(model, ec.lora, cc.max_seqs, books, dtype)
            self.params = {**params, "lora": self.adapters.device_tree()}
        groups = ec.kv_groups  # sliding-window layers' own page tables (cache/groups.py)
        self.block_bytes = kv_lib.kv_cache_bytes(groups.num_buffers if groups else model.num_layers,
                                                 kv_heads, cc.block_size, model.head_dim,
                                                 kv_dtype)
        # Committed to their devices now: jit keys on placement, so uncommitted initial
        # arrays would make the second call compile everything again.
        pool, table, sampling = jax.device_put((
            pool_lib.init_pool(cc.num_blocks), pt.init_page_table(cc),
            smp.init_sampling_state(cc.max_seqs, model.vocab_size)), books)
        cache = jax.device_put(kv_lib.init_kv_cache(
            model.num_layers, kv_heads, cc.num_blocks, cc.block_size, model.head_dim,
            kv_dtype, groups), pages)
        self.draft_params, draft_cache = None, None
        if draft is not None:  # speculative decoding's draft model (engine/draft.py)
            dm, dparams = draft
            self.draft_params = self._lay_out(dparams, books, ec.speculative.quantization)
            draft_cache = jax.device_put(draft_lib.init_cache(dm, cc, kv_dtype, groups), pages)
        self.state = EngineState(pool, table, cache, sampling, draft_cache)
        self.cfg = StepConfig(model, ec.backend or default_backend(), self.mesh,
                              ec.enable_prefix_caching, draft and draft[0],
                              ec.speculative.draft_stop_probability if draft else 0.0,
                              forward)
        self._eos = list(model.eos_token_ids)
        self.programs = PROGRAMS  # every program an engine calls (engine/programs.py)
        self._programs = 0  # programs built as of the last call
        # what the programs are specialised on beyond the call's batch (fixed for this runner)
        self.layout = layout_of((self.params, self.state, self.draft_params))

    def _lay_out(self, params: Params, device, quantization: str | None = None) -> Params:
        """One device's parameters in the forward's layout (prepare_params) and the matmuls'
        (packed for the C++ kernel, `quantization` (default the engine's)), on `device`;
        shared with other runners built from the same arrays (`shared_weights`)."""
        quantization = quantization or self.config.quantization

        def build() -> Params:
            laid = prepare_params(params)
            if self.matmul == "cpu":
                laid = pack_params(laid, quantization or self.weights)
            elif quantization:
                laid = quantize_params(laid, quantization)
            return jax.device_put(laid, device)  # no-op on device 0

        held = shared_weights(params, (self.matmul, quantization, str(device)), build)
        self._held.append(held)
        return held.params

    def run(self, plan: Plan) -> StepOutput:
        """The plan's one jitted call (after its swap-ins, if any), and its one read."""
        return self.collect(self.dispatch(plan))

    def collect(self, pending: Pending) -> StepOutput:
        """The call's one device -> host read (waits for the call to finish)."""
        t0 = time.perf_counter()
        out = pending.out
        read = (jax.device_get(out) if pending.call.kind == "ops"
                else wire.unpack(np.asarray(out.wire), out))
        t1 = time.perf_counter()
        host = self._to_host(pending.call, read)
        host.seconds, host.wait = t1 - pending.t0, t1 - t0
        return host

    def dispatch(self, plan: Plan) -> Pending:
        """Sends the plan's one jitted call (after its swap-ins, if any); does not wait."""
        call = batch_lib.build(plan, self.config, self._eos, self.model.vocab_size,
                               self.cfg.backend)
        if plan.restores:
            self._swap_in(call, plan.restores)
        t0 = time.perf_counter()
        if call.kind == "ops":
            out = self._ops(call)
        else:
            fn, args, keyed, static = self.program_args(call)
            self.state, out = self.programs.call(fn, self.layout, args, keyed, static)
        self._watch_programs()
        return Pending(call, out, t0)

    def program_args(self, call: batch_lib.Call) -> tuple:
        """(jitted function, its arguments, those whose shapes vary, its static arguments)
        of a call: what `programs` keys and compiles (engine/warmup.py builds them ahead)."""
        if call.kind == "ops":
            st = self.state
            return run_ops, (st.pool, st.table, call.ops), (call.ops,), {}
        if call.kind == "step":
            args = (self.params, self.state, call.batch, self.draft_params)
            return run_step, args, (call.batch,), \
                dict(cfg=self.cfg, shape=call.shape)
        if call.kind == "verify":
            dparams = None if call.draft is None else self.draft_params
            args = (self.params, self.state, call.batch, dparams, call.draft)
            return run_verify, args, (call.batch, call.draft, dparams is None), \
                dict(cfg=self.cfg, shape=call.shape)
        args = (self.params, self.state, *call.window, call.ops)
        return decode_window, args, (call.window, call.ops), \
            dict(cfg=self.cfg, window=self.config.decode_window, shape=call.shape)

    def _ops(self, call: batch_lib.Call) -> dict[str, jax.Array]:
        # a step's ops too, ahead of its swap-ins (_swap_in): as an ops-only call
        fn, args, keyed, static = self.program_args(batch_lib.Call("ops", [], call.ops))
        pool, table, num_free, refcount = self.programs.call(fn, self.layout, args, keyed,
                                                             static)
        self.state = dataclasses.replace(self.state, pool=pool, table=table)
        return dict(num_free=num_free, refcount=refcount)

    def _to_host(self, call: batch_lib.Call, out: dict) -> StepOutput:
        """The device output (its fields, read) as a StepOutput; a step gets a W axis of 1."""
        r = len(call.rows)
        refcount = out["refcount"] if self.cfg.prefix_caching else None
        if call.kind == "ops":
            z, z1 = np.zeros((0, 0), np.int32), np.zeros((0,), np.int32)
            return StepOutput("ops", [], [], True, int(out["num_free"]), 0, z, z, z, z, z,
                              z1, z1, z, refcount)
        step = call.kind == "step"  # else a window or a verify step: a W axis already
        w = (lambda a: a[None, :r]) if step else (lambda a: a[:, :r])
        return StepOutput(
            call.kind, call.rows, call.forks, bool(out["ok"]) or call.kind == "window",
            int(out["num_free"]),
            1 if step else int(out["steps"]), w(out["tokens"]), w(out["logprobs"]),
            w(out["top_ids"]), w(out["top_logprobs"]), w(out["sampled" if step else "valid"]),
            out["finished"][:r], out["reason"][:r], out["full_blocks"][:r], refcount,
            prompt=(PromptLogprobs(**out["prompt"])
                    if step and call.shape.prompt_top is not None else None),
            hidden=out["hidden"][:r] if step and call.shape.hidden else None,
            drafted=out["drafted"][:r] if out.get("drafted") is not None else None)

    def _swap_in(self, call: batch_lib.Call, restores: list[tuple]) -> None:
        """Applies the call's ops first (its releases may free the blocks a swap-in takes),
        then restores each swapped-out sequence; the call itself then carries no ops."""
        self._ops(call)
        for slot, n_tokens, (where, *parts) in restores:
            # Padded to a power of two (one program per size), padding written nowhere.
            m = next_pow2(parts[0].shape[2])
            grow = m - parts[0].shape[2]
            padded = [jnp.asarray(np.pad(x, [(0, 0), (0, 0), (0, grow)]
                                         + [(0, 0)] * (x.ndim - 3))) for x in parts]
            where = np.pad(where, (0, grow), constant_values=self.state.table.block_tables.size)
            st = self.state
            pool, table, cache, ok = _restore(st.pool, st.table, st.cache, jnp.asarray(slot),
                                              jnp.asarray(n_tokens), jnp.asarray(where),
                                              *padded)
            self.state = dataclasses.replace(st, pool=pool, table=table, cache=cache)
            if not ok:  # the scheduler counted the restore (blocks_needed): a planning bug
                raise RuntimeError(f"swap-in of slot {slot} found too few free blocks")
        no_ops = batch_lib.build_ops(None, self.config)
        call.ops = no_ops
        if call.batch is not None:
            call.batch = dataclasses.replace(call.batch, ops=no_ops)

    # ---- outside steps ---------------------------------------------------------------------
    def read_blocks(self, slot: int) -> tuple[np.ndarray, ...]:
        """Host copies of the blocks a slot holds, in every group: (where, K, V (and scales
        when quantized)); `where` is each block's flat (group, column) index in the slot's
        rows, which a swap-in (`_restore`) gives the restored blocks back."""
        rows = np.asarray(self.state.table.block_tables[:, slot]).reshape(-1)
        (where,) = np.nonzero(rows)
        return (where.astype(np.int32), *(np.asarray(x) for x in kv_lib.read_blocks(
            self.state.cache, jnp.asarray(rows[where]))))

    def snapshot(self) -> tuple[pool_lib.BlockPool, pt.PageTable]:
        """The pool and the page tables as they are now (for checks, which read them)."""
        return self.state.pool, self.state.table

    def _watch_programs(self) -> None:
        """After a call that compiled a new program, keeps the process under the kernel's
        limit on memory mappings (compile_cache.relieve_jit_mappings)."""
        if self.programs.built != self._programs:
            compile_cache.relieve_jit_mappings()  # programs.clear() too (on_clear)
        self._programs = self.programs.built
