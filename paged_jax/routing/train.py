"""Builds the router's training data and head: `python -m paged_jax.routing.train [--quick]`.

1. the evaluation set (routing/tasks.py): few-shot questions with checkable answers;
2. labels: each model answers every question greedily (its first line); right or wrong;
   open questions ("define") are labelled by the likelihood each model gives the reference
   answer instead (routing/likelihood.py); the weak model's pass also yields the routing
   features (routing/features.py: the first `WINDOW` tokens of its answer), exactly as the
   router computes them at serving time;
3. the shipped head (routing/head.py) on every item: trained on 80%, calibrated on the rest.
   Its inputs (the named features, all or only the prompt's, and 0-16 principal components
   of the weak model's hidden state) are chosen among CANDIDATES by cross-validation: each
   candidate's heads rank the requests of a random fold they never saw, and the candidate
   with the largest mean quality over random routing wins. (Choosing by leave-one-family-out
   instead, for questions of a new kind, picked the prompt's text alone on 840 questions:
   the candidate that routed worst on questions like the training ones.)
4. out-of-fold predictions (`cross_fit`): each item scored by a head trained, inputs chosen
   included, without it: 5 random folds here (their calibration error goes in the metrics);
   experiments/routing.py also holds out whole families.
5. each model's cost per request, measured warm on fresh questions (no compilation, no
   prefix-cache hits), and modeled on a GPU;
6. the prompt head (routing/policies.py's prompt and cascade-routing policies): inputs
   PROMPT (the prompt text's features), and cascade routing's direct fraction chosen on
   both heads' out-of-fold predictions.

Writes paged_jax/routing/trained/<weak>+<strong>/: `data.npz` (features, labels, family and
difficulty per item), `head` (the cascade's answer head), `prompt_head`, and `metrics.json`
(accuracies, calibration error, costs). Pairs: Qwen2.5-Coder 0.5B / 1.5B (the default; all
families, code included) and SmolLM2-135M / Gemma 3 270M (the general families; `--weak
smollm2 --strong gemma3`). `--prompt-head-only` rebuilds the prompt head from data.npz.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from paged_jax.llm import LLM
from paged_jax.routing import curves as cv
from paged_jax.routing import features as feat
from paged_jax.routing import head as head_lib
from paged_jax.routing import likelihood as lk
from paged_jax.routing import policies as pol
from paged_jax.routing.tasks import ALL_FAMILIES, FAMILIES, Item, make_items
from paged_jax.sampling_params import SamplingParams
from paged_jax.study.cost_model import GpuCostModel

TRAINED = head_lib.TRAINED
MAX_TOKENS = 12
MODELS = head_lib.DEFAULT_PAIR  # weak, strong
# Per pair: the families asked, and those the family split holds out. The Qwen pair's were
# chosen before any of its answers were seen (one general family, one code family).
PAIRS = {
    MODELS: (tuple(ALL_FAMILIES), ("lookup", "pyfunc")),
    ("smollm2", "gemma3"): (tuple(FAMILIES), ("lookup", "reverse")),
}
MEMBERS = 3  # heads averaged per router (head.py)
# (named feature columns, principal components of the hidden state)
PROMPT_ONLY = feat.PROMPT_COLUMNS
CANDIDATES = tuple((cols, k) for cols in (None, PROMPT_ONLY) for k in (0, 8, 16))
# The prompt head's inputs (routing/policies.py): the prompt text's features alone, known
# before any model runs (its hidden state would cost the weak model's prefill first, and
# routed no better on 840 questions: results/routing.json's notes)
PROMPT = (PROMPT_ONLY, 0)
FOLDS = 5
COST_ITEMS = 64  # fresh questions per timed run of measured_seconds


def answer(llm: LLM, items: list[Item], probe: bool, window: int = feat.WINDOW) -> dict:
    """Greedy answers of one model: correctness [N], output tokens and seconds; with `probe`,
    also the routing features [N, F] (`x`: the first `window` answer tokens read; `x_first`:
    the first token only, for comparison)."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["\n"],
                        logprobs=feat.TOP_K if probe else None, return_hidden_states=probe)
    outs = llm.generate([it.prompt for it in items], sp, use_tqdm=False)
    lens = np.array([len(o.outputs[0].token_ids) for o in outs])
    res = dict(correct=np.array([it.correct(o.outputs[0].text) for it, o in
                                 zip(items, outs, strict=True)]),
               tokens=float(lens.mean()), window_tokens=float(np.minimum(lens, window).mean()),
               texts=[o.outputs[0].text for o in outs])
    if probe:
        for key, k in (("x", window), ("x_first", 1)):
            res[key] = np.stack([feat.features(it.prompt, o, k)
                                 for it, o in zip(items, outs, strict=True)])
    return res


def pair_items(n: int, models: tuple[str, str] = MODELS, seed: int = 0) -> list[Item]:
    """The pair's evaluation set: n items over its families."""
    return make_items(n, seed=seed, families=PAIRS[models][0])


def held_out(items: list[Item], models: tuple[str, str] = MODELS) -> np.ndarray:
    """[N] bool: the items of the families the pair's family split holds out (PAIRS)."""
    return np.array([it.family in PAIRS[models][1] for it in items])


def fold_ids(n: int, seed: int = 0) -> np.ndarray:
    """[N] the random fold (0..FOLDS-1) of each item."""
    return np.random.default_rng(seed).permutation(n) % FOLDS


def cross_fit(x: np.ndarray, y: np.ndarray, groups: np.ndarray, only=None,
              candidate: tuple | None = None) -> np.ndarray:
    """[N, 2] out-of-group predictions: each group's items (or only the group `only`; the
    others stay NaN) scored by a head trained on the other groups, its inputs chosen there
    too (or fixed: `candidate`)."""
    p = np.full((len(y), 2), np.nan, np.float32)
    for g in np.unique(groups) if only is None else [only]:
        held = groups == g
        cand = candidate or choose(x[~held], y[~held])[0]
        p[held] = fit(x[~held], y[~held], cand).predict(x[held])
    return p


def fit(x: np.ndarray, y: np.ndarray, candidate: tuple = (None, 0), seed: int = 0
        ) -> head_lib.Head:
    """A head on raw features x (its inputs: `candidate`), trained on 80% of (x, y) and
    calibrated on the rest."""
    cols, k = candidate
    b = len(feat.NAMES)
    center, comps = head_lib.pca(x[:, b:], k) if k else (np.zeros(0), np.zeros((0, 0)))
    perm = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    fit_idx, cal_idx = perm[:cut], perm[cut:]
    head = head_lib.train(head_lib.inputs(x[fit_idx], b, cols, center, comps), y[fit_idx],
                          names=feat.NAMES, seed=seed, members=MEMBERS)
    head = dataclasses.replace(head, columns=cols, center=center, components=comps)
    return head_lib.calibrate(head, x[cal_idx], y[cal_idx])


def choose(x: np.ndarray, y: np.ndarray) -> tuple[tuple, dict]:
    """The candidate whose heads, each trained on FOLDS - 1 random folds of these rows, beat
    random routing by the most on the fold they did not see (mean over the interior strong
    shares); and each candidate's score."""
    folds = fold_ids(len(y), seed=1)
    scores = {}
    for cand in CANDIDATES:
        p = cross_fit(x, y, folds, candidate=cand)
        scores[candidate_name(cand)] = float(np.mean(cv.over_random(
            cv.curves(y, p[:, 1] - p[:, 0]))))
    best = max(CANDIDATES, key=lambda c: scores[candidate_name(c)])
    return best, scores


def candidate_name(candidate: tuple) -> str:
    """'all+pca4', 'prompt+pca32': which named features, how many components."""
    cols, k = candidate
    return f"{'all' if cols is None else 'prompt'}+pca{k}"


def seconds_per_request(llm: LLM, items: list[Item], max_tokens: int, probe: bool) -> float:
    """Seconds per request of one batched run of `items` (questions this engine has not seen:
    no prefix-cache hits), as answered for labels (probe: with the router's logprobs and
    hidden state, as far as `max_tokens`)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"],
                        logprobs=feat.TOP_K if probe else None, return_hidden_states=probe)
    t0 = time.perf_counter()
    llm.generate([it.prompt for it in items], sp, use_tqdm=False)
    return (time.perf_counter() - t0) / len(items)


def measured_seconds(weak: LLM, strong: LLM, models: tuple[str, str], window: int,
                     reps: int = 3, cost_items: int = COST_ITEMS) -> dict:
    """Per request, on this machine: each model answering, and the router's probe (the weak
    model's prefill and first `window` tokens; and with the first token only, for
    comparison); run after labelling (programs compiled),
    alternating the three `reps` times on fresh questions each time (median)."""
    runs = {models[0]: (weak, MAX_TOKENS, False), models[1]: (strong, MAX_TOKENS, False),
            "probe": (weak, window, True), "probe_first_token": (weak, 1, True)}
    seen = {k: [] for k in runs}
    seeds = iter(range(100, 100 + reps * len(runs)))
    for _ in range(reps):
        for k, (llm, tokens, probe) in runs.items():
            seen[k].append(seconds_per_request(llm, pair_items(cost_items, models, next(seeds)),
                                               tokens, probe))
    return {k: float(np.median(v)) for k, v in seen.items()}


def modeled_seconds(llm: LLM, prompt_tokens: float, output_tokens: float) -> float:
    """A request's roofline seconds on the paper's GPU (paged_jax/study/cost_model.py) with this
    model's size: one prefill pass, then one pass per further output token (batch 1)."""
    n = sum(x.size for x in jax.tree.leaves(llm.llm_engine.params))
    gpu = GpuCostModel(name="fp16 roofline", weight_bytes=2.0 * n, parameters=float(n))
    pool = 1 << 20  # KV is a rounding error for these short requests
    first = gpu.step_seconds(1, round(prompt_tokens), 0, pool)
    return first + max(output_tokens - 1, 0) * gpu.step_seconds(1, 1, 0, pool)


def costs(weak: LLM, strong: LLM, w: dict, s: dict, items: list[Item],
          models: tuple[str, str], window: int, timing: tuple[int, int] = (3, COST_ITEMS)
          ) -> dict:
    """Seconds per request: measured here (warm, batched) and modeled on a GPU, per model,
    and the router's probe (what a request the router moves has paid the weak model)."""
    prompt = float(np.mean([len(weak.get_tokenizer().encode(it.prompt)) for it in items]))
    out = {m: r["tokens"] for m, r in zip(models, (w, s), strict=True)}
    modeled = {m: modeled_seconds(llm, prompt, out[m])
               for m, llm in zip(models, (weak, strong), strict=True)}
    modeled["probe"] = modeled_seconds(weak, prompt, w["window_tokens"])
    modeled["probe_first_token"] = modeled_seconds(weak, prompt, 1)
    return dict(measured_cpu=measured_seconds(weak, strong, models, window, *timing),
                modeled_gpu=modeled, output_tokens=out, prompt_tokens=prompt)


def open_labels(weak: LLM, strong: LLM, items: list[Item], y: np.ndarray,
                models: tuple[str, str]) -> dict:
    """Replaces the labels [N, 2] of open items by the reference's likelihood labels; returns
    what they came from (each model's score per byte, the cut)."""
    idx = np.flatnonzero([it.open for it in items])
    if not len(idx):
        return dict(items=0)
    prompts, refs = [items[i].prompt for i in idx], [" " + items[i].answer for i in idx]
    scores = np.stack([lk.reference_logprob(m, prompts, refs) for m in (weak, strong)], 1)
    y[idx], cut = lk.labels(scores)
    return dict(items=len(idx), index=idx.tolist(), cut=cut, scores=scores.tolist(),
                knows=dict(zip(models, y[idx].mean(0).tolist(), strict=True)))


def build(weak: LLM, strong: LLM, items: list[Item], models: tuple[str, str] = MODELS,
          window: int = feat.WINDOW, timing: tuple[int, int] = (3, COST_ITEMS)) -> dict:
    """Labels, features, costs (`timing`: timed runs per side, fresh questions per run), the
    shipped heads, and out-of-fold predictions (random folds)."""
    w, s = answer(weak, items, True, window), answer(strong, items, False)
    y = np.stack([w["correct"], s["correct"]], 1).astype(np.float32)
    opened = open_labels(weak, strong, items, y, models)
    cand, scores = choose(w["x"], y)
    head = fit(w["x"], y, cand)
    oof = cross_fit(w["x"], y, fold_ids(len(items)))
    cost = costs(weak, strong, w, s, items, models, window, timing)
    prompt_head, prompt_oof = prompt_router(w["x"], y, oof, cost, models)
    head.metrics = dict(
        split="all items", train=len(items), inputs=candidate_name(cand), candidates=scores,
        cost=cost, models=list(models), window=window,
        ece_out_of_fold=[head_lib.calibration(oof[:, j], y[:, j]) for j in range(2)],
        train_gains=sorted(head.gain(w["x"]).round(5).tolist()))
    return dict(x=w["x"], x_first=w["x_first"], y=y, head=head, oof=oof, cost=cost,
                prompt_head=prompt_head, prompt_oof=prompt_oof,
                models=models, texts=(w["texts"], s["texts"]), open=opened, window=window,
                accuracy=dict(zip(models, y.mean(0).tolist(), strict=True)))


def prompt_router(x: np.ndarray, y: np.ndarray, oof: np.ndarray, cost: dict,
                  models: tuple[str, str]) -> tuple[head_lib.Head, np.ndarray]:
    """The prompt head (inputs PROMPT) on every row, and its out-of-fold predictions; its
    metrics keep its training gains and cascade routing's direct fraction, chosen on the
    random folds' predictions of both heads (routing/policies.py)."""
    head = fit(x, y, PROMPT)
    p = cross_fit(x, y, fold_ids(len(y)), candidate=PROMPT)
    clock = cost["modeled_gpu"]
    direct = pol.choose_direct(y, pol.Scores(p[:, 1] - p[:, 0], oof[:, 1] - oof[:, 0]),
                               pol.Clock(clock[models[0]], clock[models[1]], clock["probe"]))
    head.metrics = dict(inputs=candidate_name(PROMPT), models=list(models), cost=cost,
                        direct=direct, train_gains=sorted(head.gain(x).round(5).tolist()))
    return head, p


def rebuild_prompt_head(models: tuple[str, str], folder: Path | None = None) -> Path:
    """The prompt head of a pair whose folder holds data.npz and metrics.json (the answer
    head's out-of-fold predictions with its shipped inputs, for the direct fraction)."""
    folder = (folder or head_lib.pair_folder(*models)).absolute()
    with np.load(folder / "data.npz") as d:
        x, y = d["x"], d["y"]
    metrics = json.loads((folder / "metrics.json").read_text())
    cols, k = metrics["inputs"].split("+pca")
    oof = cross_fit(x, y, fold_ids(len(y)), candidate=(
        None if cols == "all" else PROMPT_ONLY, int(k)))
    head, _ = prompt_router(x, y, oof, metrics["cost"], models)
    return head_lib.save(head, folder / "prompt_head")


def save(data: dict, items: list[Item], folder: Path | None = None) -> Path:
    """Writes the training data (data.npz), the shipped head, and metrics.json (to the
    pair's folder by default)."""
    models = data["models"]
    folder = (folder or head_lib.pair_folder(*models)).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    arrays = dict(x=data["x"], x_first_named=data["x_first"][:, :len(feat.NAMES)], y=data["y"],
                  family=np.array([list(ALL_FAMILIES).index(it.family) for it in items]),
                  difficulty=np.array([it.difficulty for it in items]))
    np.savez_compressed(folder / "data.npz", **arrays)
    head = data["head"]
    head_lib.save(head, folder / "head")
    head_lib.save(data["prompt_head"], folder / "prompt_head")
    metrics = dict(models=models, items=len(items), accuracy=data["accuracy"], cost=data["cost"],
                   features=[*feat.NAMES, "hidden state"], window=data["window"],
                   families=list(ALL_FAMILIES), held_out_families=PAIRS[tuple(models)][1],
                   inputs=head.metrics["inputs"],
                   open={k: v for k, v in data["open"].items() if k not in ("index", "scores")},
                   ece_out_of_fold=head.metrics["ece_out_of_fold"])
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return folder


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=840)
    ap.add_argument("--quick", action="store_true", help="168 items")
    ap.add_argument("--weak", default=MODELS[0])
    ap.add_argument("--strong", default=MODELS[1])
    ap.add_argument("--out", type=Path, default=None, help="default: the pair's folder")
    ap.add_argument("--prompt-head-only", action="store_true",
                    help="rebuild only the prompt head, from the pair folder's data.npz and "
                         "metrics.json (no model runs)")
    args = ap.parse_args(argv)
    models = (args.weak, args.strong)
    if models not in PAIRS:
        raise SystemExit(f"no task set for the pair {models}; pairs: {list(PAIRS)}")
    if args.prompt_head_only:
        return dict(prompt_head=rebuild_prompt_head(models, args.out))
    items = pair_items(168 if args.quick else args.items, models)
    weak, strong = (LLM(m, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512)
                    for m in models)
    data = build(weak, strong, items, models)
    save(data, items, args.out)
    print(json.dumps(dict(accuracy=data["accuracy"], cost=data["cost"]), indent=1))
    return data


if __name__ == "__main__":
    main()
