"""The project's two size rules, for host ints and device arrays alike."""

from __future__ import annotations


def cdiv(a, b):
    """Ceiling division: blocks of `b` tokens holding `a` tokens."""
    return -(-a // b)


def next_pow2(n: int, lo: int = 1) -> int:
    """Smallest power of two >= max(n, lo): the shape buckets."""
    return 1 << (max(n, lo) - 1).bit_length()
