"""ModelConfig: the decoder's shape, read from a checkpoint; frozen and hashable (a jit static)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                     "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe"}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Gemma3ForCausalLM", *MOE_ARCHITECTURES)
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
MOE_IMPLS = ("grouped", "dense", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and hyperparameters of a decoder: the Llama family, and Gemma 3.

    One forward (models/llama.py) serves both; what Gemma 3 does differently is spelled out
    by the fields after `eos_token_ids`, whose defaults are the Llama family's.

    Attributes:
      rope_scaling: None, or sorted (key, value) pairs of the HF rope-scaling dict with its
        "rope_type": "llama3" (Hugging Face's parameters), "linear" (positions divided by
        "factor") or "freq_factors" (GGUF's per-pair divisors of the inverse frequencies,
        under "factors"); a tuple so the config hashes. Gemma 3 scales full layers only.
      eos_token_ids: every token id that ends generation.
      architecture: "llama" (Llama, Mistral, Qwen2) or "gemma3"; names the family for
        loaders and reports. The forward reads only the flags below.
      embed_scale: embeddings are multiplied by it (Gemma: sqrt(hidden_size)).
      hidden_act: the MLP's gate activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
      qk_norm: RMSNorm over each head of q and k before RoPE.
      sandwich_norm: RMSNorm on the attention and MLP outputs too, before the residual add.
      query_scale: softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
      sliding_window: the keys a "sliding_attention" layer's query sees (itself included).
      layer_types: per layer "full_attention" or "sliding_attention"; () = all full.
      rope_local_theta: RoPE base of sliding layers (None = rope_theta; never scaled).
      qk_norm_span: "head" (one [D] weight shared by the heads: Gemma 3, Qwen3) or "all"
        (one norm over the whole q and the whole k projection: OLMoE).
      num_experts: 0 for a dense MLP; else every layer's MLP is a mixture of this many
        experts of width `moe_intermediate_size` (models/moe.py), each token sent to its
        `num_experts_per_tok` best by a linear router (softmax over all experts, top-k kept;
        `norm_topk_prob` renormalises the kept weights to 1: Mixtral always does).
      shared_expert_intermediate_size: Qwen2-MoE's always-on expert, scaled by a sigmoid gate
        (0 = none).
      moe_impl: how the experts run, not a property of the checkpoint: "grouped" (tokens
        sorted by expert, tiles of rows per expert: the default), "dense" (every expert on
        every token, the reference) or "ragged_dot" (jax.lax.ragged_dot; XLA:CPU expands it
        to a dense masked product).

    RMSNorm weights are stored as the factor they multiply by: Gemma's checkpoints hold
    w for (1 + w), and the safetensors loader adds the 1 (GGUF files already hold 1 + w).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    qk_norm: bool = False
    sandwich_norm: bool = False
    query_scale: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    qk_norm_span: str = "head"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_impl: str = "grouped"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        rope_type = dict(self.rope_scaling or ()).get("rope_type", "default")
        if rope_type not in ("default", "llama3", "linear", "freq_factors"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                             "(default, llama3, linear, freq_factors)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; one of {ACTIVATIONS}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has "
                             f"{self.num_layers}")
        if bad := set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"unknown layer types {sorted(bad)}; expected {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.qk_norm_span not in ("head", "all"):
            raise ValueError(f"qk_norm_span must be 'head' or 'all', got {self.qk_norm_span!r}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"unknown moe_impl {self.moe_impl!r}; one of {MOE_IMPLS}")
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"1..num_experts ({self.num_experts})")
        if self.moe_intermediate_size < 1:
            raise ValueError("a mixture-of-experts model needs moe_intermediate_size >= 1")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for a full-attention layer."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = tuple(
                (k, tuple(v) if isinstance(v, list) else v) for k, v in d["rope_scaling"]
            )
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["layer_types"] = tuple(d.get("layer_types", ()))
        return cls(**d)


def _moe(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.json.

    Raises:
      ValueError: a feature this decoder does not run (dense layers between MoE ones,
        Qwen's per-layer sliding window, OLMoE's clip_qkv), named.
    """
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("dense MLP layers between MoE layers (mlp_only_layers / "
                         "decoder_sparse_step) are not supported: every layer must be MoE")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{arch}: use_sliding_window is not supported")
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"{arch}: clip_qkv={hf['clip_qkv']} is not supported")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    fields = dict(architecture=arch, num_experts=experts,
                  num_experts_per_tok=hf["num_experts_per_tok"],
                  moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                  norm_topk_prob=arch == "mixtral" or bool(hf.get("norm_topk_prob", False)))
    if arch == "mixtral" and hf.get("sliding_window"):  # every layer slides (Mistral's rule)
        fields.update(sliding_window=hf["sliding_window"],
                      layer_types=("sliding_attention",) * hf["num_hidden_layers"])
    if arch == "qwen2_moe":
        fields.update(attention_bias=bool(hf.get("qkv_bias", True)),
                      shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size")
                      or 0)
    if arch in ("olmoe", "qwen3_moe"):
        fields.update(qk_norm=True, qk_norm_span="all" if arch == "olmoe" else "head")
    return fields


def _as_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list | tuple) else (int(ids),)


def _rope(hf: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, tuple(sorted(params.items()))


def _gemma3(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma 3 fields of a Gemma3ForCausalLM config.json (transformers 4.5x or 5)."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(cap) is not None:
            raise ValueError(f"{cap}={hf[cap]} is not supported (Gemma 2 style soft-capping)")
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one RoPE dict per layer type
        theta, scaling = _rope({"rope_parameters": params["full_attention"]})
        local = float(params.get("sliding_attention", {}).get("rope_theta", 10000.0))
    else:
        theta, scaling = _rope(hf)
        local = float(hf.get("rope_local_base_freq", 10000.0))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma activation {act!r}")
    return dict(
        architecture="gemma3", embed_scale=float(hf["hidden_size"]) ** 0.5,
        hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True,
        query_scale=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256) ** -0.5,
        sliding_window=hf.get("sliding_window"), layer_types=tuple(types),
        rope_local_theta=local, rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict.

    Raises:
      ValueError: for an architecture other than Llama, Mistral, Qwen2 or Gemma 3 (text).
    """
    archs = hf.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"unsupported architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    fields = dict(rope_theta=theta, rope_scaling=scaling,
                  tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))
    if "Gemma3ForCausalLM" in archs:
        fields.update(_gemma3(hf))
    if moe := [MOE_ARCHITECTURES[a] for a in archs if a in MOE_ARCHITECTURES]:
        fields.update(_moe(hf, moe[0]))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        # Qwen2 always has q/k/v biases; its config has no attention_bias key.
        attention_bias=fields.pop("attention_bias",
                                  bool(hf.get("attention_bias", "Qwen2ForCausalLM" in archs))),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        **fields,
    )


def read_hf_config(folder: Path) -> ModelConfig:
    """Reads `folder/config.json`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: not a Hugging Face model folder")
    return config_from_hf(json.loads(path.read_text()))
