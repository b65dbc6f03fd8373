"""ModelConfig: the decoder's shape, read from a checkpoint; frozen and hashable (a jit static)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and hyperparameters of a Llama-family decoder.

    Attributes:
      rope_scaling: None, or sorted (key, value) pairs of the HF rope-scaling dict with its
        "rope_type": "llama3" (Hugging Face's parameters) or "freq_factors" (GGUF's per-pair
        divisors of the inverse frequencies, under "factors"); a tuple so the config hashes.
      eos_token_ids: every token id that ends generation.
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        rope_type = dict(self.rope_scaling or ()).get("rope_type", "default")
        if rope_type not in ("default", "llama3", "freq_factors"):
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (default, llama3, freq_factors)"
            )

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
        return cls(**d)


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


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict.

    Raises:
      ValueError: for an architecture other than Llama, Mistral or Qwen2.
    """
    archs = hf.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"unsupported architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; its config has no attention_bias key.
        attention_bias=bool(hf.get("attention_bias", "Qwen2ForCausalLM" in archs)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
    )


def read_hf_config(folder: Path) -> ModelConfig:
    """Reads `folder/config.json`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: not a Hugging Face model folder")
    return config_from_hf(json.loads(path.read_text()))
