"""The size rules (paged_jax/sizes.py)."""

from paged_jax.sizes import cdiv, largest_fitting


def test_largest_fitting_finds_the_edge():
    """The largest chunk whose blocks fit, for every edge and bound (a monotone test)."""
    for n in range(0, 40):
        for free in range(0, 12):
            fits = lambda m, f=free: cdiv(m, 4) <= f  # noqa: E731 (blocks of a chunk of m)
            want = max((m for m in range(n + 1) if fits(m)), default=0)
            assert largest_fitting(n, fits) == want, (n, free)
