"""Token-level routing on the modeled GPU clock: parameter counts of mixture-of-experts decoders
and the roofline seconds of their steps beside dense models of the same total and of the same
active parameters (experiments/moe.py and the routing notebook put them beside request-level
routing's costs).

A step reads the weights it touches once: the attention, router, shared expert and head always,
and in each layer the experts its tokens were sent to. Under uniform routing a step of n tokens
touches X (1 - (1 - k/X)^n) of a layer's X experts in expectation, so decode at batch 1 reads
the active parameters only, and by batch ~X reads nearly all of them: the MoE's saving is in
compute (always active / total) and, at small batches, in memory. KV-cache reads are left out
(the same attention on every side).
"""

from __future__ import annotations

import dataclasses

from paged_jax.study.cost_model import GpuCostModel

H200 = dict(name="H200 roofline, fp16", bandwidth=4.8e12, peak_flops=989e12)
BYTES_PER_PARAM = 2  # fp16


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """The sizes that decide an MoE decoder's parameters (untied head; norms left out)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    shared_width: int = 0

    @property
    def embed(self) -> int:
        return self.vocab * self.hidden

    @property
    def expert(self) -> int:
        """One expert's SwiGLU weights."""
        return 3 * self.hidden * self.expert_width

    @property
    def fixed(self) -> int:
        """What every token uses besides the embedding: attention, routers, shared expert,
        head."""
        e = self.hidden
        attn = 2 * e * self.heads * self.head_dim + 2 * e * self.kv_heads * self.head_dim
        shared = 3 * e * self.shared_width + e if self.shared_width else 0
        return self.layers * (attn + e * self.experts + shared) + self.embed

    @property
    def total(self) -> int:
        return self.fixed + self.embed + self.layers * self.experts * self.expert

    @property
    def active(self) -> int:
        """Parameters one token uses (its k experts per layer)."""
        return self.fixed + self.embed + self.layers * self.top_k * self.expert

    def touched(self, tokens: int) -> float:
        """Expected experts per layer a step of `tokens` tokens reads (uniform routing)."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    def step_seconds(self, tokens: int, dense: str | None = None, gpu: dict = H200) -> float:
        """Modeled seconds of one step of `tokens` tokens: this MoE, or (`dense` = "total" /
        "active") a dense model of its total / active parameters, which reads all of its own."""
        read = {None: self.fixed + self.layers * self.touched(tokens) * self.expert,
                "total": self.total - self.embed, "active": self.active - self.embed}[dense]
        model = GpuCostModel(weight_bytes=read * BYTES_PER_PARAM, kv_pool_bytes=0.0,
                             parameters=self.total if dense == "total" else self.active, **gpu)
        return model.step_seconds(1, tokens, 0, 1)

    def request_seconds(self, prompt: int, output: int, batch: int,
                        dense: str | None = None) -> float:
        """Modeled seconds one request costs: its prefill step alone, then its share of
        `output` decode steps at `batch`."""
        return (self.step_seconds(prompt, dense)
                + output * self.step_seconds(batch, dense) / batch)


# From each model's config.json.
REAL = {"Mixtral-8x7B": MoeShape(32000, 4096, 32, 32, 8, 128, 8, 2, 14336),
        "Qwen1.5-MoE-A2.7B": MoeShape(151936, 2048, 24, 16, 16, 128, 60, 4, 1408, 5632),
        "OLMoE-1B-7B": MoeShape(50304, 2048, 16, 16, 16, 128, 64, 8, 1024)}


def compare(shape: MoeShape, batches: tuple[int, ...] = (1, 8, 64),
            request: tuple[int, int] | None = None) -> dict:
    """Parameters, decode seconds per token at each batch (MoE, dense of the same total and
    of the same active parameters) and, given (prompt, output) tokens, seconds per request
    at each batch."""
    out = dict(total_params=shape.total, active_params=shape.active,
               active_share=shape.active / shape.total, decode_s_per_token={})
    for b in batches:
        row = {name: shape.step_seconds(b, dense) / b for name, dense in
               (("moe", None), ("dense_same_total", "total"), ("dense_same_active", "active"))}
        row["moe_over_dense_same_total"] = row["moe"] / row["dense_same_total"]
        out["decode_s_per_token"][str(b)] = row
    if request:
        out["request"] = dict(prompt=request[0], output=request[1], seconds={
            str(b): {name: shape.request_seconds(*request, b, dense) for name, dense in
                     (("moe", None), ("dense_same_total", "total"),
                      ("dense_same_active", "active"))} for b in batches})
    return out
