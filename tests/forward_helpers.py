"""One prefill of the tiny model through `models.llama.forward` on a fresh paged cache: the
logits of every token, for comparing parameter forms (packed, quantized, float)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache.kv_cache import init_kv_cache
from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import forward, prepare_params


def prefill_logits(config: ModelConfig, t: int = 5):
    """A function params -> [t, V] logits of a t-token prompt (one sequence, pages 1 and 2;
    page 0 is the zero block), jitted once per call of this function."""
    args = (jnp.arange(t, dtype=jnp.int32) + 3, jnp.arange(t, dtype=jnp.int32),
            jnp.arange(t, dtype=jnp.int32) + config.head_dim, jnp.asarray([[1, 2]], jnp.int32),
            jnp.asarray([t], jnp.int32), jnp.asarray([0, t], jnp.int32))
    fwd = jax.jit(lambda p, c: forward(p, c, *args, config=config, max_q=t, all_logits=True))

    def logits(params) -> np.ndarray:
        cache = init_kv_cache(config.num_layers, config.num_kv_heads, 4, config.head_dim,
                              config.head_dim, jnp.float32)
        return np.asarray(fwd(prepare_params(params), cache)[0])

    return logits
