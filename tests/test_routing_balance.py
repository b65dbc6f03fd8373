"""paged_jax.engine.balance on tiny engines: each policy's choice, and experiments/balance's
multi-replica run loses nothing."""

from __future__ import annotations

import pytest

from experiments import balance as exp
from paged_jax.engine.balance import POLICIES, Balancer
from paged_jax.routing.replicas import shared_prefix_traffic
from tests.engine_helpers import GREEDY, engine, run


def test_round_robin_and_least_tokens():
    engs = [engine(enable_prefix_caching=True) for _ in range(3)]
    rr = Balancer(engs, "round_robin")
    assert [rr.pick(f"r{i}", [1, 2, 3], 4) for i in range(5)] == [0, 1, 2, 0, 1]
    lt = Balancer(engs, "least_tokens")
    assert lt.pick("a", list(range(50)), 10) == 0
    assert lt.pick("b", list(range(5)), 5) == 1
    assert lt.pick("c", list(range(5)), 5) == 2
    assert lt.pick("d", list(range(5)), 5) == 1  # 10 outstanding on 1 and 2, 60 on 0
    lt.done("a")
    assert lt.outstanding == [0, 20, 10] and lt.pick("e", [1], 1) == 0
    with pytest.raises(ValueError, match="policy must be one of"):
        Balancer(engs, "random")


def test_kv_aware_follows_the_cached_prefix_within_slack():
    engs = [engine(enable_prefix_caching=True) for _ in range(2)]
    prefix = [7] * 40
    run(engs[1], [("warm", {"prompt_token_ids": prefix + [1, 2]}, GREEDY)])
    assert Balancer.cached_tokens(engs[1], prefix + [3]) == 40  # 5 full blocks of 8
    assert Balancer.cached_tokens(engs[0], prefix + [3]) == 0
    kv = Balancer(engs, "kv_aware", slack=100)
    assert kv.pick("a", prefix + [3], 8) == 1  # the cache, though both are idle
    assert kv.outstanding == [0, 1 + 8]  # only the uncached token counts
    assert kv.pick("b", [5] * 30, 8) == 0  # no hit anywhere: least loaded
    kv.outstanding[1] = 500  # too busy: the hit is not worth the wait
    assert kv.pick("c", prefix + [4], 8) == 0


def test_replicas_serve_every_request():
    items = shared_prefix_traffic(24, 50.0, groups=3, prefix_len=40)
    for policy in POLICIES:
        res = exp.run(items, policy, 2)
        assert res["served"] == 24 and res["lost"] == 0
        assert 0 < res["e2e_p50"] <= res["e2e_p99"] and res["throughput"] > 0


def test_routing_experiment_tables_and_plot(tmp_path, monkeypatch):
    """experiments/routing.py's analysis on synthetic labels (the real run needs both shipped
    models: `python -m experiments.routing --quick`, 5-6 minutes)."""
    import numpy as np

    from experiments import common
    from experiments import routing as exp_routing
    from paged_jax.routing import features as feat
    from paged_jax.routing import train
    from paged_jax.routing.tasks import make_items

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(train, "CANDIDATES", ((None, 0),))
    monkeypatch.setattr(train, "FOLDS", 2)
    items = make_items(120, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((120, len(feat.NAMES))).astype(np.float32)
    y = np.stack([x[:, 0] > 0, x[:, 1] > 0], 1).astype(np.float32)
    clocks = {c: {train.MODELS[0]: 1.0, train.MODELS[1]: 2.0, "probe": 0.2}
              for c in ("measured_cpu", "modeled_gpu")}
    oof = train.cross_fit(x, y, train.fold_ids(len(y)))
    prompt_oof = train.cross_fit(x, y, train.fold_ids(len(y)), candidate=train.PROMPT)
    res = dict(splits=exp_routing.split_results(dict(x=x, y=y, oof=oof, cost=clocks,
                                                     prompt_oof=prompt_oof), items, boot=50))
    assert set(res["splits"]) == {"random", "family", "each_family"}
    assert res["splits"]["family"]["test"] == train.held_out(items).sum()
    assert res["splits"]["each_family"]["test"] == len(items)
    r = res["splits"]["random"]
    assert r["beats_random_everywhere"] and r["gap_recovered_at_50"] > 0.5
    assert {p["strong_share"] for p in r["curves"]["router"]} >= {0.0, 0.5, 1.0}
    pols = r["policies"]  # the cascade reads feature 0 (weak right) and 1 (strong right):
    assert pols["cascade"]["shares_beating_random_by_more"] >= 7  # it routes well, and
    for p in ("prompt", "cascade", "cascade_routing"):  # everyone is charged what it ran
        for c in ("modeled_gpu", "measured_cpu"):
            v = pols[p]["cost_saved_at_95"][c]
            assert v["interval_95"][0] <= v["cost_saved"] <= v["interval_95"][1] + 1e-9, (p, v)
            assert v["cost_saved"] <= pols["oracle"][c]["cost_saved"] + 1e-9
    assert pols["cascade_routing"]["direct_fractions"]["modeled_gpu"]
    rows = [dict(replicas=2, rate=10.0, policy=p, e2e_p99=v, lost=0)
            for p, v in (("round_robin", 2.0), ("least_tokens", 1.5), ("kv_aware", 1.0))]
    assert exp_routing.balance_checks(rows) == dict(kv_aware_p99_below_round_robin=[True], lost=0)
    res["balance"] = rows
    assert exp_routing.plot(res, "routing_test").is_file()
