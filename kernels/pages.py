"""What a kernel reads for one layer's K (or V): the pool's pages as they are stored.

    dtype       stored as            scale
    float32     float32              none
    bfloat16    bfloat16 or uint16   none
    int8        int8                 float32, Z per token and KV head: value d of a row is
    fp8 (e4m3)  fp8 or uint8         "          q[d] * scale[d // (D / Z)]
    fp8_e5m2    fp8 or uint8         "          (groups of D / Z consecutive values)

Why the bits: XLA:CPU scatters into a bfloat16 / fp8 array by converting the whole array to
float32 and back (7-10 ms per layer-sized write, against 0.02 ms into an integer array of the
same width), so the engine's pool keeps those pages as uint16 / uint8 (paged_jax/cache/kv_quant.py).
And XLA:CPU also copies for a bitcast of a whole array, so no kernel takes a viewed pool: each
one views what it has gathered or loaded (`view`), the C++ kernel reads the bits directly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """[H, N, K, D] stored values, optional [H, N, K, Z] scales (Z groups of D / Z values per
    token), and what the values hold (`dtype`, static)."""

    values: Shaped[Array, "H N K D"]
    scale: Float[Array, "H N K Z"] | None = None
    dtype: np.dtype = dataclasses.field(default=np.dtype(np.float32),
                                        metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def take(self, idx) -> Array:
        """values[:, idx] in float32 ([H, *idx.shape, K, D]), dequantized: a step converts
        what it reads, never the pool."""
        x = view(self.values[:, idx], self.dtype).astype(jnp.float32)
        if self.scale is None:
            return x
        s = self.scale[:, idx]  # [..., K, Z]: each scale covers D / Z values of its row
        g, d = s.shape[-1], x.shape[-1]
        return (x.reshape(*x.shape[:-1], g, d // g) * s[..., None]).reshape(x.shape)


PagesLike = Float[Array, "H N K D"] | tuple[Shaped[Array, "H N K D"],
                                             Float[Array, "H N K Z"]] | Pages
"""What the attention functions accept: float pages, a (quantized values, scales) pair, or
`Pages` (the engine's, possibly stored as bits)."""


def as_pages(x: PagesLike) -> Pages:
    """Any accepted form as `Pages`."""
    if isinstance(x, Pages):
        return x
    if isinstance(x, tuple):
        return Pages(x[0], x[1], np.dtype(x[0].dtype))
    return Pages(x, None, np.dtype(x.dtype))


def view(x: Array, dtype) -> Array:
    """x (stored values, or their bits) seen as `dtype`."""
    dt = jnp.dtype(dtype)
    return x if x.dtype == dt else jax.lax.bitcast_convert_type(x, dt)
