"""The runner's parameters as the forward runs them: which matmul the projections use, one
laid-out copy shared by the runners built on the same arrays, and a user's own module's
params (paged_jax/nn), which run as given.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

from kernels import cpu_matmul
from paged_jax import compile_cache
from paged_jax.engine.config import EngineConfig
from paged_jax.models import Params


def params_dtype(params: Params) -> jnp.dtype:
    """The compute dtype: the first floating-point array's (a module's state may hold
    integer counters ahead of its weights)."""
    leaves = jax.tree.leaves(params)
    return next((x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)),
                leaves[0].dtype)


def matmul_backend(requested: str | None, dtype) -> str:
    """The projections' matmul (EngineConfig.matmul_backend): "cpu" (packed C++ kernel)
    where it applies (a CPU platform, float32 or bfloat16 weights; under tensor parallelism
    each device packs its own shard) and builds, else "xla".

    Raises:
      ValueError: "cpu" asked for where it does not apply or did not build.
    """
    if requested == "xla":
        return "xla"
    fits = jax.default_backend() == "cpu" and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
    built = fits and cpu_matmul.load(str(compile_cache.kernel_folder()))
    if requested == "cpu" and not built:
        raise ValueError("the CPU matmul kernel (matmul_backend='cpu', and quantization "
                         "'int8' / 'int4', which run on it) needs float32 or bfloat16 weights "
                         "on CPU devices and its C++ kernel (kernels/cpu_matmul.py) built; "
                         "use 'xla'")
    return "cpu" if built else "xla"


def choose_matmul(ec: EngineConfig, dtype, own_forward: bool) -> tuple[str, str]:
    """(matmul backend, the packed weights' type) of a runner. A user's module
    (`own_forward`) runs its own matmuls: "xla". Quantized on a GPU: the Pallas kernel
    (quantize_params), not the C++ one. The model's bfloat16 stays bfloat16 in the C++
    kernel (half the bytes, AVX-512 BF16 dot products), with float32 activations."""
    gpu_quant = ec.quantization is not None and jax.default_backend() == "gpu"
    if gpu_quant and ec.tensor_parallel_size > 1:
        raise ValueError("quantization on a GPU runs on one device for now")
    matmul = "xla" if gpu_quant or own_forward else matmul_backend(
        "cpu" if ec.quantization else ec.matmul_backend, dtype)
    return matmul, ec.quantization or (
        "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32")


def refuse_for_own_model(ec: EngineConfig, draft: object | None) -> None:
    """The engine settings a user's own module (paged_jax/nn) does not run with, each named
    in a ValueError: they rewrite the params' layout (tensor parallelism's shards, packed or
    quantized weights), add to the forward (LoRA's deltas) or run a second forward (a draft
    model), all of which assume our decoder's params."""
    asked = {"tensor_parallel_size > 1": ec.tensor_parallel_size > 1,
             "quantization": ec.quantization is not None,
             "matmul_backend='cpu'": ec.matmul_backend == "cpu",
             "enable_lora": ec.lora is not None,
             "a draft model (speculative_config 'model')": draft is not None}
    if bad := [k for k, v in asked.items() if v]:
        raise ValueError(f"a user's own model (a Flax module) does not support {bad}: "
                         "its params run as given, with its own forward")


class Weights:
    """Laid-out parameters, held by the runners that use them (weakly by `_LAID_OUT`)."""

    def __init__(self, params: Params):
        self.params = params


_LAID_OUT: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}


def shared_weights(params: Params, key: tuple, build) -> Weights:
    """`build()`'s laid-out parameters, built once for the same checkpoint arrays and `key`
    (layout, device) while some runner holds them: engines beside each other on one loaded
    model (an experiment's sides, a draft model's several configs) share one copy of the
    weights, which no call ever writes (a second fp32 1.5B copy would not fit beside the
    first in 24 GiB)."""
    leaf = jax.tree.leaves(params)[0]
    k = (id(leaf), *key)
    if (hit := _LAID_OUT.get(k)) and hit[0]() is leaf and (held := hit[1]()) is not None:
        return held
    for stale in [x for x, (a, b) in _LAID_OUT.items() if a() is None or b() is None]:
        del _LAID_OUT[stale]
    held = Weights(build())
    _LAID_OUT[k] = (weakref.ref(leaf), weakref.ref(held))
    return held
