"""Three routing policies for one (weak, strong) pair, each charged for what it runs, and the
oracle's bound on the same items.

    prompt           the prompt head (routing/train.py: the features of the prompt's text
                     alone) picks the model before either runs: a request pays one model
    cascade          the weak model answers (the router reads its first `window` tokens:
                     routing/router.py); the answer head, reading how it answered, escalates
                     the ones it doubts: an escalated request pays the probe (the weak model's
                     prefill and window) and the strong model (FrugalGPT)
    cascade_routing  the prompt head sends the requests it is surest need the strong model
                     straight there (a fraction `direct` of the strong share), the rest
                     cascade (Dekoninck et al., ICML 2025: a router and a post-answer quality
                     estimate together)

For N requests with labels y [N, 2] (weak right, strong right), a policy at k strong requests
(share k / N) has a quality and a cost per request on a clock (`Clock`: seconds per weak
request, strong request and probe). The oracle knows y: it sends straight to the strong model
exactly the requests only the strong model gets right, the cheapest decision any policy could
make. `saved_at` reads the cheapest k reaching `fraction` of the strong model's quality.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.routing.curves import SHARES

POLICIES = ("prompt", "cascade", "cascade_routing")
DIRECT = (0.25, 0.5, 0.75, 0.9)  # cascade routing's direct fractions (chosen on training rows)


@dataclasses.dataclass(frozen=True)
class Clock:
    """Seconds per request on one clock: the weak model answering, the strong one, and the
    cascade's probe (what a request it escalates has paid the weak model)."""

    weak: float
    strong: float
    probe: float
    first: float = 0.0  # what a request sent straight to the strong model paid first (the
    # weak model's prefill when the prompt head reads its hidden state; 0 for text alone)


@dataclasses.dataclass(frozen=True)
class Scores:
    """Per request, higher = more worth the strong model: the prompt head's expected gain
    (known before any model runs) and the answer head's (after the weak model's window)."""

    prompt: np.ndarray
    answer: np.ndarray


def by_count(policy: str, y: np.ndarray, scores: Scores, direct: float = 0.5
             ) -> tuple[np.ndarray, np.ndarray]:
    """(quality [N + 1], direct count [N + 1]) when the policy gives the strong model k of the
    N requests, k = 0..N: the prompt policy its top k by prompt score; the cascade its top k
    by answer score; cascade routing round(direct * k) by prompt score straight there, then
    the top of the rest by answer score."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    n = len(y)
    ks = np.arange(n + 1)
    if policy != "cascade_routing":
        sc = scores.prompt if policy == "prompt" else scores.answer
        order = np.argsort(-sc, kind="stable")
        moved = np.concatenate([[0.0], np.cumsum(y[order, 1] - y[order, 0])])
        return (y[:, 0].sum() + moved) / n, ks if policy == "prompt" else ks * 0
    p_order, a_order = (np.argsort(-s, kind="stable") for s in (scores.prompt, scores.answer))
    d = np.rint(direct * ks).astype(int)
    q = np.empty(n + 1)
    gain = y[:, 1] - y[:, 0]
    for k in ks:
        sent = np.zeros(n, bool)
        sent[p_order[:d[k]]] = True
        rest = a_order[~sent[a_order]][:k - d[k]]
        q[k] = y[:, 0].sum() + gain[sent].sum() + gain[rest].sum()
    return q / n, d


def cost(policy: str, k: np.ndarray, d: np.ndarray, n: int, c: Clock) -> np.ndarray:
    """Mean seconds per request: k of n on the strong model, d of them sent straight there
    (the rest of the k were escalated after the probe)."""
    if policy == "prompt":
        return ((n - k) * c.weak + k * (c.first + c.strong)) / n
    return ((n - k) * c.weak + d * (c.first + c.strong) + (k - d) * (c.probe + c.strong)) / n


def saved_at(policy: str, y: np.ndarray, scores: Scores, c: Clock, direct: float = 0.5,
             fraction: float = 0.95, counted: tuple | None = None) -> dict:
    """The cheapest point whose quality reaches `fraction` of the strong model's (cost grows
    with k: the first k that reaches it), and the cost saved there against always-strong.
    `counted`: by_count's result, when already computed."""
    n, target = len(y), fraction * float(y[:, 1].mean())
    q, d = counted or by_count(policy, y, scores, direct)
    k = int(np.argmax(q >= target - 1e-12))  # k = N (all strong) always reaches it
    spent = float(cost(policy, np.asarray(k), np.asarray(d[k]), n, c))
    return dict(strong_share=k / n, direct_share=int(d[k]) / n, quality=float(q[k]),
                target=target, cost_saved=1 - spent / c.strong)


def oracle_saved_at(y: np.ndarray, c: Clock, fraction: float = 0.95) -> dict:
    """The oracle's bound: the requests only the strong model gets right go straight to it,
    as few as reach the quality; every other request pays the weak model alone."""
    gain = y[:, 1] - y[:, 0]
    return saved_at("prompt", y, Scores(gain, gain), c, fraction=fraction)


def curve(policy: str, y: np.ndarray, scores: Scores, direct: float = 0.5,
          shares=SHARES, counted: tuple | None = None) -> list[dict]:
    """Quality at each strong share."""
    q, _ = counted or by_count(policy, y, scores, direct)
    return [dict(strong_share=s, quality=float(q[round(s * len(y))])) for s in shares]


def choose_direct(y: np.ndarray, scores: Scores, c: Clock) -> float:
    """Cascade routing's direct fraction (of DIRECT) that saves the most at 95% on these
    requests (training rows: the choice is part of the policy)."""
    return max(DIRECT, key=lambda f: saved_at("cascade_routing", y, scores, c, f)["cost_saved"])


def folded(policy: str, y: np.ndarray, scores: Scores, groups: np.ndarray,
           direct: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """by_count over held-out groups scored apart (each group its own router, as cross-fitting
    trains one head per group; `direct`: each group's direct fraction): at a share k / N
    every group sends round(k n_g / N) of its n_g requests. Returns (quality, strong count,
    direct count), each [N + 1]."""
    n = len(y)
    ks = np.arange(n + 1)
    q, k_all, d_all = np.zeros(n + 1), np.zeros(n + 1, int), np.zeros(n + 1, int)
    for g in np.unique(groups):
        m = groups == g
        qg, dg = by_count(policy, y[m], Scores(scores.prompt[m], scores.answer[m]), direct[g])
        idx = np.rint(ks * m.sum() / n).astype(int)
        q += qg[idx] * m.sum() / n
        k_all += idx
        d_all += dg[idx]
    return q, k_all, d_all


def folded_saved_at(policy: str, y: np.ndarray, counted: tuple, c: Clock,
                    fraction: float = 0.95) -> dict:
    """saved_at on `folded`'s counts."""
    q, ks, ds = counted
    n, target = len(y), fraction * float(y[:, 1].mean())
    i = int(np.argmax(q >= target - 1e-12))
    spent = float(cost(policy, ks[i], ds[i], n, c))
    return dict(strong_share=int(ks[i]) / n, direct_share=int(ds[i]) / n, quality=float(q[i]),
                target=target, cost_saved=1 - spent / c.strong)
