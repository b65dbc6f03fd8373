"""Llama-family and Gemma 3 decoders on the paged KV cache, and their GGUF / safetensors loaders.

The loaders and the tokenizer are imported on first use (they need gguf, safetensors,
tokenizers and jinja2); the model itself needs only jax.
"""

import importlib

from paged_jax.models.config import ModelConfig, config_from_hf
from paged_jax.models.llama import Params, forward, make_forward

_LAZY = {"load_gguf": "gguf_loader", "default_model_path": "loader", "load_model": "loader",
         "model_path": "loader",
         "load_safetensors": "safetensors_loader", "Tokenizer": "tokenizer"}

__all__ = [
    "ModelConfig", "Params", "Tokenizer", "config_from_hf", "default_model_path", "forward",
    "load_gguf", "load_model", "load_safetensors", "make_forward", "model_path",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"paged_jax.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'paged_jax.models' has no attribute {name!r}")
