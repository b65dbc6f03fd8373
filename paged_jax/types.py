"""Axis letters used in every jaxtyping annotation of paged-jax, defined once.

    B batch          T tokens (flat, ragged)    S sequence slots     P pages per sequence
    N physical blocks in the pool               K block size (token positions per block)
    H KV heads       Q query heads (H * G)      G query heads per KV head
    D head dim       L layers                   E model width        V vocabulary
    F forks (pairs)  C copy pairs               R query groups (rows or tiles)
    M queries per group (or stop ids per row)   X key positions (P * K)
    J top logprobs per row                      A admitted requests in a step
    W decode steps in a window                  Z quantization scales per row (D / Z values each)

"Slot" means a sequence's row of the page table (S slots). Where a token's K/V lands in the
pool (block * K + offset) is its *cache position*, the values of `cache_positions` (vLLM's
`slot_mapping`).

Shapes are written in annotations as strings, e.g. ``Int[Array, "S P"]``.
"""

import numpy as np
from jaxtyping import Array, Bool, Float, Int, Shaped, UInt

HostArray = Array | np.ndarray
"""Fields of what the host sends into a jitted call (a step's batch, its ops): built as numpy
and passed as they are, since jit copies numpy arguments several times faster than
`jax.device_put` does; inside the call they are traced jax arrays."""

__all__ = ["Array", "Bool", "Float", "HostArray", "Int", "Shaped", "UInt"]

NULL_BLOCK = 0
"""Block 0 is the zero block: never allocated or freed; padding table entries point at it."""

PAD_POSITION = -1
"""Cache position of a padding token: its K/V write is dropped."""
