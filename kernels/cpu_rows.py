"""Row-wise sampling kernels over [S, V] logits, from the CPU matmul kernel's library
(kernels/cpu_argmax.h, cpu_logprobs.h, registered by cpu_matmul.cc; `cpu_matmul.load` builds
it): greedy rows' argmax, with or without min_tokens' blocked ids, and the sampled rows'
logprobs. sample/sampler.py chooses them on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import cpp_build
from kernels.cpu_matmul import TARGET_ARGMAX, TARGET_ARGMAX_BLOCKED, TARGET_LOGPROBS


def row_argmax(x: jax.Array, isa: str | None = None,
               blocked: jax.Array | None = None) -> jax.Array:
    """x [S, V] -> [S] int32, each row's first maximum (a NaN row: its first NaN), as
    jnp.argmax(x, axis=1) answers; with `blocked` [S, B] ids (-1: none), as it answers with
    those entries set to -inf, without writing them. The kernels of cpu_argmax.h (call `load`
    first)."""
    if x.ndim != 2:
        raise ValueError(f"row_argmax: expected x [S, V], got shape {x.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    if blocked is None:
        return jax.ffi.ffi_call(cpp_build.target(TARGET_ARGMAX, isa), out)(
            x.astype(jnp.float32))
    return jax.ffi.ffi_call(cpp_build.target(TARGET_ARGMAX_BLOCKED, isa), out)(
        x.astype(jnp.float32), blocked.astype(jnp.int32))


def row_logprobs(x: jax.Array, tokens: jax.Array, active: jax.Array, num_top: int,
                 isa: str | None = None) -> tuple[jax.Array, ...]:
    """Of each active row of raw logits x [S, V]: log_softmax(x)[token] [S], the token's rank
    [S] (1 + entries above it), the top `num_top` ids [S, J] (ties: the lower id first) and
    their log_softmax [S, J]; inactive rows zeros. The kernel of cpu_logprobs.h (call `load`
    first); sample/logprobs.py's `gather` is the reference."""
    if x.ndim != 2:
        raise ValueError(f"row_logprobs: expected x [S, V], got shape {x.shape}")
    s = x.shape[0]
    out = (jax.ShapeDtypeStruct((s,), jnp.float32), jax.ShapeDtypeStruct((s,), jnp.int32),
           jax.ShapeDtypeStruct((s, num_top), jnp.int32),
           jax.ShapeDtypeStruct((s, num_top), jnp.float32))
    return jax.ffi.ffi_call(cpp_build.target(TARGET_LOGPROBS, isa), out)(
        x.astype(jnp.float32), tokens.astype(jnp.int32), active.astype(jnp.int32))
