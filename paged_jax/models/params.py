"""Assembles the model pytree from per-tensor checkpoint arrays, checking every shape.

Both loaders name tensors canonically, in Hugging Face's [out, in] layout:
    "embed", "final_norm", "lm_head"  and per layer  "{i}.wq", "{i}.bq", "{i}.attn_norm", ...
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import Params

LAYER_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LAYER_VECTORS = ("attn_norm", "mlp_norm", "bq", "bk", "bv", "bo")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint ([out, in]) shape of every canonical per-layer and global tensor name."""
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, h = config.num_heads * d, config.num_kv_heads * d
    return {
        "embed": (config.vocab_size, e), "lm_head": (config.vocab_size, e), "final_norm": (e,),
        "wq": (q, e), "wk": (h, e), "wv": (h, e), "wo": (e, q),
        "w_gate": (f, e), "w_up": (f, e), "w_down": (e, f),
        "attn_norm": (e,), "mlp_norm": (e,), "bq": (q,), "bk": (h,), "bv": (h,), "bo": (e,),
    }


def _checked(name: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(x.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, config expects {shape}")
    return x


def build_params(
    config: ModelConfig,
    get: Callable[[str], np.ndarray | None],
    dtype: DTypeLike = jnp.float32,
) -> Params:
    """The model pytree from `get(canonical_name)` (None = absent), cast to `dtype`.

    Raises:
      KeyError: a required tensor is missing.
      ValueError: a tensor's shape disagrees with the config.
    """
    shapes = expected_shapes(config)

    def need(name: str, base: str) -> np.ndarray:
        x = get(name)
        if x is None:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        return _checked(name, np.asarray(x, np.float32), shapes[base])

    def stack(base: str) -> jnp.ndarray:
        mats = [need(f"{i}.{base}", base) for i in range(config.num_layers)]
        mats = [m.T for m in mats] if base in LAYER_WEIGHTS else mats
        return jnp.asarray(np.stack(mats), dtype)

    present = [b for b in LAYER_VECTORS[2:] if get(f"0.{b}") is not None]
    layers = {b: stack(b) for b in (*LAYER_WEIGHTS, "attn_norm", "mlp_norm", *present)}
    params: Params = {
        "embed": jnp.asarray(need("embed", "embed"), dtype),
        "final_norm": jnp.asarray(need("final_norm", "final_norm"), dtype),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(need("lm_head", "lm_head").T, dtype)
    return params
