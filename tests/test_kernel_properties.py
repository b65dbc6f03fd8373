"""Kernel properties over the shapes the engine meets: hypothesis draws the block size, the KV
heads and the query heads per KV head (including groups that are not powers of two: the
kernels pad G to the next power of two), the head dim, the number of sequences and pages, a
ragged mix of prefill chunks and decodes, shared blocks, and fp32 / bf16; every kernel
variant that accepts the shape must match the jnp reference, and never read what no
sequence may see (those positions hold NaN).

Each drawn shape compiles anew in interpret mode, so examples are few but every one is new.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.paged_attention import DOT_MIN, decode_attention, decode_reference
from kernels.ragged_paged_attention import ragged_paged_attention, ragged_reference
from tests.attention_helpers import jitted

TOL = {"float32": 2e-5, "bfloat16": 3e-2}


@st.composite
def problems(draw, max_q_choices=(1, 2, 5, 8)) -> dict:
    """Shapes and data of one attention call."""
    block = draw(st.sampled_from([8, 16, 32]))
    h = draw(st.sampled_from([1, 2, 4]))
    g = draw(st.sampled_from([1, 2, 3, 5, 6, 8]))
    s, p = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    max_q = draw(st.sampled_from(max_q_choices))
    lens = np.array(draw(st.lists(st.integers(0, p * block), min_size=s, max_size=s)))
    num_q = np.array([draw(st.integers(min(1, x), min(max_q, x))) for x in lens])
    return dict(block=block, h=h, g=g, d=draw(st.sampled_from([32, 64])), s=s, p=p,
                max_q=max_q, lens=lens, num_q=num_q,
                dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                share=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def build(pr: dict) -> tuple:
    """(q, k, v, tables, lens, query_start): shuffled pool, NaN wherever no sequence looks."""
    block, h, d, s, p = pr["block"], pr["h"], pr["d"], pr["s"], pr["p"]
    rng = np.random.default_rng(pr["seed"])
    n = s * p + 2
    held = -(-pr["lens"] // block)
    tables = np.zeros((s, p), np.int32)
    tables[np.arange(p)[None, :] < held[:, None]] = rng.permutation(np.arange(1, n))[: held.sum()]
    if pr["share"] and s > 1 and held[0] > 1 and held[1] > 1:
        tables[1, 0] = tables[0, 0]  # a full block shared by two sequences (a fork)
    k, v = (rng.standard_normal((h, n, block, d)).astype(np.float32) for _ in range(2))
    seen = np.zeros((n, block), bool)
    for i in range(s):
        for pos in range(pr["lens"][i]):
            seen[tables[i, pos // block], pos % block] = True
    k[:, ~seen], v[:, ~seen] = np.nan, np.nan
    qs = np.concatenate([[0], np.cumsum(pr["num_q"])]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]) + 3, h * pr["g"], d)).astype(np.float32)
    dt = jnp.dtype(pr["dtype"])
    return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(tables),
            jnp.asarray(pr["lens"], jnp.int32), jnp.asarray(qs))


def close(out, ref, dtype: str) -> None:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "a masked NaN reached the output"
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# Each example runs the kernels in the interpreter (seconds): the fast tier searches a few,
# the slow tier's twins (`_deep`, tests/conftest.py) many more.
SETTINGS = settings(max_examples=4, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DEEP = settings(SETTINGS, max_examples=12)


def ragged_matches(pr):
    batch = build(pr)
    ref = jitted(ragged_reference, max_q=pr["max_q"])(*batch)
    for variant in ("grouped", "dot") if pr["block"] >= DOT_MIN else ("grouped",):
        close(ragged_paged_attention(*batch, max_q=pr["max_q"], variant=variant), ref,
              pr["dtype"])


def decode_matches(pr):
    q, k, v, tables, lens, qs = build(pr)
    args = (q[qs[:-1]], k, v, tables, lens)  # one query per sequence: its first
    ref = jitted(decode_reference)(*args)
    variants = ["grouped", "split"] + (["dot"] if pr["block"] >= DOT_MIN else [])
    for variant in variants:
        close(decode_attention(*args, variant=variant, num_splits=2), ref, pr["dtype"])


test_ragged_kernel_matches_reference = SETTINGS(given(pr=problems())(ragged_matches))
test_ragged_kernel_matches_reference_deep = DEEP(given(pr=problems())(ragged_matches))
test_decode_kernel_matches_reference = SETTINGS(
    given(pr=problems(max_q_choices=(1,)))(decode_matches))
test_decode_kernel_matches_reference_deep = DEEP(
    given(pr=problems(max_q_choices=(1,)))(decode_matches))
