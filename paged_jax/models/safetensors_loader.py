"""Hugging Face folders: config.json + *.safetensors (single file or sharded by an index)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from safetensors import safe_open

from paged_jax.models.config import ModelConfig, read_hf_config
from paged_jax.models.llama import Params
from paged_jax.models.params import build_params

SUPPORTED_DTYPES = ("F32", "F16", "BF16")
_HF_LAYER = {
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
}
# Gemma's post_attention_layernorm norms the attention output; its pre-MLP norm has its own name.
_HF_GEMMA3_LAYER = {
    **_HF_LAYER, "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
# Mixture-of-experts MLPs: the router, and per expert j (stacked into [X, ...] on loading).
_HF_MOE = {"router": "mlp.gate.weight", "e_gate": "mlp.experts.{j}.gate_proj.weight",
           "e_up": "mlp.experts.{j}.up_proj.weight", "e_down": "mlp.experts.{j}.down_proj.weight",
           "s_gate": "mlp.shared_expert.gate_proj.weight",
           "s_up": "mlp.shared_expert.up_proj.weight",
           "s_down": "mlp.shared_expert.down_proj.weight",
           "s_router": "mlp.shared_expert_gate.weight"}
_HF_MIXTRAL = {"router": "block_sparse_moe.gate.weight",
               "e_gate": "block_sparse_moe.experts.{j}.w1.weight",
               "e_up": "block_sparse_moe.experts.{j}.w3.weight",
               "e_down": "block_sparse_moe.experts.{j}.w2.weight"}
_HF_OLMOE = {**_HF_LAYER, **_HF_MOE, "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight"}
_HF_ARCH = {"gemma3": _HF_GEMMA3_LAYER, "mixtral": {**_HF_LAYER, **_HF_MIXTRAL},
            "qwen2_moe": {**_HF_LAYER, **_HF_MOE}, "qwen3_moe": _HF_OLMOE, "olmoe": _HF_OLMOE}
_HF_GLOBAL = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
              "lm_head": "lm_head.weight"}
NORMS = ("final_norm", "attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm",
         "post_mlp_norm")


def hf_name(canonical: str, architecture: str = "llama") -> str:
    """Hugging Face tensor name of a canonical name ("3.wq" -> model.layers.3.self_attn...)."""
    if canonical in _HF_GLOBAL:
        return _HF_GLOBAL[canonical]
    layer, base = canonical.split(".", 1)
    names = _HF_ARCH.get(architecture, _HF_LAYER)
    return f"model.layers.{layer}.{names[base]}"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder; refuses pickled (.bin/.pt) checkpoints.

    Raises:
      ValueError: only pickle checkpoints are present (unsafe to load, not supported).
      FileNotFoundError: no weights at all.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in the index are missing: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if pickles:
        raise ValueError(
            f"{folder} has only pickle checkpoints {pickles}; they can run arbitrary code when "
            "loaded and are not supported. Convert them to .safetensors."
        )
    raise FileNotFoundError(f"no *.safetensors weights in {folder}")


def _open_all(files: list[Path]) -> dict[str, tuple[object, str]]:
    """Tensor name -> (open file, dtype string), checking dtypes up front."""
    where: dict[str, tuple[object, str]] = {}
    for path in files:
        f = safe_open(str(path), framework="flax")
        for name in f.keys():
            dt = f.get_slice(name).get_dtype()
            if dt not in SUPPORTED_DTYPES:
                raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {dt}")
            where[name] = (f, dt)
    return where


def load_safetensors(
    folder: Path, dtype: DTypeLike = jnp.float32
) -> tuple[ModelConfig, Params]:
    """(config, params) from a Hugging Face folder of safetensors weights."""
    config = read_hf_config(folder)
    where = _open_all(safetensors_files(folder))
    name = functools.partial(hf_name, architecture=config.architecture)
    # Gemma's RMSNorm multiplies by 1 + w; our params hold the factor itself (config.py).
    offset = 1.0 if config.architecture == "gemma3" else 0.0

    def read(tensor: str) -> np.ndarray | None:
        hit = where.get(tensor)
        return None if hit is None else np.asarray(hit[0].get_tensor(tensor).astype(jnp.float32))

    def get(canonical: str) -> np.ndarray | None:
        if "{j}" in name(canonical):  # one tensor per expert, stacked
            experts = [read(name(canonical).format(j=j)) for j in range(config.num_experts)]
            if missing := [j for j, x in enumerate(experts) if x is None]:
                raise KeyError(f"checkpoint lacks tensor {name(canonical).format(j=missing[0])!r}"
                               f" (experts {missing} of {config.num_experts} lack it)")
            return np.stack(experts)
        x = read(name(canonical))
        return x + offset if x is not None and canonical.rsplit(".", 1)[-1] in NORMS else x

    return config, build_params(config, get, dtype, file_name=name)
