"""Hugging Face folders: config.json + *.safetensors (single file or sharded by an index)."""

from __future__ import annotations

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
_HF_GLOBAL = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
              "lm_head": "lm_head.weight"}


def hf_name(canonical: str) -> str:
    """Hugging Face tensor name of a canonical name ("3.wq" -> model.layers.3.self_attn...)."""
    if canonical in _HF_GLOBAL:
        return _HF_GLOBAL[canonical]
    layer, base = canonical.split(".", 1)
    return f"model.layers.{layer}.{_HF_LAYER[base]}"


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

    def get(canonical: str) -> np.ndarray | None:
        hit = where.get(hf_name(canonical))
        if hit is None:
            return None
        x = hit[0].get_tensor(hf_name(canonical))
        return np.asarray(x.astype(jnp.float32))

    return config, build_params(config, get, dtype)
