"""experiments/routing.py's printout and figure."""

from __future__ import annotations

from experiments import balance
from experiments import routing_policies as rp
from experiments.common import pyplot, save_plot, table

CURVES = ("router", "random", "weak", "strong", "oracle")  # the cascade's curves ("router")


def plot(res: dict, name: str):
    plt = pyplot()
    splits = list(res["splits"])
    reps = sorted({r["replicas"] for r in res["balance"]})
    fig, axes = plt.subplots(1, len(splits) + len(reps), figsize=(5 * (len(splits) + len(reps)), 4))
    for ax, split in zip(axes, splits, strict=False):
        c = res["splits"][split]["curves"]
        for pol in CURVES:
            xs = [p["strong_share"] for p in c[pol]]
            ys = [p["quality"] for p in c[pol]]
            ax.plot(xs, ys, "o" if len(xs) == 1 else "-", label=pol, markersize=8)
        ax.set(xlabel="share of requests sent to the strong model", ylabel="accuracy",
               title=f"held out: {split} split")
        ax.legend()
    for ax, n in zip(axes[len(splits):], reps, strict=True):
        for pol in balance.POLICIES:
            rows = [r for r in res["balance"] if r["replicas"] == n and r["policy"] == pol]
            ax.plot([r["rate"] for r in rows], [r["e2e_p99"] for r in rows], "-o", label=pol)
        ax.set(xlabel="arrival rate (req/s)", ylabel="p99 latency (s, modeled GPU)",
               title=f"{n} replicas, skewed shared prefixes")
        ax.legend()
    return save_plot(name, fig)



def show(res: dict) -> None:
    print(f"accuracy: {res['accuracy']}  cost: {res['cost']}")
    print(table(res["accuracy_by_family"], ["family", "items", "weak", "strong"]))
    print(f"open questions (labelled by the reference's likelihood): {res['open']}")
    for split, r in res["splits"].items():
        rows = [dict(share=p["strong_share"], router=p["quality"],
                     router_95=f"{lo:.3f}-{hi:.3f}", random=q["quality"], oracle=o["quality"])
                for p, q, o, (lo, hi) in zip(r["curves"]["router"], r["curves"]["random"],
                                             r["curves"]["oracle"], r["interval_95"]["router"],
                                             strict=True)]
        print(f"\n{split} split ({r['test']} held out: {r['held_out']}); router - random "
              f"beats the paired half-interval at 50% ({r['half_interval_at_50']:.3f}) at "
              f"{r['shares_beating_random_by_more']} of 9 shares")
        print(f"gap recovered at 50% "
              f"{r['gap_recovered_at_50']:.2f}, beats random everywhere "
              f"{r['beats_random_everywhere']}, at 95%: {r['cost_saved_at_95']}")
        print(table(rows, ["share", "router", "router_95", "random", "oracle"]))
    print(f"\nreading the weak model's first token vs its window: {res['window']}")
    print("\nend to end:", res["end_to_end"])
    for split, r in res["splits"].items():
        pols = r["policies"]
        print(f"\n{split} split, the three policies (oracle at 95%: "
              f"{ {c: round(o['cost_saved'], 3) for c, o in pols['oracle'].items()} }, random: "
              f"{ {c: round(v, 3) for c, v in pols['random_cost_saved_at_95'].items()} })")
        print(table([dict(policy=p, beats_random=pols[p]["shares_beating_random_by_more"],
                          **{c: f"{v['cost_saved']:.3f} ({v['interval_95'][0]:.3f}-"
                             f"{v['interval_95'][1]:.3f}) at {v['strong_share']:.2f}"
                             for c, v in pols[p]["cost_saved_at_95"].items()})
                     for p in rp.pol.POLICIES],
                    ["policy", "beats_random", "modeled_gpu", "measured_cpu"]))
    print(f"\nbest policy: {res['best_policy']}")
    print("\ntargets (#59):")
    for k, t in res.get("targets", {}).items():
        print(f"  {k}: {t['value']:.3f} (bar {t['bar']}): {'met' if t['met'] else 'NOT met'}")
    print("\nload balancing (modeled GPU clock)")
    print(table(res["balance"], ["replicas", "rate", "policy", "e2e_p50", "e2e_p99", "ttft_p99",
                                 "throughput", "prefix_hit_rate", "lost"]))
    print(res["balance_checks"])
    print("seconds per part:", res.get("seconds"))
