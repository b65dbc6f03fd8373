"""Our Llama decoder (models/llama.py) ported to Flax NNX, written as a user would write one:
Hugging Face's module names, `nnx.Linear` projections stored [in, out], RMSNorm, RoPE, a
gated MLP, and `PagedAttention` where a training model would call its attention.

    LlamaForCausalLM(config, rngs=nnx.Rngs(0))            random weights
    LlamaForCausalLM.from_params(config, params)          load_model's weights
    LLM(model=LlamaForCausalLM.from_params(...), tokenizer="smollm2")

It runs the Llama family's checkpoints (Llama, SmolLM2, Mistral's windows, Qwen2's q/k/v
biases and tied embeddings); Gemma 3's and mixture-of-experts' features stay with the
functional decoder and are refused by name (`check_config`). Its logits equal the functional
decoder's within float32 rounding (tests/test_nn.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Float, Int

from paged_jax.cache.kv_cache import KVCache
from paged_jax.models.config import ModelConfig
from paged_jax.models.rope import inv_frequencies
from paged_jax.nn.attention import PagedAttention
from paged_jax.nn.interface import RaggedStep
from paged_jax.types import Array

Rotation = tuple[Float[Array, "T D"], Float[Array, "T D"]]


def check_config(config: ModelConfig) -> None:
    """A ValueError naming each feature of `config` this port does not implement."""
    unsupported = {"qk_norm": config.qk_norm, "sandwich_norm": config.sandwich_norm,
                   "num_experts": config.is_moe, "embed_scale": config.embed_scale != 1.0,
                   "hidden_act": config.hidden_act != "silu",
                   "rope_local_theta": config.rope_local_theta is not None}
    if bad := sorted(k for k, v in unsupported.items() if v):
        raise ValueError(f"the NNX Llama port does not implement {bad} (Gemma 3 / MoE "
                         "features): run this checkpoint with the functional decoder")


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, the statistics in float32."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "T E"]) -> Float[Array, "T E"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def rotary(positions: Int[Array, "T"], inv_freq: Float[Array, "D2"]) -> Rotation:
    """RoPE's (cos, sin) per token, each half repeated (Hugging Face's rotate-half pairs)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.cos(angles)] * 2, -1), jnp.concatenate([jnp.sin(angles)] * 2, -1)


def apply_rotary(x: Float[Array, "T X D"], rot: Rotation) -> Float[Array, "T X D"]:
    """Rotates dims (i, i + D/2) of every head by the token's angles."""
    cos, sin = rot
    x32, half = x.astype(jnp.float32), x.shape[-1] // 2
    turned = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos[:, None] + turned * sin[:, None]).astype(x.dtype)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention with RoPE, on the paged cache."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs,
                 o_bias: bool = False):
        e, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_heads,
                                                            config.num_kv_heads, d)
        lin = dict(param_dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(e, config.num_heads * d, use_bias=config.attention_bias, **lin)
        self.k_proj = nnx.Linear(e, config.num_kv_heads * d, use_bias=config.attention_bias,
                                 **lin)
        self.v_proj = nnx.Linear(e, config.num_kv_heads * d, use_bias=config.attention_bias,
                                 **lin)
        self.o_proj = nnx.Linear(config.num_heads * d, e, use_bias=o_bias, **lin)
        self.attn = PagedAttention(layer, window=config.window(layer),
                                   scale=config.query_scale)

    def __call__(self, x: Float[Array, "T E"], cache: KVCache, step: RaggedStep,
                 rot: Rotation) -> tuple[Float[Array, "T E"], KVCache]:
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        o, cache = self.attn(apply_rotary(q, rot), apply_rotary(k, rot), v, cache, step)
        return self.o_proj(o.reshape(t, -1).astype(x.dtype)), cache


class LlamaMLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nnx.Linear(e, f, use_bias=False, param_dtype=dtype, rngs=rngs)
        self.up_proj = nnx.Linear(e, f, use_bias=False, param_dtype=dtype, rngs=rngs)
        self.down_proj = nnx.Linear(f, e, use_bias=False, param_dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "T E"]) -> Float[Array, "T E"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs,
                 o_bias: bool = False):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, layer, dtype=dtype, rngs=rngs, o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "T E"], cache: KVCache, step: RaggedStep,
                 rot: Rotation) -> tuple[Float[Array, "T E"], KVCache]:
        a, cache = self.self_attn(self.input_layernorm(x), cache, step, rot)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaForCausalLM(nnx.Module):
    """The decoder and its LM head (paged_jax/nn/interface.py's interface).

    Args:
      config: the checkpoint's config (it is also the engine's KV layout).
      dtype: the weights' dtype.
      rngs: for random initial weights (`from_params` replaces them).
      o_bias: the attention output projection has a bias (some Llama checkpoints with
        attention_bias; Qwen2's has none).
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 o_bias: bool = False):
        check_config(config)
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, param_dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(config, i, dtype=dtype, rngs=rngs,
                                                  o_bias=o_bias)
                                for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, param_dtype=dtype, rngs=rngs)

    def __call__(self, cache: KVCache, step: RaggedStep) -> tuple[Array, Array, KVCache]:
        x = self.embed_tokens(step.token_ids)
        rot = rotary(step.positions, jnp.asarray(inv_frequencies(self.config)))
        for layer in self.layers:
            x, cache = layer(x, cache, step, rot)
        h = self.norm(step.rows(x))  # only the rows that get logits
        logits = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return logits.astype(jnp.float32), h, cache

    @classmethod
    def from_params(cls, config: ModelConfig, params: dict) -> LlamaForCausalLM:
        """The module with `load_model`'s checkpoint-form weights (models/llama.py's
        docstring names them), built without random initialisation."""
        dtype = jnp.asarray(params["embed"]).dtype
        o_bias = "bo" in params["layers"]
        abstract = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0),
                                              o_bias=o_bias))
        graphdef, state = nnx.split(abstract)
        weights = hf_names(config, jax.device_get(params))
        nnx.replace_by_pure_dict(state, weights)
        return nnx.merge(graphdef, state)


def hf_names(config: ModelConfig, params: dict) -> dict:
    """Checkpoint-form params (numpy) as this module's nested state ({module: {weight}})."""
    stacked = params["layers"]

    def proj(name: str, i: int, bias: str | None = None) -> dict:
        out = {"kernel": jnp.asarray(stacked[name][i])}  # checkpoint form is [in, out] too
        if bias is not None and bias in stacked:
            out["bias"] = jnp.asarray(stacked[bias][i])
        return out

    def layer(i: int) -> dict:
        return {"input_layernorm": {"weight": jnp.asarray(stacked["attn_norm"][i])},
                "self_attn": {"q_proj": proj("wq", i, "bq"), "k_proj": proj("wk", i, "bk"),
                              "v_proj": proj("wv", i, "bv"), "o_proj": proj("wo", i, "bo")},
                "post_attention_layernorm": {"weight": jnp.asarray(stacked["mlp_norm"][i])},
                "mlp": {"gate_proj": proj("w_gate", i), "up_proj": proj("w_up", i),
                        "down_proj": proj("w_down", i)}}

    out = {"embed_tokens": {"embedding": jnp.asarray(params["embed"])},
           "layers": {i: layer(i) for i in range(config.num_layers)},
           "norm": {"weight": jnp.asarray(params["final_norm"])}}
    if "lm_head" in params:  # [V, E], like the embedding
        out["lm_head"] = {"kernel": jnp.asarray(np.ascontiguousarray(params["lm_head"].T))}
    return out
