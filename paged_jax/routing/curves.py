"""Quality against the share of requests sent to the strong model, per routing policy.

Given, for N held-out requests, whether the weak and the strong model answer each correctly
(y [N, 2]) and a policy's score per request (higher = more worth the strong model), sending
the top `share` of requests to the strong model gives a quality (the share answered right):

    router   scores = the head's expected gain p_strong - p_weak
    random   the expectation over random choices: (1 - s) acc_weak + s acc_strong
    oracle   knows y: first the requests only the strong model gets right, then the rest
    weak     all on the weak model (share 0); strong: all on the strong model (share 1)

`cost_saved_at` reads the cheapest share whose quality reaches a fraction of the strong
model's, and what it saves against always-strong given each model's cost per request (and
the weak model's prefill, paid by every request the router moves).
"""

from __future__ import annotations

import numpy as np

SHARES = tuple(round(x, 2) for x in np.linspace(0, 1, 11))


def quality_at(y: np.ndarray, scores: np.ndarray, share: float) -> float:
    """Quality when the round(share * N) highest-scoring requests go to the strong model."""
    n = len(y)
    k = int(round(share * n))
    strong = np.zeros(n, bool)
    strong[np.argsort(-scores, kind="stable")[:k]] = True
    return float(np.where(strong, y[:, 1], y[:, 0]).mean())


def curves(y: np.ndarray, router_scores: np.ndarray, shares=SHARES) -> dict[str, list[dict]]:
    """Each policy's curve as [{strong_share, quality}, ...]."""
    acc_w, acc_s = y.mean(0)
    gain = y[:, 1] - y[:, 0]
    pts = lambda f: [dict(strong_share=s, quality=f(s)) for s in shares]  # noqa: E731
    return dict(
        router=pts(lambda s: quality_at(y, router_scores, s)),
        random=pts(lambda s: float((1 - s) * acc_w + s * acc_s)),
        oracle=pts(lambda s: quality_at(y, gain, s)),
        weak=[dict(strong_share=0.0, quality=float(acc_w))],
        strong=[dict(strong_share=1.0, quality=float(acc_s))],
    )


def gap_recovered(curve: list[dict], acc_weak: float, acc_strong: float, share: float) -> float:
    """(quality - weak) / (strong - weak) at `share` (1 = the strong model's quality)."""
    q = next(p["quality"] for p in curve if abs(p["strong_share"] - share) < 1e-9)
    return float((q - acc_weak) / (acc_strong - acc_weak)) if acc_strong != acc_weak else 1.0


def cost_saved_at(y: np.ndarray, scores: np.ndarray, cost_weak: float, cost_strong: float,
                  cost_probe: float, fraction: float = 0.95) -> dict:
    """The smallest strong share (in steps of 1/N) at which the router reaches `fraction` of
    the strong model's quality, and the cost saved there against always-strong. A request
    sent to the strong model also paid the weak model's probe (its prefill: `cost_probe`)."""
    n = len(y)
    target = fraction * y[:, 1].mean()
    for k in range(n + 1):
        s = k / n
        if (q := quality_at(y, scores, s)) >= target:
            cost = (1 - s) * cost_weak + s * (cost_strong + cost_probe)
            return dict(strong_share=s, quality=q, target=float(target),
                        cost_saved=float(1 - cost / cost_strong))
    raise AssertionError("quality at share 1 is the strong model's, which meets the target")
