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
