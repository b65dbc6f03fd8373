"""Llama-family decoders on the paged KV cache, and their GGUF / safetensors loaders."""

from paged_jax.models.config import ModelConfig, config_from_hf
from paged_jax.models.gguf_loader import load_gguf
from paged_jax.models.llama import Params, forward, make_forward
from paged_jax.models.loader import default_model_path, load_model
from paged_jax.models.safetensors_loader import load_safetensors
from paged_jax.models.tokenizer import Tokenizer

__all__ = [
    "ModelConfig", "Params", "Tokenizer", "config_from_hf", "default_model_path", "forward",
    "load_gguf", "load_model", "load_safetensors", "make_forward",
]
