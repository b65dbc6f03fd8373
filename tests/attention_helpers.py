"""The attention oracle shared by the reference and kernel tests."""

from __future__ import annotations

import functools

import jax
import numpy as np


def jitted(fn, **static):
    """`fn` with its static keyword arguments, as one jitted program. Called eagerly, a
    reference runs op by op and compiles dozens of small programs per shape, which cost a
    cold test run several times what one program does."""
    return jax.jit(functools.partial(fn, **static))


def naive(q, k_pages, v_pages, tables, lens, query_start, scale, window=None):
    """Token by token, head by head: softmax over keys 0..pos (pos - window + 1..pos with a
    sliding window) in float64."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    out = np.zeros(q.shape, np.float64)
    h, _, kb, _ = k_pages.shape
    group = q.shape[1] // h
    for s in range(len(lens)):
        n = query_start[s + 1] - query_start[s]
        for i in range(n):
            pos = lens[s] - n + i
            seen = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            for j in range(q.shape[1]):
                keys = np.stack([k_pages[j // group, tables[s, x // kb], x % kb] for x in seen])
                vals = np.stack([v_pages[j // group, tables[s, x // kb], x % kb] for x in seen])
                sc = keys @ q[query_start[s] + i, j] * scale
                w = np.exp(sc - sc.max())
                out[query_start[s] + i, j] = (w / w.sum()) @ vals
    return out
