"""Model routing: quality vs the share of requests sent to the strong model, and the cost saved.

    python -m experiments.routing [--quick]

Weak model Qwen2.5-Coder-0.5B-Instruct, strong model Qwen2.5-Coder-1.5B-Instruct (`make
models`); both answer the same few-shot questions, general and code (paged_jax/routing/
tasks.py, code_tasks.py). From one labelled run (routing/train.py); open questions ("define")
are labelled by each model's likelihood of a reference answer.
1. per way of holding items out (5 random folds, every item scored once; the two task
   families train.PAIRS holds out, chosen before any answer of the pair was seen; every
   family held out once in turn), each item scored by a head trained, inputs chosen included,
   without it: the curve of quality vs strong share for the router, random routing, the
   oracle, and the always-weak / always-strong points, each with a bootstrap 95% interval
   (held-out requests resampled); the share of the weak-to-strong gap recovered at a 50%
   strong share; the cost saved at 95% of the strong model's quality (costs per request
   measured warm on this machine, and modeled on the paper's GPU); and the same folds with
   the router reading only the weak model's first token instead of its answer window;
2. the router end to end (RoutedLLM at a 50% share on fresh questions): every request served
   once, each output equal to what its model gives alone, and the router's own overhead per
   request against a weak-model request's latency; then the same questions all at once
   through the server's "auto" model (both models loaded): none lost;
3. the issue's targets, each with what it was measured against.
Writes results/routing.json (+ .png) and, not with --quick, the pair's shipped head
(routing/trained/<weak>+<strong>); `--quick` uses 168 questions.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import time

import numpy as np

from experiments import balance
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax import LLM, SamplingParams
from paged_jax.routing import curves as cv
from paged_jax.routing import features as feat
from paged_jax.routing import head as head_lib
from paged_jax.routing import train as tr
from paged_jax.routing.router import RoutedLLM
from paged_jax.serve.api import build_app
from paged_jax.serve.background import Server

POLICIES = ("router", "random", "weak", "strong", "oracle")


def split_results(data: dict, items, boot: int = 1000) -> dict:
    """Per way of holding items out: curves (with bootstrap 95% intervals), gap recovered and
    cost saved on the items scored by heads that never saw them, and at how many interior
    shares the router beats random by more than the paired interval of (router - random) at
    50% (also reported: its own quality interval at 50%, which random shares)."""
    models = data.get("models", tr.MODELS)
    clocks = {clock: (c[models[0]], c[models[1]], c["probe"]) for clock, c in
              data["cost"].items() if clock in ("measured_cpu", "modeled_gpu")}
    x, y = data["x"], data["y"]
    fam = np.array([it.family for it in items])
    held = tr.held_out(items, models)
    scored = dict(
        random=(data["oof"], f"{tr.FOLDS} random folds: every item scored by a head trained "
                "(inputs chosen too) on the other folds"),
        family=(tr.cross_fit(x, y, held, only=True), "the families train.PAIRS holds "
                "out, chosen before any answer of this pair was seen"),
        each_family=(tr.cross_fit(x, y, fam), "every family held out once in turn "
                     "(the head, inputs chosen too, trained on the others): no family chosen"))
    return {name: one_split(y, p, clocks, how, boot, fam) for name, (p, how) in scored.items()}


def one_split(y: np.ndarray, p: np.ndarray, clocks: dict, how: str, boot: int,
              fam: np.ndarray) -> dict:
    """The results of one way of holding out, from out-of-group predictions p [N, 2] (NaN
    where an item was not held out)."""
    te = ~np.isnan(p[:, 0])
    y, scores = y[te], p[te, 1] - p[te, 0]
    c = cv.curves(y, scores)
    ci = cv.bootstrap(y, scores, clocks, n=boot)
    acc_w, acc_s = y.mean(0)
    mid = cv.SHARES.index(0.5)
    half = {k: (ci[k][mid][1] - ci[k][mid][0]) / 2 for k in ("router_minus_random", "router")}
    over, oracle = cv.over_random(c), cv.over_random(c, "oracle")
    return dict(
        held_out=how, curves=c, interval_95=ci, test=int(te.sum()),
        accuracy=dict(weak=float(acc_w), strong=float(acc_s)),
        gap_recovered_at_50=cv.gap_recovered(c["router"], acc_w, acc_s, 0.5),
        beats_random_everywhere=all(d >= -1e-9 for d in over), over_random=over,
        oracle_over_random=oracle, half_interval_at_50=half["router_minus_random"],
        half_interval_at_50_router_alone=half["router"],
        shares_beating_random_by_more=int(sum(d > half["router_minus_random"] for d in over)),
        shares_beating_random_by_more_than_router_interval=int(
            sum(d > half["router"] for d in over)),
        ece=[head_lib.calibration(p[te, j], y[:, j]) for j in range(2)],
        cost_saved_at_95={clock: cv.cost_saved_at(y, scores, *v) for clock, v in clocks.items()},
        by_family=[dict(family=str(f), items=int((fam[te] == f).sum()),
                        over_random=float(np.mean(over_family(y, scores, fam[te] == f))))
                   for f in dict.fromkeys(fam[te])])


def over_family(y: np.ndarray, scores: np.ndarray, m: np.ndarray) -> list[float]:
    """The router's quality over random's on one family's items, per interior share."""
    return cv.over_random(cv.curves(y[m], scores[m]))


def window_ablation(data: dict) -> dict:
    """The random folds again with fixed inputs (every named feature, the shipped head's
    principal components), reading the weak model's first token only vs its first `window`
    tokens: mean quality over random (interior shares) and cost saved at 95%."""
    models, y = data.get("models", tr.MODELS), data["y"]
    k = data["head"].components.shape[1]  # the shipped head's hidden-state inputs, and all
    cand = (None, k)  # the named features (the prompt's alone would not read the weak answer)
    out = {}
    for name, x, probe in (("first token", data["x_first"], "probe_first_token"),
                           (f"{data['window']} tokens", data["x"], "probe")):
        p = tr.cross_fit(x, y, tr.fold_ids(len(y)), candidate=cand)
        scores = p[:, 1] - p[:, 0]
        c = cv.curves(y, scores)
        out[name] = dict(
            mean_over_random=float(np.mean(cv.over_random(c))),
            cost_saved_at_95={clock: cv.cost_saved_at(
                y, scores, c_[models[0]], c_[models[1]], c_[probe])["cost_saved"]
                for clock, c_ in data["cost"].items() if clock in ("measured_cpu", "modeled_gpu")})
    return dict(inputs=tr.candidate_name(cand), **out)


def end_to_end(weak: LLM, strong: LLM, head, n: int) -> dict:
    """RoutedLLM on n fresh questions: outputs vs each model alone, its overhead, and the
    same questions through the server's "auto" model."""
    items = tr.pair_items(n, seed=1)
    prompts = [it.prompt for it in items]
    sp = SamplingParams(temperature=0.0, max_tokens=tr.MAX_TOKENS, stop=["\n"])
    router = RoutedLLM(weak, strong, head, strong_share=0.5, names=tr.MODELS)
    routed = router.generate(prompts, sp)
    alone = {m: llm.generate(prompts, sp, use_tqdm=False)
             for m, llm in zip(tr.MODELS, (weak, strong), strict=True)}
    same = sum(o.outputs[0].token_ids == alone[o.model][i].outputs[0].token_ids
               for i, o in enumerate(routed))
    lat = overhead(weak, router, prompts[:24], sp)
    served = served_auto(router, prompts, {o.prompt: (o.model, o.outputs[0].text)
                                           for o in routed})
    return dict(requests=n, served=len(routed), identical_to_own_model=int(same), server=served,
                strong_share=float(np.mean([o.model == tr.MODELS[1] for o in routed])),
                quality=float(np.mean([it.correct(o.outputs[0].text)  # checked items only
                                       for it, o in zip(items, routed, strict=True)
                                       if not it.open])),
                **lat)


def served_auto(router: RoutedLLM, prompts: list[str], offline: dict) -> dict:
    """All prompts at once through the server's "auto" model (an HTTP server in this
    process): answered, lost (an error or no answer), and answered as RoutedLLM did offline
    (same model, same text)."""
    import httpx

    async def ask(client: httpx.AsyncClient, prompt: str):
        try:
            r = await client.post("/v1/completions", json=dict(
                model="auto", prompt=prompt, temperature=0.0, max_tokens=tr.MAX_TOKENS,
                stop=["\n"]))
            body = r.json()
            return (body["model"], body["choices"][0]["text"]) if r.status_code == 200 else None
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    async def all_at_once(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
            return await asyncio.gather(*(ask(client, p) for p in prompts))

    with Server(build_app(router)) as srv:
        answers = asyncio.run(all_at_once(srv.url))
    return dict(requests=len(prompts), answered=sum(a is not None for a in answers),
                lost=sum(a is None for a in answers),
                as_offline=sum(a == offline[p] for p, a in zip(prompts, answers, strict=True)))


def overhead(weak: LLM, router: RoutedLLM, prompts: list[str], sp, boot: int = 1000) -> dict:
    """One request at a time: weak-model latency alone vs through the router (requests the
    router kept on the weak model), the two alternating per prompt (which goes first swaps
    each time), with a 95% interval from resampling the prompts; and the classifier's own
    time."""
    keep = RoutedLLM(weak, router.strong, router.head, threshold=np.inf, names=tr.MODELS)
    runs = {"alone": lambda p: weak.generate(p, sp, use_tqdm=False),
            "routed": lambda p: keep.generate(p, sp)}
    lat = {k: [] for k in runs}
    for i, p in enumerate(prompts):
        for f in runs.values():  # warm both paths' programs (the router's probe asks for
            f(p)  # logprobs and the hidden state); prefix cache primed for both
        for k in sorted(runs, reverse=bool(i % 2)):
            t0 = time.perf_counter()
            runs[k](p)
            lat[k].append(time.perf_counter() - t0)
    alone, routed = (np.array(lat[k]) for k in ("alone", "routed"))
    ratio = lambda i: np.median(routed[i]) / np.median(alone[i]) - 1  # noqa: E731
    rng = np.random.default_rng(0)
    draws = [ratio(rng.integers(0, len(prompts), len(prompts))) for _ in range(boot)]
    x = np.stack([np.asarray(r.features, np.float32) for r in keep.routes.values()])
    t0 = time.perf_counter()
    for row in x:
        router.head.gain(row[None])
    clf = (time.perf_counter() - t0) / len(x)
    return dict(weak_latency_s=float(np.median(alone)), routed_latency_s=float(np.median(routed)),
                overhead=float(ratio(slice(None))), prompts=len(prompts),
                overhead_interval_95=np.percentile(draws, [2.5, 97.5]).tolist(),
                classifier_s=clf, classifier_share=clf / float(np.median(alone)))


def balance_checks(rows: list[dict]) -> dict:
    """KV-aware vs round-robin p99 at every (replicas, rate) point, and lost requests."""
    by = {(r["replicas"], r["rate"], r["policy"]): r for r in rows}
    pts = sorted({(r["replicas"], r["rate"]) for r in rows})
    return dict(kv_aware_p99_below_round_robin=[
        by[(n, x, "kv_aware")]["e2e_p99"] < by[(n, x, "round_robin")]["e2e_p99"]
        for n, x in pts], lost=sum(r["lost"] for r in rows))


def plot(res: dict, name: str):
    plt = pyplot()
    splits = list(res["splits"])
    reps = sorted({r["replicas"] for r in res["balance"]})
    fig, axes = plt.subplots(1, len(splits) + len(reps), figsize=(5 * (len(splits) + len(reps)), 4))
    for ax, split in zip(axes, splits, strict=False):
        c = res["splits"][split]["curves"]
        for pol in POLICIES:
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


def main(argv: list[str] | None = None, name: str = "routing") -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="168 questions")
    ap.add_argument("--items", type=int, default=840)
    ap.add_argument("--end-to-end", type=int, default=64, help="fresh questions routed")
    ap.add_argument("--balance-requests", type=int, default=300)
    args = ap.parse_args(argv)
    quick = args.quick
    items = tr.pair_items(168 if quick else args.items)
    weak, strong = (LLM(m, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512)
                    for m in tr.MODELS)
    data = tr.build(weak, strong, items)
    res = dict(models=dict(weak=tr.MODELS[0], strong=tr.MODELS[1]), items=len(items),
               families=list(tr.PAIRS[tr.MODELS][0]),
               held_out_families=dict(
                   families=list(tr.PAIRS[tr.MODELS][1]),
                   chosen="before any answer of this pair was seen (train.PAIRS)"),
               accuracy=data["accuracy"], cost=data["cost"],
               accuracy_by_family=by_family(data["y"], items),
               features=[*feat.NAMES, "hidden state"],
               open={k: v for k, v in data["open"].items() if k not in ("index", "scores")})
    if not quick:
        res["shipped_head"] = str(tr.save(data, items))
    res["splits"] = split_results(data, items)
    res.update({p: res["splits"]["random"]["curves"][p] for p in POLICIES})
    res["window"] = window_ablation(data)
    saved = res["splits"]["random"]["cost_saved_at_95"]
    res["cost_saved_at_95"] = saved["measured_cpu"]["cost_saved"]  # this machine's clock
    res["cost_saved_at_95_modeled_gpu"] = saved["modeled_gpu"]["cost_saved"]
    res["end_to_end"] = end_to_end(weak, strong, data["head"],
                                   24 if quick else args.end_to_end)
    del weak, strong
    res["targets"] = targets(res)
    res["balance"] = balance.panel(requests=150 if quick else args.balance_requests)
    res["balance_checks"] = balance_checks(res["balance"])
    res["png"] = str(plot(res, name))
    res["json"] = str(save_json(name, res))
    show(res)
    return res


def by_family(y: np.ndarray, items) -> list[dict]:
    """Each family's accuracy per model (all its items)."""
    fam = np.array([it.family for it in items])
    return [dict(family=str(f), items=int((fam == f).sum()), weak=float(y[fam == f, 0].mean()),
                 strong=float(y[fam == f, 1].mean())) for f in dict.fromkeys(fam)]


def targets(res: dict) -> dict:
    """The issue's targets (#32) against this run: each value, its bar, and whether it is met."""
    acc = list(res["accuracy"].values())
    r, f = res["splits"]["random"], res["splits"]["family"]  # beating: by the paired interval
    e2e = res["end_to_end"]
    rows = dict(
        strong_minus_weak=(acc[1] - acc[0], ">=", 0.15),
        cost_saved_at_95_modeled_gpu=(res["cost_saved_at_95_modeled_gpu"], ">=", 0.40),
        cost_saved_at_95_measured_cpu=(res["cost_saved_at_95"], ">=", 0.25),
        random_split_shares_beating_random=(r["shares_beating_random_by_more"], ">=", 9),
        family_split_shares_beating_random=(f["shares_beating_random_by_more"], ">=", 7),
        each_family_split_shares_beating_random=(
            res["splits"]["each_family"]["shares_beating_random_by_more"], ">=", 7),
        routing_overhead_upper_95=(e2e["overhead_interval_95"][1], "<", 0.05),
        lost_through_server_auto=(e2e["server"]["lost"], "==", 0),
    )
    ops = {">=": operator.ge, "<": operator.lt, "==": operator.eq}
    return {k: dict(value=v, bar=f"{op} {bound}", met=bool(ops[op](v, bound)))
            for k, (v, op, bound) in rows.items()}


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
    print("\ntargets (#32):")
    for k, t in res.get("targets", {}).items():
        print(f"  {k}: {t['value']:.3f} (bar {t['bar']}): {'met' if t['met'] else 'NOT met'}")
    print("\nload balancing (modeled GPU clock)")
    print(table(res["balance"], ["replicas", "rate", "policy", "e2e_p50", "e2e_p99", "ttft_p99",
                                 "throughput", "prefix_hit_rate", "lost"]))
    print(res["balance_checks"])


if __name__ == "__main__":
    main()
