"""A modeled GPU clock for serving experiments: step time from a roofline of the paper's setup.

On a 2-core CPU a step's cost grows with the batch, so the GPU regime the vLLM paper measures
(a decode step reads all weights once, whatever the batch, so a bigger batch is almost free)
does not appear in wall-clock runs of a small model. The experiments can instead advance
their virtual clock by what each engine step *would* cost on the paper's hardware, while the
engine itself runs for real (same scheduler, allocator, reservation policy and outputs):

    seconds(step) = max(memory, compute)
    memory  = iterations * (weight bytes + KV bytes of the tokens in the cache) / bandwidth
    compute = tokens processed * 2 * parameters / peak FLOP/s

The KV term is scaled so that the engine's pool stands for the GPU's KV capacity: a full pool
costs `kv_pool_bytes` per iteration, whatever the tiny model's real per-token size. This keeps
the paper's ratio of KV to weight traffic with a CPU-sized pool. It is a model (no kernel
launch overheads, no sampling cost, perfect bandwidth), reported next to measured runs,
never instead of them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuCostModel:
    """Roofline costs of one model on one GPU (defaults: OPT-13B on A100-40GB, paper Fig. 12a).

    OPT-13B in fp16 is 26 GB of weights; the paper's A100-40GB leaves about 12 GB for the
    KV cache (Sec. 6.1); A100-40GB has 1.555 TB/s of HBM bandwidth and 312 TFLOP/s fp16.
    """

    name: str = "OPT-13B fp16 on A100-40GB (roofline)"
    weight_bytes: float = 26e9
    kv_pool_bytes: float = 12e9
    bandwidth: float = 1.555e12
    parameters: float = 13e9
    peak_flops: float = 312e12

    def step_seconds(self, iterations: int, tokens: int, cached_tokens: int,
                     pool_tokens: int) -> float:
        """Modeled seconds of an engine step.

        Args:
          iterations: model forward passes in the step (a decode window counts W).
          tokens: query tokens processed (prefill chunks + decodes) over those passes.
          cached_tokens: tokens whose K/V are in the cache after the step.
          pool_tokens: token positions of the engine's KV pool (stands for `kv_pool_bytes`).
        """
        kv = self.kv_pool_bytes * min(1.0, cached_tokens / pool_tokens)
        memory = iterations * (self.weight_bytes + kv) / self.bandwidth
        compute = tokens * 2 * self.parameters / self.peak_flops
        return max(memory, compute)

    def last_step_seconds(self, engine, cached_tokens: int) -> float:
        """Modeled seconds of the engine's last step (its `stats[-1]`), with `cached_tokens`
        in its cache after it (metrics.kv_snapshot's token_states)."""
        st, cfg = engine.stats[-1], engine.config
        return self.step_seconds(st.num_steps, st.num_tokens, cached_tokens,
                                 (cfg.num_kv_blocks - 1) * cfg.block_size)

    def describe(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TensorParallelRoofline:
    """Roofline of one decoder split over N GPUs (Megatron-style, as paged_jax/models/parallel.py
    splits it): weights and KV heads divided by N (KV heads replicated past H), two ring
    all-reduces of the activations per layer plus one for the embedding and an all-gather of
    the logits, *not* overlapped with compute (counted, not hidden).

    Defaults: Llama-3-8B (32 layers, 4096 wide, 32 query / 8 KV heads of 128, MLP 14336,
    vocabulary 128256) in bf16 on A100-80GB SXM (2.04 TB/s, 312 TFLOP/s, NVLink 300 GB/s per
    direction, an assumed 15 us per collective), 90% of memory for weights + KV.
    """

    name: str = "Llama-3-8B bf16 on A100-80GB (roofline)"
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 128256
    bytes_per_value: int = 2
    memory: float = 80e9 * 0.9
    bandwidth: float = 2.04e12
    peak_flops: float = 312e12
    link: float = 300e9
    collective_latency: float = 15e-6

    @property
    def parameters(self) -> float:
        e, d = self.hidden, self.head_dim
        layer = e * (self.heads + 2 * self.kv_heads) * d + self.heads * d * e + 3 * e * self.mlp
        return self.layers * layer + 2 * self.vocab * e

    def weight_bytes(self, n: int) -> float:
        """Weights one device holds."""
        return self.parameters * self.bytes_per_value / n

    def kv_bytes_per_token(self, n: int) -> float:
        """K and V of one token on one device (its KV heads, at least one)."""
        heads = max(self.kv_heads, n) / n
        return 2 * self.layers * heads * self.head_dim * self.bytes_per_value

    def capacity_tokens(self, n: int) -> int:
        """Tokens the KV pool holds (each device's share of memory after its weights)."""
        return int((self.memory - self.weight_bytes(n)) // self.kv_bytes_per_token(n))

    def comm_seconds(self, n: int, tokens: int) -> float:
        """The step's collectives: ring all-reduces of [tokens, hidden] activations (two per
        layer, one for the embedding) and the logits' all-gather."""
        if n == 1:
            return 0.0
        act = tokens * self.hidden * self.bytes_per_value
        ring = 2 * (n - 1) / n * act / self.link
        gather = (n - 1) / n * tokens * self.vocab * 4 / self.link
        count = 2 * self.layers + 1
        return count * (ring + self.collective_latency) + gather + self.collective_latency

    def decode_seconds(self, n: int, batch: int, context: int) -> float:
        """One decode step of `batch` sequences of `context` tokens each."""
        read = self.weight_bytes(n) + batch * context * self.kv_bytes_per_token(n)
        compute = 2 * self.parameters / n * batch / self.peak_flops
        return max(read / self.bandwidth, compute) + self.comm_seconds(n, batch)
