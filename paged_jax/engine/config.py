"""The engine's knobs: frozen and hashable (safe to pass as static arguments to jax.jit)."""

from __future__ import annotations

import dataclasses

from paged_jax.cache import kv_quant
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.groups import KVGroups
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.lora.config import LoRAConfig
from paged_jax.sizes import cdiv

DECODE_WINDOW = 8  # decode steps per device call when windows apply and none is given


def scheduling(decode_window: int | None, async_scheduling: bool | None,
               speculative: SpeculativeConfig | None) -> tuple[int, bool]:
    """LLM's (decode_window, async_scheduling) as they apply. Async scheduling delivers every
    step as it is read, so decode windows do not apply under it and decode_window is recorded
    as 1 (what runs); speculative decoding needs sync (drafts continue the step before).
    async_scheduling=None (the default) turns it on unless an explicit decode_window > 1 or
    a speculative config asks for sync; an explicit True beside either is refused."""
    if decode_window is not None and (not isinstance(decode_window, int)
                                      or isinstance(decode_window, bool) or decode_window < 1):
        raise ValueError(f"decode_window must be a positive integer, got {decode_window!r}")
    if async_scheduling is not None and not isinstance(async_scheduling, bool):
        raise ValueError(f"async_scheduling must be a bool or None, got {async_scheduling!r}")
    windows = decode_window is not None and decode_window > 1
    if async_scheduling and windows:
        raise ValueError(f"decode_window={decode_window} does not apply with "
                         "async_scheduling=True (every step is delivered as it is read): pass "
                         "async_scheduling=False for decode windows, or drop decode_window")
    if async_scheduling and speculative is not None:
        raise ValueError("speculative_config needs async_scheduling=False (drafts continue "
                         "the tokens of the step before): drop async_scheduling=True")
    if async_scheduling is None:
        async_scheduling = not windows and speculative is None
    if async_scheduling:
        return 1, True
    return decode_window or DECODE_WINDOW, False


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
      decode_window: decode steps per device call when only decodes run (1 = every step);
        unread under async_scheduling, where LLM records 1 (`scheduling`).
      backend: attention backend; None picks by platform.
      matmul_backend: "cpu" (projections and LM head packed for the C++ CPU matmul kernel,
        kernels/cpu_matmul.py: float32 on CPU devices, each packing its own shard under
        tensor parallelism) or "xla" (XLA's dot); None: "cpu" where it applies and builds.
      quantization: weight quantization (vLLM's name): None, "int8" (projections and LM
        head as int8 with a float16 scale per output column and 32 inputs; a tensor already
        on a 4-bit grid keeps it) or "int4" (4-bit codes, each group's scale and min coded
        in 8 bits), read by the CPU matmul kernel (kernels/cpu_matmul.py; needs
        matmul_backend "cpu"), which quantizes the activations to int8 per 32 inputs too, or
        on a GPU, weight-only, by kernels/quant_matmul.py (one device).
      max_logprobs: the most top logprobs a request may ask for (static).
      seed: engine seed, used for requests without their own.
      enable_prefix_caching: reuse cached full blocks across requests (prefix_cache.py).
      admission: "fcfs", or "cache-aware" (longest cached prefix first; needs caching).
      max_skips: cache-aware admission passes a request over at most this many times.
      swap_space: bytes of host memory for swapped-out K/V (swap mode); a preemption that
        would exceed it recomputes instead.
      kv_cache_dtype: how K/V are stored (vLLM's name): "auto" (the model's dtype),
        "float32", "bfloat16", "int8", "fp8" (e4m3) or "fp8_e5m2"; int8 / fp8 keep a float32
        scale per 32 values of a token and KV head (paged_jax/cache/kv_quant.py); every
        attention backend reads them.
      tensor_parallel_size: devices the model and its KV pool are split over (heads, MLP
        width, vocabulary; paged_jax/models/parallel.py); 1 = one device.
      first_device: the engine runs on devices first_device .. + tensor_parallel_size - 1
        (data-parallel replicas take consecutive ranges).
      async_scheduling: plan and send step n+1 while the device runs step n (vLLM's
        name); the sampled tokens stay on the device and the host reads each step one step
        late. Every step is delivered as it is read (no decode windows). Same tokens.
      long_prefill_token_threshold: the most tokens one sequence's prefill (or recompute)
        chunk takes in a step (vLLM's name); 0 = what budget is left. A long prompt then
        shares each step with the running decodes instead of filling it, so their
        inter-token latency holds while it prefills (experiments/long_prompt.py).
      static_shapes: pad every call to the largest shape, with every sampler feature on:
        one program per kind of call (step, window, ops) instead of one per bucket. Fewer
        compiles (tests; an accelerator whose programs are few and fixed), more padded work
        on small steps; the same tokens (engine/batch.py).
      speculative: speculative decoding (engine/speculative.py; vLLM's speculative_config),
        None: off. Needs async_scheduling False (a draft needs the tokens of the step before).
      kv_groups: KV cache groups (cache/groups.py): sliding-window layers keep only their
        window's blocks. None: one group of every layer (models without windows, or the
        hybrid layout turned off). A draft model's pages (engine/draft.py) follow a full
        group's page tables, so some group must be full attention.
      lora: LoRA adapters (paged_jax/lora): slots and rank; None: requests cannot name one.
        Not beside speculative decoding or tensor parallelism (refused).
    """

    block_size: int = 16
    num_kv_blocks: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    preemption_mode: str = "recompute"
    decode_window: int = DECODE_WINDOW
    backend: str | None = None
    matmul_backend: str | None = None
    quantization: str | None = None
    max_logprobs: int = 0
    seed: int = 0
    enable_prefix_caching: bool = True
    admission: str = "fcfs"
    max_skips: int = 8
    swap_space: int = 4 << 30
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    first_device: int = 0
    static_shapes: bool = False
    async_scheduling: bool = False
    long_prefill_token_threshold: int = 0
    speculative: SpeculativeConfig | None = None
    kv_groups: KVGroups | None = None
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        kv_quant.storage_dtype(self.kv_cache_dtype, "float32")  # a clear error if unknown
        if self.admission not in ("fcfs", "cache-aware"):
            raise ValueError(f"admission must be 'fcfs' or 'cache-aware', got {self.admission!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {self.preemption_mode!r}")
        if self.max_model_len > self.max_num_batched_tokens * 1024:
            raise ValueError("max_model_len is implausibly large for the token budget")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "decode_window", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.matmul_backend not in (None, "cpu", "xla"):
            raise ValueError(f"matmul_backend must be 'cpu' or 'xla' (or None: by platform), "
                             f"got {self.matmul_backend!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', "
                             f"got {self.quantization!r}")
        if self.quantization and self.matmul_backend == "xla":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU matmul "
                             f"kernel; matmul_backend='xla' reads float weights")
        if self.speculative is not None and self.async_scheduling:
            raise ValueError("speculative decoding needs async_scheduling=False: its drafts "
                             "continue the tokens of the step before")
        if self.kv_groups is not None and self.kv_groups.hybrid:
            if (self.speculative is not None and self.speculative.model is not None
                    and self.kv_groups.full_group is None):
                raise ValueError("a draft model on the hybrid KV cache reads a full-attention "
                                 "group's page tables, and every layer of this model slides: "
                                 "pass hybrid_kv_cache=False")
        if self.lora is not None and (self.speculative or self.tensor_parallel_size > 1):
            raise ValueError("LoRA adapters run on one device without speculative decoding: "
                             "enable_lora with speculative_config or tensor_parallel_size > 1 "
                             "is not supported")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0 = no cap), "
                             f"got {self.long_prefill_token_threshold}")

    @property
    def cache(self) -> CacheConfig:
        return CacheConfig(num_blocks=self.num_kv_blocks, block_size=self.block_size,
                           max_seqs=self.max_num_seqs,
                           max_blocks_per_seq=cdiv(self.max_model_len, self.block_size),
                           windows=self.kv_groups.windows if self.kv_groups else (None,))

    @property
    def num_groups(self) -> int:
        return self.kv_groups.num_groups if self.kv_groups else 1
