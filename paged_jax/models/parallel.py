"""Tensor parallelism (Megatron-style) over a 1-D "model" mesh of N devices.

    params    q|k|v and gate|up outputs split by head / by F, wo and w_down inputs split,
              embed and lm_head split by vocabulary; norms replicated
    KV pool   every layer's [H, N, K, D] pages split on H: each device holds its KV heads
    forward   runs per device under `shard_map` (attention kernels included, on the local
              heads); one psum after attention's wo and one after the MLP's w_down per layer,
              one psum for the embedding lookup and one all-gather of the logits
    the rest  page tables, the block pool's bookkeeping and sampling: replicated, the same
              pure functions on every device (the allocator does not know about the mesh)
    MoE       experts split on their expert axis (expert parallelism), the router replicated:
              each device runs its experts' share of the (token, expert) pairs and the psum
              after the MLP joins them (models/moe.py); a shared expert splits like an MLP

Heads are split evenly: N must divide the query heads and the MLP width, and either divide
the KV heads or be a multiple of them. When N exceeds the KV heads, each KV head is
replicated on N / H devices (each device holds one), so a device holds 1 / H of the
unreplicated pool instead of 1 / N. Device i holds query heads [i Q/N, (i+1) Q/N) and KV
head i H/N (GQA groups stay whole on a device).

Params are re-laid out on the host once (`shard_params`): the fused q|k|v and gate|up outputs
(rows of the runtime form's [out, in] weights) are reordered so that device i's slice of the
output axis is its own q|k|v (gate|up) in the layout the unsharded forward expects, and the
vocabulary is zero-padded to a multiple of N.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import cpu_matmul, weight_codes
from kernels.cpu_matmul import Packed

if TYPE_CHECKING:  # models import this module (the forward's collectives)
    from paged_jax.models.config import ModelConfig

AXIS = "model"

# Runtime layer weights ([out, in]) split by the mesh, and the axis they are split on; the
# rest of a layer (norms, bo) is replicated.
# Mixture-of-experts layers split their experts (expert parallelism: models/moe.py) and the
# shared expert's width; the router is replicated.
_LAYER_AXIS = {"w_qkv": 0, "b_qkv": 0, "wo": 1, "w_gate_up": 0, "w_down": 1,
               "e_gate_up": 0, "e_down": 0, "s_gate_up": 0, "s_down": 1}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model splits over n devices."""

    n: int
    num_heads: int  # query heads per device
    num_kv_heads: int  # KV heads per device
    kv_heads_total: int  # KV heads in the pool (H, or n when they are replicated)
    kv_replicas: int  # devices holding each KV head (n / H when n > H, else 1)
    vocab: int  # padded vocabulary, a multiple of n


def layout(config: ModelConfig, n: int) -> Layout:
    """The split of `config` over n devices; a ValueError says why it cannot be split."""
    q, h, f = config.num_heads, config.num_kv_heads, config.intermediate_size
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    if q % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the query heads ({q})")
    if config.is_moe:
        _check_moe(config, n)
    elif f % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the MLP width ({f})")
    if h % n and n % h:
        raise ValueError(f"tensor_parallel_size={n} must divide the KV heads ({h}) or be a "
                         "multiple of them")
    total = max(h, n)
    return Layout(n, q // n, total // n, total, max(1, n // h), -(-config.vocab_size // n) * n)


def _check_moe(config: ModelConfig, n: int) -> None:
    x, fs = config.num_experts, config.shared_expert_intermediate_size
    if x % n or fs % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the experts ({x}) and the "
                         f"shared expert's width ({fs})")
    if n > 1 and config.qk_norm and config.qk_norm_span == "all":
        raise ValueError("a q/k norm over all heads (OLMoE) needs every head on one device: "
                         "tensor parallelism is not supported for it")


def local_config(config: ModelConfig, lay: Layout) -> ModelConfig:
    """The config one device's forward sees (its heads and MLP width; an MoE layer routes
    over every expert and finds its own in its weights' shapes)."""
    return dataclasses.replace(config, num_heads=lay.num_heads, num_kv_heads=lay.num_kv_heads,
                               intermediate_size=config.intermediate_size // lay.n)


def devices(n: int, first: int = 0) -> list:
    """Devices first .. first + n - 1 (a clear error when there are fewer)."""
    devs = jax.devices()
    if first + n > len(devs):
        raise ValueError(f"{first + n} devices are needed (tensor_parallel_size x "
                         f"data_parallel_size); {len(devs)} {devs[0].platform} device(s) are "
                         "visible (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_"
                         f"count={first + n} before jax starts)")
    return devs[first:first + n]


def make_mesh(n: int, first: int = 0) -> Mesh:
    """A 1-D "model" mesh over devices first .. first + n - 1."""
    return Mesh(np.array(devices(n, first)), (AXIS,))


def _kv_heads(w: np.ndarray, h: int, d: int, lay: Layout) -> np.ndarray:
    """[..., H*D] KV columns -> [..., kv_heads_total*D], heads repeated when replicated."""
    heads = w.reshape(*w.shape[:-1], h, d)
    idx = np.arange(lay.kv_heads_total) * h // lay.kv_heads_total
    return heads[..., idx, :].reshape(*w.shape[:-1], lay.kv_heads_total * d)


def _interleave(parts: list[np.ndarray], n: int) -> np.ndarray:
    """Concatenates, for each device i, the i-th n-th of every part (along the last axis)."""
    return np.concatenate([c for i in range(n) for c in (np.split(p, n, -1)[i] for p in parts)],
                          -1)


def _layer(p: dict, config: ModelConfig, lay: Layout) -> dict:
    """One runtime-form layer's outputs reordered per device (worked on as [in, out])."""
    q, h, d = config.num_heads * config.head_dim, config.num_kv_heads, config.head_dim
    out = dict(p)
    for name in ("w_qkv", "b_qkv"):
        if name in p:
            w = p[name].T  # [in, out] (a bias is 1-D: itself)
            k, v = w[..., q:q + h * d], w[..., q + h * d:]
            out[name] = _interleave([w[..., :q], _kv_heads(k, h, d, lay),
                                     _kv_heads(v, h, d, lay)], lay.n).T
    for name in ("w_gate_up", "s_gate_up"):
        if name in p:
            gate, up = np.split(p[name].T, 2, -1)
            out[name] = _interleave([gate, up], lay.n).T
    return out


def _pad_vocab(w: np.ndarray, axis: int, vocab: int) -> np.ndarray:
    pad = [(0, 0)] * w.ndim
    pad[axis] = (0, vocab - w.shape[axis])
    return np.pad(w, pad)


def specs(params: dict) -> dict:
    """PartitionSpecs of runtime-form params (as `shard_params` lays them out; packed
    weights as `pack_shards` does)."""
    def split(v, axis: int):
        if isinstance(v, Packed):
            return _packed_spec(axis)
        return P(*[AXIS if i == axis else None for i in range(v.ndim)])

    def layer(p):
        return {k: split(v, _LAYER_AXIS[k]) if k in _LAYER_AXIS else P() for k, v in p.items()}
    out = {k: P() for k in params if k != "layers"}
    out["embed"] = split(params["embed"], 0)
    if "lm_head" in params:
        out["lm_head"] = split(params["lm_head"], 0)
    out["layers"] = [layer(p) for p in params["layers"]]
    return out


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """Runtime-form params laid out for the mesh (module docstring) and placed on it."""
    lay = layout(config, mesh.size)
    host = jax.device_get(params)
    out = {**host, "layers": [_layer(p, config, lay) for p in host["layers"]]}
    out["embed"] = _pad_vocab(host["embed"], 0, lay.vocab)
    if "lm_head" in host:
        out["lm_head"] = _pad_vocab(host["lm_head"], 0, lay.vocab)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(out),
                             is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(out, shardings)


# ---- packed weights (the C++ CPU matmul kernel, kernels/cpu_matmul.py) ------------------------
def packed_tables(params: dict, weights: str) -> list[str]:
    """The head (a tied one is the embedding), and an untied embedding when quantized: it is
    only looked up, but quantized it is held in the codes' bytes, not float32's."""
    if "lm_head" not in params:
        return ["embed"]
    return ["lm_head"] + (["embed"] if weights != "float32" else [])


def _packed_spec(axis: int) -> P:
    """A packed [N, K] weight split on N (axis 0: its panels) or on K (axis 1: each panel's
    rows, and the scales' groups with them): one spec for all its [P, ., .] arrays (a pytree
    prefix of the Packed)."""
    return P(AXIS, None, None) if axis == 0 else P(None, AXIS, None)


def pack_shards(params: dict, mesh: Mesh, weights: str) -> dict:
    """Sharded runtime-form params (`shard_params`) with every split projection and the
    head packed for the C++ matmul kernel: each device's shard is packed on its own, as a
    one-device model of its width would be (its panels, its scale groups), and the shards are
    joined into one array split the same way. Packed.n is the shard's width: the forward runs
    per device. Norms and biases stay as they are."""
    def pack(w, axis: int) -> Packed:
        shards = sorted(w.addressable_shards, key=lambda s: s.index[axis].start or 0)
        whole = functools.partial(cpu_matmul.pack, weights=weights,  # the whole's supers
                                  per_super=weight_codes.per_super(w.shape[1] // 32))
        local = [whole(np.asarray(s.data), device=s.device) for s in shards]
        if len({jax.tree.structure(x) for x in local}) > 1:  # int8: a 4-bit grid on some only
            local = [whole(np.asarray(s.data), device=s.device, keep_grid=False)
                     for s in shards]
        spec = _packed_spec(axis)

        def join(parts, s):  # this process's shards of one array split over the whole mesh
            shape = list(parts[0].shape)
            shape[axis] *= mesh.size
            return jax.make_array_from_single_device_arrays(
                tuple(shape), NamedSharding(mesh, s), parts)
        fields = [[getattr(x, f) for x in local] for f in ("panels", "scales", "mins", "supers")]
        return Packed(join(fields[0], spec), local[0].n,
                      *(None if parts[0] is None else join(parts, spec) for parts in fields[1:]),
                      quantize_x=local[0].quantize_x)

    out = {**params, "layers": [{k: pack(v, _LAYER_AXIS[k]) if k in _LAYER_AXIS and v.ndim == 2
                                 else v for k, v in p.items()} for p in params["layers"]]}
    for name in packed_tables(params, weights):
        out[name] = pack(params[name], 0)
    return out


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def by_head(mesh: Mesh) -> NamedSharding:
    """The KV pool's sharding: every [H, N, K, D] (and scale) array split on H."""
    return NamedSharding(mesh, P(AXIS))


# ---- inside the shard_map'd forward ----------------------------------------------------------
def embed_lookup(embed: jax.Array | Packed, token_ids: jax.Array) -> jax.Array:
    """Rows of a vocabulary-split embedding: each device looks up the ids in its own range
    (zeros elsewhere), one psum joins them. A packed (tied) one reads its panels' rows."""
    rows = embed.shape[0]
    local = token_ids - jax.lax.axis_index(AXIS) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], cpu_matmul.rows(embed, jnp.clip(local, 0, rows - 1)), 0)
    return jax.lax.psum(x, AXIS)


def gather_logits(logits: jax.Array, vocab: int) -> jax.Array:
    """Each device's vocabulary slice of the logits -> the full [T, V] on every device."""
    full = jax.lax.all_gather(logits, AXIS, axis=1, tiled=True)
    return full[:, :vocab]


def sharded_forward(mesh: Mesh | None, forward, config: ModelConfig, params: Mapping, cache,
                    *args, **kw):
    """`forward(params, cache, *args, config=, **kw)` (models.llama.forward) per device, with
    this device's config and tp=True; without a mesh, simply `forward`."""
    if mesh is None:
        return forward(params, cache, *args, config=config, **kw)
    local = local_config(config, layout(config, mesh.size))
    fn = functools.partial(forward, config=local, tp=True, **kw)
    return shard_forward(fn, mesh, params, cache, *args)


def shard_forward(fn, mesh: Mesh, params: dict, cache, *args):
    """`fn(params, cache, *args) -> (logits, cache)` run per device under shard_map: params
    as `specs`, the cache split on its head axis, everything else (and the logits, which
    `fn` gathers) replicated."""
    on_heads = P(AXIS)  # a prefix: every page and scale array of the cache
    per_device = jax.shard_map(fn, mesh=mesh, in_specs=(specs(params), on_heads,
                                                        *(P(),) * len(args)),
                               out_specs=(P(), on_heads), check_vma=False)
    return per_device(params, cache, *args)
