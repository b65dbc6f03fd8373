"""experiments/routing.py's three policies (paged_jax/routing/policies.py) on one way of holding
items out: each policy's quality per strong share and its cost saved at 95% of the strong
model's quality on each clock, with bootstrap 95% intervals (held-out requests resampled,
the heads' scores fixed), at how many interior shares it beats random routing by more than
the paired interval of (policy - random) at 50%, beside random's and the oracle's.

Every score is out of group: the answer head's and the prompt head's predictions for a group
come from heads trained without it (train.cross_fit), and cascade routing's direct fraction
for a group is chosen on the other rows (their random-fold predictions), so each group is
served by a router that never saw it.
"""

from __future__ import annotations

import numpy as np

from paged_jax.routing import policies as pol
from paged_jax.routing.curves import SHARES

GPU = "modeled_gpu"


def directs(y: np.ndarray, scores: pol.Scores, groups: np.ndarray, clock: pol.Clock) -> dict:
    """Each group's direct fraction, chosen on the rows outside it."""
    return {g: pol.choose_direct(y[groups != g], pol.Scores(
        scores.prompt[groups != g], scores.answer[groups != g]), clock)
        for g in np.unique(groups)}


def _random_saved(y: np.ndarray, c: pol.Clock, fraction: float = 0.95) -> float:
    """Random routing's cost saved at `fraction`: the share whose expected quality reaches it."""
    acc_w, acc_s = y.mean(0)
    s = 1.0 if acc_s <= acc_w else float(np.clip((fraction * acc_s - acc_w) / (acc_s - acc_w),
                                                 0, 1))
    return float(1 - ((1 - s) * c.weak + s * c.strong) / c.strong)


def _at_shares(q: np.ndarray) -> np.ndarray:
    n = len(q) - 1
    return np.array([q[round(s * n)] for s in SHARES])


def _random_curve(y: np.ndarray) -> np.ndarray:
    s = np.array(SHARES)
    return (1 - s) * y[:, 0].mean() + s * y[:, 1].mean()


def evaluate(y: np.ndarray, scores: pol.Scores, groups: np.ndarray, te: np.ndarray,
             training: pol.Scores, clocks: dict[str, pol.Clock], boot: int = 1000,
             seed: int = 0) -> dict:
    """One way of holding out, over all N rows: `scores` [N] (valid where `te`, the held-out
    rows: each group's from heads trained without it), `groups` [N] the group of every row,
    `training` every row's random-fold scores, of which the rows outside a group choose its
    direct fraction."""
    direct = {c: {g: d for g, d in directs(y, training, groups, clk).items()
                  if te[groups == g].any()} for c, clk in clocks.items()}
    y, groups = y[te], groups[te]
    scores = pol.Scores(scores.prompt[te], scores.answer[te])
    counted = {(p, c): pol.folded(p, y, scores, groups, direct[c])
               for p in pol.POLICIES for c in clocks}
    draws, over = _bootstrap(y, scores, groups, direct, clocks, boot, seed)
    mid = SHARES.index(0.5)
    out = {}
    for p in pol.POLICIES:
        diff = _at_shares(counted[p, GPU][0]) - _random_curve(y)
        half = float(np.diff(np.percentile(over[p][:, mid], [2.5, 97.5]))[0] / 2)
        out[p] = dict(
            curve=[dict(strong_share=s, quality=float(q)) for s, q in
                   zip(SHARES, _at_shares(counted[p, GPU][0]), strict=True)],
            over_random=diff[1:-1].tolist(), half_interval_at_50=half,
            shares_beating_random_by_more=int(sum(d > half for d in diff[1:-1])),
            cost_saved_at_95={c: dict(**pol.folded_saved_at(p, y, counted[p, c], clk),
                                      interval_95=np.percentile(draws[p, c], [2.5, 97.5])
                                      .tolist()) for c, clk in clocks.items()})
        if p == "cascade_routing":
            out[p]["direct_fractions"] = {c: sorted({float(v) for v in direct[c].values()})
                                          for c in clocks}
    out["oracle"] = {c: pol.oracle_saved_at(y, clk) for c, clk in clocks.items()}
    out["random_cost_saved_at_95"] = {c: _random_saved(y, clk) for c, clk in clocks.items()}
    return out


def _bootstrap(y, scores, groups, direct, clocks, boot, seed):
    """Per (policy, clock) the cost saved at 95% of `boot` resamples of the rows, and per
    policy its quality minus random's at each share (GPU clock's direct fractions)."""
    rng = np.random.default_rng(seed)
    n = len(y)
    draws = {(p, c): np.empty(boot) for p in pol.POLICIES for c in clocks}
    over = {p: np.empty((boot, len(SHARES))) for p in pol.POLICIES}
    for b in range(boot):
        i = rng.integers(0, n, n)
        yb, sb = y[i], pol.Scores(scores.prompt[i], scores.answer[i])
        for p in pol.POLICIES:
            for c, clk in clocks.items():
                counted = pol.folded(p, yb, sb, groups[i], direct[c])
                draws[p, c][b] = pol.folded_saved_at(p, yb, counted, clk)["cost_saved"]
                if c == GPU:
                    over[p][b] = _at_shares(counted[0]) - _random_curve(yb)
    return draws, over


def best(results: dict) -> str:
    """The policy that saves the most at 95% on the modeled GPU clock."""
    return max(pol.POLICIES, key=lambda p: results[p]["cost_saved_at_95"][GPU]["cost_saved"])
