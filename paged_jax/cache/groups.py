"""KV cache groups: layers of one attention type share page tables; sliding-window groups keep
only their window's blocks (vLLM V1's hybrid KV cache manager, SGLang's SWA pool).

Gemma 3 270M has 15 sliding-window layers (window 512) and 3 full-attention ones. Giving every
layer the whole sequence's blocks wastes what the local layers never read again. Here the
layers are cut into groups of equal size G_size, each group of one attention type:

    layers:   L0  L1  L2  L3  L4  L5* L6  L7 ...  L17*       (* full attention)
    groups:   g0 = (L0 L1 L2)  g1 = (L3 L4 L6)  ...  g5 = (L5 L11 L17)
    buffers:  b0 holds L0, L3, ..., L5;  b1 holds L1, L4, ..., L11;  b2 ...

One pool of block ids serves every group: a block id names one [H, K, D] page in each of the
G_size buffers (the group's layers), and each group has its own page table row per sequence.
So the pool never has to be split between groups ahead of time (one pool per group would
need a guess of the mix of short and long sequences), and a model without windows is one
group whose buffers are its layers: exactly the layout before groups existed.

Why equal sizes: a block must cost the same whatever group takes it. G_size is the gcd of the
layer counts per attention type (3 for Gemma 3 270M: 5 sliding groups + 1 full).

A sliding group's sequence of length n keeps columns first_kept(n) .. ceil(n / K) - 1: the
next query (position n) sees keys n - w + 1 .. n, so a block wholly before n - w + 1 is never
read again and its reference is dropped (page_table.slide) once a step's lengths are final.
"""

from __future__ import annotations

import dataclasses
import math

from paged_jax.sizes import cdiv


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """How a model's layers map onto KV cache groups and page buffers (static, hashable).

    Attributes:
      windows: per group, its sliding window, or None (full attention: keeps every block).
      layer_group: per layer, the group whose page table it reads.
      layer_buffer: per layer, the buffer (one [H, N, K, D] array per K and V) holding it.
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_buffer: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_buffers(self) -> int:
        return max(self.layer_buffer) + 1

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def full_group(self) -> int | None:
        """A full-attention group (its page tables hold every block of a sequence), or None
        when every group slides."""
        return next((g for g, w in enumerate(self.windows) if w is None), None)


def single_group(num_layers: int) -> KVGroups:
    """Every layer in one full-attention group, each layer its own buffer (no windows)."""
    return KVGroups((None,), (0,) * num_layers, tuple(range(num_layers)))


def plan_groups(layer_windows: tuple[int | None, ...]) -> KVGroups:
    """Groups of equal size over the layers, each of one window (None = full attention).

    Layers of one type are taken in order, G_size at a time (G_size = gcd of the counts per
    type); a group's i-th layer lives in buffer i. Layers without any window give one group.
    """
    if all(w is None for w in layer_windows):
        return single_group(len(layer_windows))
    types = list(dict.fromkeys(layer_windows))  # first-seen order
    members = {t: [i for i, w in enumerate(layer_windows) if w == t] for t in types}
    size = math.gcd(*(len(m) for m in members.values()))
    windows, group, buffer = [], [0] * len(layer_windows), [0] * len(layer_windows)
    for t in types:
        for start in range(0, len(members[t]), size):
            for j, layer in enumerate(members[t][start:start + size]):
                group[layer], buffer[layer] = len(windows), j
            windows.append(t)
    return KVGroups(tuple(windows), tuple(group), tuple(buffer))


def first_kept(length, window: int | None, block_size: int):
    """First page column a group keeps for a sequence of `length` tokens (host ints or
    arrays): 0 without a window, else the block of position length - window + 1."""
    if window is None:
        return length * 0
    lo = (length - window + 1) // block_size
    return lo * (lo > 0)


def blocks_held(length: int, window: int | None, block_size: int) -> int:
    """Blocks one group holds for a sequence of `length` computed tokens (after its slide)."""
    return cdiv(length, block_size) - first_kept(length, window, block_size)
