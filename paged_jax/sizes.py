"""The project's size rules, for host ints and device arrays alike."""

from __future__ import annotations


def cdiv(a, b):
    """Ceiling division: blocks of `b` tokens holding `a` tokens."""
    return -(-a // b)


def next_pow2(n: int, lo: int = 1) -> int:
    """Smallest power of two >= max(n, lo): the shape buckets."""
    return 1 << (max(n, lo) - 1).bit_length()


def next_half_octave(n: int, lo: int = 1) -> int:
    """Smallest size >= max(n, lo) of the form 2^k or 3 * 2^(k-1) (a prefill step's token
    bucket: padding at most a third of the step, not half; `lo` a power of two)."""
    p = next_pow2(n, lo)
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= max(n, lo) else p


def largest_fitting(n: int, fits) -> int:
    """The largest m <= n with fits(m), for a `fits` that holds up to some size and not past
    it (a chunk's blocks grow with its tokens); 0 when fits(1) does not hold."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
