"""Params' two forms and the conversions between them (models/llama.py's docstring says what
each holds and why): the checkpoint form loaders build (layers stacked), the runtime form
the forward is fast on (`prepare_params`: a list of per-layer dicts, q|k|v and gate|up fused,
projections [out, in]), and the runtime form with its projections packed for the C++ CPU
matmul kernel (`pack_params`) or quantized for the GPU kernel (`quantize_params`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpu_matmul
from kernels.cpu_matmul import Packed
from kernels.quant_matmul import quantize
from paged_jax import compile_cache
from paged_jax.models import parallel as tp_lib

Params = dict[str, Any]

FUSED = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"),
         "w_gate_up": ("w_gate", "w_up"), "e_gate_up": ("e_gate", "e_up"),
         "s_gate_up": ("s_gate", "s_up")}
"""Runtime weight -> the checkpoint weights it concatenates (along the output axis)."""
PROJECTIONS = ("w_qkv", "wo", "w_gate_up", "w_down", "s_gate_up", "s_down")
"""Runtime weights stored [out, in] (module docstring), packed or quantized as matmuls."""
EXPERTS = ("e_gate_up", "e_down", "router", "s_router")
"""Runtime MoE weights stored [out, in] too (per expert), never packed (models/moe.py)."""


def fuse_layer(p: Params, concat=jnp.concatenate) -> Params:
    """One layer in runtime form: q|k|v and gate|up concatenated, projections [out, in]."""
    out = {k: v for k, v in p.items() if not any(k in parts for parts in FUSED.values())}
    for name, parts in FUSED.items():
        if parts[0] in p:
            out[name] = concat([p[x] for x in parts], axis=-1)
    return {k: v.swapaxes(-1, -2) if k in PROJECTIONS + EXPERTS else v for k, v in out.items()}


def runtime_layers(params: Params) -> list[Params]:
    """The per-layer dicts of either params form (slices + concatenation for stacked ones)."""
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        return list(layers)
    n = next(iter(layers.values())).shape[0]
    return [fuse_layer({k: v[i] for k, v in layers.items()}) for i in range(n)]


def prepare_params(params: Params) -> Params:
    """The runtime form of `params` (idempotent; run it once, outside jit).

    Built on the host with numpy, one layer at a time, each moved to the device in one
    transfer: done eagerly on the device, the 30 x 9 slices and concatenations cost a dispatch
    each (seconds); done for all layers at once, the host copies peak at twice the weights.
    """
    return {**{k: v for k, v in params.items() if k != "layers"},
            "layers": list(_runtime_layers(params))}


def _runtime_layers(params: Params):
    """Yields each layer in runtime form, built when asked (module docstring of
    prepare_params), so a caller that transforms each (packing) holds one float copy."""
    if isinstance(params["layers"], list | tuple):
        yield from params["layers"]
        return
    stacked = jax.device_get(params["layers"])  # on the CPU a view, no copy
    for i in range(next(iter(stacked.values())).shape[0]):
        fused = fuse_layer({k: v[i] for k, v in stacked.items()}, np.concatenate)
        yield jax.device_put({k: np.ascontiguousarray(v) for k, v in fused.items()})


def pack_params(params: Params, weights: str = "float32") -> Params:
    """Runtime-form params with every projection and the LM head packed for the C++ CPU
    matmul kernel (kernels/cpu_matmul.py; one device: under tensor parallelism see
    parallel.pack_shards), as float32, int8 or int4 `weights`. A tied head packs the
    embedding itself (the lookup reads rows back from its panels: one copy); an untied one is
    packed when quantized. Norms and biases stay float32. Idempotent; packed on the host, a
    layer at a time from stacked params (a 1.5B's whole float32 runtime form beside the
    packed one held 12 GB).

    Raises:
      RuntimeError: the kernel did not build (no C++ compiler, say).
    """
    if not cpu_matmul.load(str(compile_cache.kernel_folder())):
        raise RuntimeError("the CPU matmul kernel did not build (see the warning above)")
    pack = lambda w: w if isinstance(w, Packed) else cpu_matmul.pack(w, weights)  # noqa: E731
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{k: pack(rest[k]) for k in tp_lib.packed_tables(rest, weights)},
            "layers": [{k: pack(v) if k in PROJECTIONS else v for k, v in p.items()}
                       for p in _runtime_layers(params)]}


def quantize_params(params: Params, weights: str) -> Params:
    """Runtime-form params with every projection and the LM head as `weights` ("int8" /
    "int4") codes for the GPU kernel (kernels/quant_matmul.py), quantized on the host; a tied
    head gets a quantized copy, the lookup keeps the float table."""
    params = prepare_params(params)
    quant = lambda w: quantize(np.asarray(w, np.float32), weights)  # noqa: E731
    head = params.get("lm_head", params["embed"])
    return {**params, "lm_head": quant(head),
            "layers": [{k: quant(v) if k in PROJECTIONS else v for k, v in p.items()}
                       for p in params["layers"]]}
