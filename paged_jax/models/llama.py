"""Llama-family decoder (Llama, Mistral, Qwen2), Gemma 3 and mixture-of-experts decoders
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: the MLP is models/moe.py's) over the paged KV cache,
as pure functions. Gemma 3 is this decoder with the config's Gemma fields on (config.py): scaled
embeddings, GeGLU, q/k norms, norms after attention and MLP too, and sliding-window layers
with their own RoPE base; the attention kernels take the window.

Params are a plain pytree (dict). Loaders build the *checkpoint form*, layers stacked on a
leading L axis (one array per weight name, easy to save, compare and load):

    embed [V, E]     final_norm [E]     lm_head [V, E] (absent when embeddings are tied)
    layers: attn_norm [L, E]  wq [L, E, Q*D]  wk, wv [L, E, H*D]  wo [L, Q*D, E]
            bq [L, Q*D]  bk, bv [L, H*D]  (q/k/v bias, optional)   bo [L, E] (optional)
            mlp_norm [L, E]  w_gate, w_up [L, E, F]  w_down [L, F, E]
            q_norm, k_norm [L, D] (config.qk_norm)  post_attn_norm, post_mlp_norm [L, E]
            (config.sandwich_norm)
            MoE (config.is_moe; models/moe.py) instead of w_gate, w_up, w_down: router
            [L, E, X]  e_gate, e_up [L, X, E, F]  e_down [L, X, F, E]; Qwen2-MoE's shared
            expert s_gate, s_up [L, E, Fs]  s_down [L, Fs, E]  s_router [L, E, 1]

`prepare_params` turns it into the *runtime form* the forward is fast on: "layers" becomes a
list of per-layer dicts, with q|k|v fused into one `w_qkv [(Q + 2H) * D, E]` (and `b_qkv`) and
gate|up into one `w_gate_up [2F, E]`, and every projection stored [out, in] (`w_qkv`, `wo
[E, Q*D]`, `w_gate_up`, `w_down [E, F]`; `linear` contracts x's last axis with w's). XLA:CPU's
dots read that layout faster at small batch: SmolLM2-135M's matmul chain at 16 rows took 108
ms against 128 ms [in, out], at 32 rows 132 against 171 (faster in 15 of 15 paired rounds
each), at 64 and 128 rows about the same (results/weight_layout.json, `python -m
experiments.weight_layout --batches 1 16 32 64 128 --rounds 15`). The decoder then runs its
layers unrolled: under a `lax.scan`, XLA:CPU copies each layer's weights out of the stacked
arrays before every dot (slower at every batch size we tried on SmolLM2-135M; no results file
keeps the ratio); fused projections mean fewer, wider dots. `forward` accepts either form
(the checkpoint form is converted inside the traced function, copying on every call).

On CPUs in float32 the engine goes one step further (`pack_params`): every projection and the
LM head are packed into the panels of the C++ matmul kernel (kernels/cpu_matmul.py), which
runs the small-row matmuls of serving up to twice as fast as XLA:CPU's dot; `linear` calls
whichever the weight is.

Checkpoint-form projections are stored [in, out] (lm_head [V, E], like the embedding). RoPE
uses Hugging Face's rotate-half pairing (dims i and i + D/2); GGUF loaders un-permute
llama.cpp's interleaved q/k. D2 in annotations is D / 2 (one inverse frequency per pair).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from kernels import cpu_matmul
from kernels.cpu_matmul import Packed
from kernels.pages import Pages
from kernels.quant_matmul import QuantWeight, quant_matmul
from paged_jax.cache.kv_cache import KVCache
from paged_jax.models import moe
from paged_jax.models import parallel as tp_lib
from paged_jax.models.attention import cached_attention
from paged_jax.models.config import ModelConfig
from paged_jax.models.lora_ops import prepare as lora_prepare
from paged_jax.models.lora_ops import with_delta
from paged_jax.models.param_forms import (  # noqa: F401 (the forms' functions, re-exported)
    EXPERTS,
    FUSED,
    PROJECTIONS,
    fuse_layer,
    pack_params,
    prepare_params,
    quantize_params,
    runtime_layers,
)
from paged_jax.models.rope import inv_frequencies, rope, rope_tables
from paged_jax.types import Array, Float, Int

Params = Mapping[str, Any]
"""Ours are dicts; the engine also runs a user's Flax module's state (an nnx.State, a
Mapping: paged_jax/nn) through the same step programs."""


def rms_norm(
    x: Float[Array, "*B E"], w: Float[Array, "E"], eps: float
) -> Float[Array, "*B E"]:
    """RMSNorm over the last axis, in fp32, cast back before the weight (as HF's Llama)."""
    with jax.named_scope("norm"):  # named scopes: experiments/step_profile.py's kinds
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return w * y.astype(x.dtype)


def linear(x: Float[Array, "T I"], w: Float[Array, "O I"] | Packed | QuantWeight
           ) -> Float[Array, "T O"]:
    """x @ w.T for a runtime-form [out, in] weight, one packed for the CPU matmul kernel
    (`pack_params`) or one quantized for the GPU kernel (`quantize_params`)."""
    with jax.named_scope("matmul"):
        if isinstance(w, Packed):
            return cpu_matmul.matmul(x, w).astype(x.dtype)
        if isinstance(w, QuantWeight):
            return quant_matmul(x, w)
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def attention_block(
    p: Params, x: Float[Array, "T E"], kv: tuple[Pages, Pages], batch: tuple,
    rot: tuple[Array, Array], config: ModelConfig, attn: dict,
) -> tuple[Float[Array, "T E"], tuple[Pages, Pages]]:
    """Self-attention of one layer: project, RoPE, then `cached_attention` (K/V written to
    the pages, paged attention: models/attention.py, the path a Flax module takes too).

    `kv` is this layer's (K, V) pages (KVCache.layer); `rot` the (cos, sin) of
    `rope_tables`; `attn` the static keyword arguments of `paged_attention` (max_q, backend,
    max_q_rows, decode_pages, window, scale), and "tp": under tensor parallelism (inside
    shard_map, paged_jax/models/parallel.py) the heads here are this device's, and the output
    projection's partial sums are added over the mesh.
    """
    tp = attn.pop("tp", False)
    positions, cache_pos, block_tables, seq_lens, query_start = batch[:5]
    t, d = x.shape[0], config.head_dim
    nq, nk = config.num_heads * d, config.num_kv_heads * d
    qkv = with_lora(linear(x, p["w_qkv"]), x, p, "lora_qkv", batch)
    if "b_qkv" in p:
        qkv = qkv + p["b_qkv"]
    q = qkv[:, :nq].reshape(t, config.num_heads, d)
    k = qkv[:, nq:nq + nk].reshape(t, config.num_kv_heads, d)
    v = qkv[:, nq + nk:].reshape(t, config.num_kv_heads, d)
    if config.qk_norm:  # one [D] weight shared by the heads, or one over all (OLMoE)
        whole = config.qk_norm_span == "all"
        q = _qk_norm(q, p["q_norm"], config.rms_norm_eps, whole)
        k = _qk_norm(k, p["k_norm"], config.rms_norm_eps, whole)
    q, k = rope(q, *rot), rope(k, *rot)
    o, kv = cached_attention(q, k, v, kv, cache_pos, block_tables, seq_lens, query_start,
                             **attn)
    o = o.reshape(t, -1).astype(x.dtype)
    o = with_lora(linear(o, p["wo"]), o, p, "lora_o", batch)
    if tp:
        o = jax.lax.psum(o, tp_lib.AXIS)
    return (o + p["bo"] if "bo" in p else o), kv


def with_lora(y: Float[Array, "T O"], x: Float[Array, "T I"], p: Params, name: str,
              batch: tuple) -> Float[Array, "T O"]:
    """y plus each token's adapter delta of projection `name` (models/lora_ops.py) when the
    batch carries adapter slots (its 6th entry: their lora_ops.Plan) and the layer has them."""
    if len(batch) < 6 or batch[5] is None or name not in p:
        return y
    with jax.named_scope("lora"):
        return with_delta(y, x, *p[name], batch[5])


def _qk_norm(x: Float[Array, "T X D"], w: Array, eps: float, whole: bool) -> Array:
    if whole:
        return rms_norm(x.reshape(x.shape[0], -1), w, eps).reshape(x.shape)
    return rms_norm(x, w, eps)


def gated_mlp(x: Float[Array, "T E"], gate_up, down, act: str = "silu",
              lora: tuple = (None, ())) -> Float[Array, "T E"]:
    """down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh-approximated gelu, Gemma's
    gelu_pytorch_tanh). `lora`: (the layer's params, the batch) to add adapter deltas."""
    p, batch = lora
    lin = (lambda y, w, name: linear(y, w)) if p is None else (  # noqa: E731
        lambda y, w, name: with_lora(linear(y, w), y, p, name, batch))
    gate, up = jnp.split(lin(x, gate_up, "lora_gate_up"), 2, axis=-1)
    with jax.named_scope("activation"):
        hidden = (jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, True)) * up
    return lin(hidden, down, "lora_down")


def mlp_block(p: Params, x: Float[Array, "T E"], config: ModelConfig, valid: Array,
              tp: bool = False, batch: tuple = ()) -> tuple[Float[Array, "T E"], Array | None]:
    """The layer's MLP, dense or mixture of experts (with its expert load; models/moe.py),
    plus a shared expert where the model has one. `tp`: this device's slice of F (of the
    experts); partial sums added over the mesh. `batch`: adapter slots (with_lora)."""
    load = None
    if not config.is_moe:
        out = gated_mlp(x, p["w_gate_up"], p["w_down"], config.hidden_act, (p, batch))
    else:
        out, load = moe.moe_block(p, x, config, valid, tp)
    if "s_gate_up" in p:
        shared = gated_mlp(x, p["s_gate_up"], p["s_down"])
        out = out + jax.nn.sigmoid(linear(x, p["s_router"])) * shared
    return (jax.lax.psum(out, tp_lib.AXIS) if tp else out), load


@functools.partial(jax.jit, static_argnames=("config", "attn"))
def decoder_layer(
    p: Params, x: Float[Array, "T E"], kv: tuple[Pages, Pages], batch: tuple,
    rot: tuple[Array, Array], *, config: ModelConfig, attn: tuple,
) -> tuple[Float[Array, "T E"], tuple[Pages, Pages], Int[Array, "X"] | None]:
    """One pre-norm decoder layer, and its expert load when it is MoE (tokens per expert,
    padding not counted). With config.sandwich_norm, the attention and MLP outputs are
    normed too. Jitted on its own so that a forward traces it once per kind of layer, not
    once per layer: inside the step's program it is a call XLA inlines (the compiled code is
    that of the unrolled loop), while tracing and lowering a 30-layer step cost one layer."""
    eps = config.rms_norm_eps
    a, kv = attention_block(p, rms_norm(x, p["attn_norm"], eps), kv, batch, rot, config,
                            dict(attn))
    if config.sandwich_norm:
        a = rms_norm(a, p["post_attn_norm"], eps)
    x = x + a
    m, load = mlp_block(p, rms_norm(x, p["mlp_norm"], eps), config, batch[1] >= 0,
                        dict(attn).get("tp", False), batch)
    if config.sandwich_norm:
        m = rms_norm(m, p["post_mlp_norm"], eps)
    return x + m, kv, load


Logits = Float[Array, "S V"] | Float[Array, "T V"]


def forward(
    params: Params,
    cache: KVCache,
    token_ids: Int[Array, "T"],
    positions: Int[Array, "T"],
    cache_positions: Int[Array, "T"] | Int[Array, "G T"],
    block_tables: Int[Array, "S P"] | Int[Array, "G S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    config: ModelConfig,
    max_q: int,
    backend: str = "reference",
    all_logits: bool = False,
    max_q_rows: int | None = None,
    decode_pages: int | None = None,
    tp: bool = False,
    with_hidden: bool = False,
    router_load: bool = False,
    lora_slots: Int[Array, "T"] | None = None,
) -> tuple[Logits | tuple, KVCache]:
    """One decoder pass over a ragged batch (semantics of `paged_jax.models.attention`).

    Args:
      params: the model pytree, either form (module docstring); its dtype is the compute dtype.
      cache: KV pages, one [H, N, K, D] pair per layer; this step's K/V go to cache_positions.
      token_ids, positions, cache_positions: [T] per token; padding tokens have cache position < 0.
      block_tables, seq_lens, query_start: the paging of the S sequences (attention.py); with
        KV cache groups (cache/groups.py) cache_positions [G, T], block_tables [G, S, P].
      config: static model config.
      max_q: static bound on queries per sequence (1 for decode).
      backend: paged-attention backend (models/attention.py's BACKENDS).
      all_logits: return logits for every token instead of each sequence's last one.
      max_q_rows, decode_pages: static hints of `paged_jax.models.attention.paged_attention`.
      tp: one device's share of params and cache (in `parallel.shard_forward`, local config).
      with_hidden: also return each sequence's last-token hidden state (final-normed, fp32
        [S, E]).
      router_load: (MoE) also return the tokens each layer sent to each expert, [L, X].
      lora_slots: [T] each token's adapter slot in params["lora"]["layers"] (lora/weights.py;
        -1: none); None: no adapter in the batch, no delta computed.

    Returns:
      (logits fp32 [S, V] at token query_start[s+1] - 1, or [T, V] if all_logits; cache'),
      or ((logits, hidden), cache') with_hidden (one tree, so shard_map's out_specs hold);
      with router_load, ((that first element, load), cache').
    """
    x = _embed(params["embed"], token_ids, tp)
    if config.embed_scale != 1.0:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    rot = rope_tables(positions, jnp.asarray(inv_frequencies(config)))
    rot_local = rot if config.rope_local_theta is None else rope_tables(
        positions, jnp.asarray(inv_frequencies(config, local=True)))
    batch = (positions, cache_positions, block_tables, seq_lens, query_start, lora_slots)
    attn = (("max_q", max_q), ("backend", backend), ("max_q_rows", max_q_rows),
            ("decode_pages", decode_pages), ("scale", config.query_scale), ("tp", tp))
    x, layers, loads = _layers(params, x, cache, batch, (rot, rot_local), config, attn)
    out = _outputs(params, x, query_start, config, tp, all_logits, with_hidden)
    if router_load:
        out = (out, jnp.stack(loads))
    return out, cache.with_buffers(layers)


def _layers(params: Params, x: Float[Array, "T E"], cache: KVCache, batch: tuple,
            rots: tuple, config: ModelConfig, attn: tuple):
    """Every decoder layer in turn: (x, each buffer's (K, V) pages, each layer's expert load).
    `rots`: the (cos, sin) of full and of sliding-window layers. `batch` holds every KV
    cache group's cache positions and block tables; a layer gets its group's."""
    positions, cache_pos, tables, seq_lens, query_start, slots = batch
    if tables.ndim == 2:  # one group
        tables, cache_pos = tables[None], cache_pos[None]
    bufs = [cache.buffer(b) for b in range(cache.num_layers)]
    loads, adapters = [], params["lora"]["layers"] if slots is not None else None
    if adapters is not None:  # tokens sorted by adapter once for every projection
        slots = lora_prepare(slots, adapters[0]["lora_qkv"][0].shape[0])
    for i, p in enumerate(runtime_layers(params)):
        window, g = config.window(i), cache.group_of(i)
        b = cache.layer_buffer[i] if cache.layer_buffer else i
        mine = (positions, cache_pos[g], tables[g], seq_lens, query_start)
        if adapters is not None:  # this layer's adapter slots beside its weights
            p, mine = {**p, **adapters[i]}, (*mine, slots)
        x, bufs[b], load = decoder_layer(p, x, bufs[b], mine, rots[window is not None],
                                         config=config, attn=(*attn, ("window", window)))
        loads.append(load)
    return x, bufs, loads


def _embed(embed: Float[Array, "V E"] | Packed, token_ids: Int[Array, "T"],
           tp: bool) -> Float[Array, "T E"]:
    """Embedding rows: a vocabulary-split table's under tensor parallelism, else the table's
    (read back from its panels when packed: `pack_params`)."""
    if tp:
        return tp_lib.embed_lookup(embed, token_ids)
    return cpu_matmul.rows(embed, token_ids)


def _outputs(params: Params, x: Float[Array, "T E"], query_start: Int[Array, "Q"],
             config: ModelConfig, tp: bool, all_logits: bool, with_hidden: bool):
    """The final norm, then logits (every token's or each sequence's last) and, with_hidden,
    each sequence's last normed hidden state."""
    last = jnp.clip(query_start[1:] - 1, 0)
    x = rms_norm(x if all_logits else x[last], params["final_norm"], config.rms_norm_eps)
    logits = _logits(params, x, config, tp)
    if with_hidden:  # the residual stream is whole on every device, so no gather under tp
        return logits, (x[last] if all_logits else x).astype(jnp.float32)
    return logits


def _logits(params: Params, x: Float[Array, "T E"], config: ModelConfig,
            tp: bool) -> Float[Array, "T V"]:
    """LM head on final-normed x (tied embeddings when there is no lm_head); fp32. `tp`:
    this device's vocabulary slice, gathered over the mesh. Both heads are [V, E], the
    [out, in] layout XLA:CPU's dots read fastest at small batch (module docstring)."""
    logits = linear(x, params["lm_head"] if "lm_head" in params else params["embed"])
    if tp:
        logits = tp_lib.gather_logits(logits, config.vocab_size)
    return logits.astype(jnp.float32)


@functools.lru_cache(maxsize=64)
def make_forward(
    config: ModelConfig, max_q: int, backend: str = "reference", all_logits: bool = False,
    router_load: bool = False,
):
    """`forward` jitted for one (config, max_q, backend, all_logits, router_load), the cache
    donated.

    The returned function takes the positional arguments of `forward`; it compiles once per
    distinct input shape (the engine pads to a few buckets).
    """
    fn = functools.partial(
        forward, config=config, max_q=max_q, backend=backend, all_logits=all_logits,
        router_load=router_load)
    return jax.jit(fn, donate_argnums=(1,))

