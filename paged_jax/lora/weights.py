"""Adapter slots on the device: every layer's LoRA weights for N slots, stacked, in the
runtime form the decoder reads (models/llama.py adds `models/lora_ops.lora_delta` of each fused
projection). Shapes depend only on (config, N, max rank), so loading an adapter into a slot
or clearing one changes values, never a compiled program.

Per layer, one entry per fused projection, each (a [N, k*R, in], (b_1, ..., b_k)), b_i
[N, R, out_i] (PEFT's B transposed: the expand runs along the outputs, rank rows of them):

    lora_qkv      q|k|v (k = 3)       lora_o     o_proj
    lora_gate_up  gate|up (k = 2)     lora_down  down_proj

An adapter of rank r < R fills the first r of its R rows / columns (zeros are exact); a target
it does not train stays zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from paged_jax.lora.peft_folder import Adapter, shapes
from paged_jax.models.config import ModelConfig

FUSED = {"lora_qkv": ("q_proj", "k_proj", "v_proj"), "lora_o": ("o_proj",),
         "lora_gate_up": ("gate_proj", "up_proj"), "lora_down": ("down_proj",)}
Slots = list[dict[str, tuple]]


def empty_slots(config: ModelConfig, num_slots: int, rank: int,
                dtype: DTypeLike = jnp.float32) -> Slots:
    """Zeroed slots for every layer (module docstring)."""
    layer = _host_layer(config, num_slots, rank, dtype)
    return [jax.tree.map(jnp.asarray, layer) for _ in range(config.num_layers)]


def _host_layer(config: ModelConfig, n: int, rank: int, dtype) -> dict:
    dims = shapes(config)
    return {name: (np.zeros((n, len(ts) * rank, dims[ts[0]][0]), dtype),
                   tuple(np.zeros((n, rank, dims[t][1]), dtype) for t in ts))
            for name, ts in FUSED.items()}


def slot_values(config: ModelConfig, adapter: Adapter, rank: int, dtype: DTypeLike) -> Slots:
    """One slot's contents per layer (what `write` stores): the adapter's, zeros where it has
    no rank or no target."""
    layers = [_host_layer(config, 1, rank, dtype) for _ in range(config.num_layers)]
    for layer, values in enumerate(layers):
        for name, ts in FUSED.items():
            a, bs = values[name]
            for i, t in enumerate(ts):
                if t not in adapter.weights:
                    continue
                wa, wb = adapter.weights[t]
                r = adapter.rank
                a[0, i * rank:i * rank + r] = wa[layer]
                bs[i][0, :r] = wb[layer].T
    return [jax.tree.map(lambda v: v[0], layer) for layer in layers]


@jax.jit  # not donated: a step still in flight (async scheduling) may read them
def _store(slots: Slots, slot, values: Slots) -> Slots:
    return jax.tree.map(lambda s, v: s.at[slot].set(v), slots, values)


def write(slots: Slots, slot: int, values: Slots) -> Slots:
    """`slots` with slot `slot` holding `values` (slot_values)."""
    return _store(slots, jnp.int32(slot), values)
