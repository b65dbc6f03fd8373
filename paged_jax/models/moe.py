"""Mixture-of-experts MLP: token-level routing inside the decoder (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE).

A linear router scores the X experts for every token; the token goes to its k best (softmax
over all X, the top k kept, renormalised to 1 when config.norm_topk_prob) and its MLP output
is the weighted sum of those k experts' SwiGLU MLPs (plus Qwen2-MoE's shared expert, scaled by
a sigmoid gate). Three ways to run the experts, all static-shaped (no recompilation as the
token-to-expert mix changes) and none dropping a token:

  grouped     (default) the T*k (token, expert) pairs sorted by expert; each expert runs its
              own rows in tiles of `tile_rows` rows, as many tiles as it got (a while loop
              with a data-dependent trip count, so the shapes stay fixed). Work: T*k rows plus
              at most one partial tile per expert; each expert's weights read in place.
  dense       every expert on every token, weighted by the router (zero for the unchosen):
              X/k times the work; the reference the other two are tested against.
  ragged_dot  `jax.lax.ragged_dot` over the sorted rows: a grouped matmul on backends that
              have one; XLA:CPU expands it to a dense masked product (slower than "dense").

Expert parallelism (inside the tensor-parallel shard_map, models/parallel.py): each device
holds X/N experts; every device routes every token (the residual stream is whole on each),
runs only the pairs whose expert it holds (the others go to an extra group that is never
computed, with weight 0), and the partial outputs are added over the mesh by one psum, the
one a dense MLP's row-split w_down needs anyway. The shared expert is split by width like a
dense MLP.

Runtime-form layer weights (models/llama.py): router [X, E], e_gate_up [X, 2F, E], e_down
[X, E, F]; shared expert s_gate_up [2Fs, E], s_down [E, Fs], s_router [1, E].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.models import parallel as tp_lib
from paged_jax.models.config import ModelConfig
from paged_jax.types import Array, Float, Int

Params = dict


def route(
    x: Float[Array, "T E"], router: Float[Array, "X E"], k: int, normalize: bool
) -> tuple[Float[Array, "T k"], Int[Array, "T k"]]:
    """(weights fp32, expert ids) of each token's k best experts, best first."""
    logits = jax.lax.dot_general(x, router, (((1,), (1,)), ((), ()))).astype(jnp.float32)
    top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts.astype(jnp.int32)


def expert_load(experts: Int[Array, "T k"], valid: Array, num_experts: int) -> Int[Array, "X"]:
    """Tokens sent to each expert, counting only `valid` [T] tokens (not padding)."""
    hits = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32) * valid[:, None, None]
    return hits.sum((0, 1))


def _mlp(x: Array, gate_up: Array, down: Array, act) -> Array:
    """SwiGLU MLP of [out, in] weights: down(act(gate(x)) * up(x))."""
    dot = lambda a, w: jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())))  # noqa: E731
    gate, up = jnp.split(dot(x, gate_up), 2, axis=-1)
    return dot(act(gate) * up, down)


def dense_experts(x: Float[Array, "T E"], p: Params, weights: Float[Array, "T k"],
                  experts: Int[Array, "T k"], act) -> Float[Array, "T E"]:
    """Every expert on every token; ids >= X (other devices' experts) weigh nothing."""
    num = p["e_gate_up"].shape[0]
    combine = jnp.sum(jax.nn.one_hot(experts, num, dtype=jnp.float32) * weights[..., None], 1)
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(num):
        y = _mlp(x, p["e_gate_up"][e], p["e_down"][e], act)
        out = out + combine[:, e:e + 1] * y.astype(jnp.float32)
    return out.astype(x.dtype)


def _sorted_pairs(experts: Int[Array, "T k"], num: int):
    """The (token, slot) pairs sorted by expert: (order [T*k], group sizes [num + 1]); ids
    >= num land in the last group."""
    flat = jnp.minimum(experts.reshape(-1), num)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num + 1)


def tile_rows(pairs: int, num_experts: int) -> int:
    """Rows per tile of the grouped path: about one expert's share of the pairs, a power of
    two in [8, 64] (a partial tile per expert wastes at most that many rows)."""
    share = max(1, pairs // max(1, num_experts))
    return int(min(64, max(8, 1 << (share.bit_length() - 1))))


def grouped_experts(x: Float[Array, "T E"], p: Params, weights: Float[Array, "T k"],
                    experts: Int[Array, "T k"], act) -> Float[Array, "T E"]:
    """Each expert on its own sorted rows, tile by tile (module docstring)."""
    num, (t, e), k = p["e_gate_up"].shape[0], x.shape, experts.shape[1]
    order, sizes = _sorted_pairs(experts, num)
    token = order // k
    m = tile_rows(t * k, num)
    rows = jnp.concatenate([x[token], jnp.zeros((m, e), x.dtype)])  # a tile may run past
    starts = jnp.cumsum(sizes) - sizes
    out = jnp.zeros((t * k + m, e), x.dtype)
    for j in range(num):  # unrolled: expert j's weights are read where they are
        def tile(i, out, j=j):
            at = starts[j] + i * m
            y = _mlp(jax.lax.dynamic_slice_in_dim(rows, at, m), p["e_gate_up"][j],
                     p["e_down"][j], act)
            mine = (jnp.arange(m) + i * m < sizes[j])[:, None]
            old = jax.lax.dynamic_slice_in_dim(out, at, m)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), at, 0)
        out = jax.lax.fori_loop(0, (sizes[j] + m - 1) // m, tile, out)
    scale = weights.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(out[:t * k] * scale)


def ragged_experts(x: Float[Array, "T E"], p: Params, weights: Float[Array, "T k"],
                   experts: Int[Array, "T k"], act) -> Float[Array, "T E"]:
    """The sorted rows through `jax.lax.ragged_dot` (one grouped matmul per projection)."""
    num, k = p["e_gate_up"].shape[0], experts.shape[1]
    order, sizes = _sorted_pairs(experts, num)
    token, sizes = order // k, sizes[:num]  # the last group's rows are left out (zeros)
    h = jax.lax.ragged_dot(x[token], p["e_gate_up"].swapaxes(1, 2), sizes)
    gate, up = jnp.split(h, 2, axis=-1)
    y = jax.lax.ragged_dot(act(gate) * up, p["e_down"].swapaxes(1, 2), sizes)
    scale = weights.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(y * scale)


IMPLS = {"grouped": grouped_experts, "dense": dense_experts, "ragged_dot": ragged_experts}


def _local(weights: Array, experts: Array, num_local: int) -> tuple[Array, Array]:
    """This device's pairs under expert parallelism: ids of its experts made local, the rest
    sent to group `num_local` (never computed) with weight 0."""
    local = experts - jax.lax.axis_index(tp_lib.AXIS) * num_local
    mine = (local >= 0) & (local < num_local)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, local, num_local)


def moe_block(p: Params, x: Float[Array, "T E"], config: ModelConfig, valid: Array,
              tp: bool = False) -> tuple[Float[Array, "T E"], Int[Array, "X"]]:
    """The routed experts' output for each token (the shared expert is the decoder's: it is
    a gated MLP like a dense layer's) and the expert load (tokens per expert among `valid`).

    `tp`: inside the mesh's shard_map; the output is then this device's experts' part, which
    the caller adds over the mesh (module docstring)."""
    weights, experts = route(x, p["router"], config.num_experts_per_tok,
                             config.norm_topk_prob)
    load = expert_load(experts, valid, p["router"].shape[0])
    if tp:
        weights, experts = _local(weights, experts, p["e_gate_up"].shape[0])
    return IMPLS[config.moe_impl](x, p, weights, experts, jax.nn.silu), load
