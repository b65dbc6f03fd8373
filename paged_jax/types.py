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

from jaxtyping import Array, Bool, Float, Int, Shaped

__all__ = ["Array", "Bool", "Float", "Int", "Shaped"]

NULL_BLOCK = 0
"""Block 0 is the zero block: never allocated or freed; padding table entries point at it."""

PAD_POSITION = -1
"""Cache position of a padding token: its K/V write is dropped."""
