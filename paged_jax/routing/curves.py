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
the weak model's prefill, paid by every request the router moves). `bootstrap` gives each
curve a 95% interval by resampling the held-out requests (the head's scores fixed).
"""

from __future__ import annotations

import numpy as np

SHARES = tuple(round(x, 2) for x in np.linspace(0, 1, 11))


def quality_by_count(y: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Quality [N + 1] when the k highest-scoring requests go to the strong model, k = 0..N."""
    order = np.argsort(-scores, kind="stable")
    moved = np.concatenate([[0.0], np.cumsum(y[order, 1] - y[order, 0])])
    return (y[:, 0].sum() + moved) / len(y)


def curves(y: np.ndarray, router_scores: np.ndarray, shares=SHARES) -> dict[str, list[dict]]:
    """Each policy's curve as [{strong_share, quality}, ...]."""
    acc_w, acc_s = y.mean(0)
    by_k = {p: quality_by_count(y, sc) for p, sc in (("router", router_scores),
                                                      ("oracle", y[:, 1] - y[:, 0]))}
    pts = lambda f: [dict(strong_share=s, quality=f(s)) for s in shares]  # noqa: E731
    at = lambda p: pts(lambda s: float(by_k[p][int(round(s * len(y)))]))  # noqa: E731
    return dict(
        router=at("router"),
        random=pts(lambda s: float((1 - s) * acc_w + s * acc_s)),
        oracle=at("oracle"),
        weak=[dict(strong_share=0.0, quality=float(acc_w))],
        strong=[dict(strong_share=1.0, quality=float(acc_s))],
    )


def over_random(c: dict[str, list[dict]], policy: str = "router") -> list[float]:
    """A policy's quality minus random routing's at each interior share of curves `c`."""
    return [r["quality"] - q["quality"] for r, q in
            zip(c[policy][1:-1], c["random"][1:-1], strict=True)]


def gap_recovered(curve: list[dict], acc_weak: float, acc_strong: float, share: float) -> float:
    """(quality - weak) / (strong - weak) at `share` (1 = the strong model's quality)."""
    q = next(p["quality"] for p in curve if abs(p["strong_share"] - share) < 1e-9)
    return float((q - acc_weak) / (acc_strong - acc_weak)) if acc_strong != acc_weak else 1.0


def cost_saved_at(y: np.ndarray, scores: np.ndarray, cost_weak: float, cost_strong: float,
                  cost_probe: float, fraction: float = 0.95) -> dict:
    """The smallest strong share (in steps of 1/N) at which the router reaches `fraction` of
    the strong model's quality, and the cost saved there against always-strong. A request
    sent to the strong model also paid the weak model's probe (its prefill and the answer
    window the router read: `cost_probe`)."""
    target = fraction * y[:, 1].mean()
    q = quality_by_count(y, scores)
    k = int(np.argmax(q >= target - 1e-12))  # k = N (share 1) always meets it
    s = k / len(y)
    cost = (1 - s) * cost_weak + s * (cost_strong + cost_probe)
    return dict(strong_share=s, quality=float(q[k]), target=float(target),
                cost_saved=float(1 - cost / cost_strong))


def bootstrap(y: np.ndarray, scores: np.ndarray, costs: dict[str, tuple[float, float, float]],
              shares=SHARES, n: int = 1000, seed: int = 0) -> dict:
    """95% intervals [lo, hi] from n resamples of the requests (with replacement): each
    policy's quality per share, the router's advantage over random per share (paired: one
    resample for both), and the cost saved at 95% per clock (`costs`: clock -> (weak,
    strong, probe) seconds)."""
    rng = np.random.default_rng(seed)
    qs = {p: np.empty((n, len(shares))) for p in ("router", "random", "oracle")}
    saved = {c: np.empty(n) for c in costs}
    for b in range(n):
        i = rng.integers(0, len(y), len(y))
        c = curves(y[i], scores[i], shares)
        for p, a in qs.items():
            a[b] = [pt["quality"] for pt in c[p]]
        for clock, (w, st, pr) in costs.items():
            saved[clock][b] = cost_saved_at(y[i], scores[i], w, st, pr)["cost_saved"]
    ci = lambda a: np.percentile(a, [2.5, 97.5], axis=0).T.tolist()  # noqa: E731
    return dict(resamples=n, **{p: ci(a) for p, a in qs.items()},
                router_minus_random=ci(qs["router"] - qs["random"]),
                cost_saved_at_95={clock: ci(a) for clock, a in saved.items()})
