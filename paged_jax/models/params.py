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
QK_NORMS = ("q_norm", "k_norm")  # [D] each, shared by every head (config.qk_norm)
SANDWICH_NORMS = ("post_attn_norm", "post_mlp_norm")  # [E] (config.sandwich_norm)
ATTENTION_WEIGHTS = LAYER_WEIGHTS[:4]
MOE_WEIGHTS = ("router", "e_gate", "e_up", "e_down")  # [X, E] and per expert (config.is_moe)
SHARED_WEIGHTS = ("s_gate", "s_up", "s_down", "s_router")  # Qwen2-MoE's shared expert


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint ([out, in]) shape of every canonical per-layer and global tensor name."""
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, h = config.num_heads * d, config.num_kv_heads * d
    x, fx, fs = config.num_experts, config.moe_intermediate_size, \
        config.shared_expert_intermediate_size
    whole = config.qk_norm_span == "all"
    return {
        "embed": (config.vocab_size, e), "lm_head": (config.vocab_size, e), "final_norm": (e,),
        "wq": (q, e), "wk": (h, e), "wv": (h, e), "wo": (e, q),
        "w_gate": (f, e), "w_up": (f, e), "w_down": (e, f),
        "attn_norm": (e,), "mlp_norm": (e,), "bq": (q,), "bk": (h,), "bv": (h,), "bo": (e,),
        "q_norm": (q,) if whole else (d,), "k_norm": (h,) if whole else (d,),
        "post_attn_norm": (e,), "post_mlp_norm": (e,),
        "router": (x, e), "e_gate": (x, fx, e), "e_up": (x, fx, e), "e_down": (x, e, fx),
        "s_gate": (fs, e), "s_up": (fs, e), "s_down": (e, fs), "s_router": (1, e),
    }


def _checked(name: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(x.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, config expects {shape}")
    return x


def required_layer_tensors(config: ModelConfig) -> tuple[str, ...]:
    """The per-layer tensors every layer of a `config` model must have."""
    mlp = (MOE_WEIGHTS + (SHARED_WEIGHTS if config.shared_expert_intermediate_size else ())
           if config.is_moe else LAYER_WEIGHTS[4:])
    return (*ATTENTION_WEIGHTS, *mlp, "attn_norm", "mlp_norm",
            *(QK_NORMS if config.qk_norm else ()),
            *(SANDWICH_NORMS if config.sandwich_norm else ()))


def build_params(
    config: ModelConfig,
    get: Callable[[str], np.ndarray | None],
    dtype: DTypeLike = jnp.float32,
    file_name: Callable[[str], str] | None = None,
) -> Params:
    """The model pytree from `get(canonical_name)` (None = absent), cast to `dtype`.

    `file_name(canonical)` is the checkpoint's own name of a tensor, for error messages.

    Raises:
      KeyError: a required tensor is missing (named as the checkpoint would name it).
      ValueError: a tensor's shape disagrees with the config.
    """
    shapes = expected_shapes(config)

    def need(name: str, base: str) -> np.ndarray:
        x = get(name)
        if x is None:
            where = f" ({file_name(name)})" if file_name else ""
            raise KeyError(f"checkpoint lacks tensor {name!r}{where}, which a "
                           f"{config.architecture} model with this config needs")
        return _checked(name, np.asarray(x, np.float32), shapes[base])

    def stack(base: str) -> jnp.ndarray:
        mats = [need(f"{i}.{base}", base) for i in range(config.num_layers)]
        if base in (*LAYER_WEIGHTS, *MOE_WEIGHTS, *SHARED_WEIGHTS):  # to [in, out]
            mats = [m.swapaxes(-1, -2) for m in mats]
        return jnp.asarray(np.stack(mats), dtype)

    present = [b for b in LAYER_VECTORS[2:] if get(f"0.{b}") is not None]
    layers = {b: stack(b) for b in (*required_layer_tensors(config), *present)}
    params: Params = {
        "embed": jnp.asarray(need("embed", "embed"), dtype),
        "final_norm": jnp.asarray(need("final_norm", "final_norm"), dtype),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(need("lm_head", "lm_head"), dtype)
    return params
