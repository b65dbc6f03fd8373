"""A prefill and a decode step through either forward (ours or a module's), for comparing
the NNX port with the functional decoder (tests/test_nn.py, tests/test_nn_smollm2.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache.groups import plan_groups
from paged_jax.cache.kv_cache import init_kv_cache

BLOCK = 8


def two_steps(config, fwd, params, kv_dtype, hybrid: bool,
              prompt: list[int] | None = None) -> list[np.ndarray]:
    """A prefill of `prompt` (default 13 tokens; at most 23) then one decode step of one
    sequence through `fwd` (pages 1..3, each buffer's K read back): [prefill logits, decode
    logits, K of every buffer]."""
    groups = plan_groups(tuple(config.window(i) for i in range(config.num_layers)))
    groups = groups if hybrid and groups.hybrid else None
    cache = init_kv_cache(config.num_layers, config.num_kv_heads, 8, BLOCK, config.head_dim,
                          kv_dtype, groups)
    g = groups.num_groups if groups else 1
    tables = jnp.asarray([[[1, 2, 3]]] * g, jnp.int32)
    call = jax.jit(functools.partial(fwd, config=config, all_logits=True),
                   static_argnames=("max_q",))
    ids = jnp.asarray(prompt or list(range(40, 53)), jnp.int32)
    t = ids.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    slots = jnp.stack([pos + BLOCK] * g)
    a, cache = call(params, cache, ids, pos, slots, tables, jnp.asarray([t], jnp.int32),
                    jnp.asarray([0, t], jnp.int32), max_q=t)
    one = jnp.asarray([t], jnp.int32)
    b, cache = call(params, cache, jnp.asarray([7], jnp.int32), one,
                    jnp.stack([one + BLOCK] * g), tables, one + 1,
                    jnp.asarray([0, 1], jnp.int32), max_q=1)
    return [np.asarray(a), np.asarray(b), *(np.asarray(cache.buffer(i)[0].take(
        jnp.arange(8))) for i in range(cache.num_layers))]


def assert_close(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    """Within `tol` of the values' scale (float32: the two decoders' matmuls sum in
    different orders, [in, out] against fused [out, in] weights)."""
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max())
