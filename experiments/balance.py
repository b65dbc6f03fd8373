"""The load-balancing panel of experiments/routing.py: p50 / p99 latency and throughput per
policy (paged_jax/engine/balance.py) vs arrival rate, over 2 and 4 replicas of the tiny model
(prefix caching on, each pool holding only some of the shared prefixes), on the modeled GPU
clock (paged_jax/routing/replicas.py)."""

from __future__ import annotations

from experiments.serving import TINY, make_engine, tiny_model, warm_up
from paged_jax.engine.balance import POLICIES
from paged_jax.routing.replicas import shared_prefix_traffic, simulate

SHAPE = {**TINY, "enable_prefix_caching": True}


def run(items, policy: str, replicas: int) -> dict:
    """`items` served by `replicas` fresh tiny engines under `policy`."""
    return simulate([make_engine(tiny_model(), **SHAPE) for _ in range(replicas)], items, policy)


def panel(rates=(10.0, 30.0, 60.0), replicas=(2, 4), requests: int = 300) -> list[dict]:
    """Every policy x replica count x rate (rates are per replica: the total is rate x R)."""
    warm_up(tiny_model(), SHAPE)
    rows = []
    for n in replicas:
        for rate in rates:
            items = shared_prefix_traffic(requests, rate * n, seed=int(rate))
            for policy in POLICIES:
                rows.append({**run(items, policy, n), "rate": rate * n})
    return rows
