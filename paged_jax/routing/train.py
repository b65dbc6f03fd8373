"""Builds the router's training data and head: `python -m paged_jax.routing.train [--quick]`.

1. the evaluation set (routing/tasks.py): few-shot questions with checkable answers;
2. labels: each model answers every question greedily (its first line); right or wrong;
   open questions ("define") are labelled by the likelihood each model gives the reference
   answer instead (routing/likelihood.py); the weak model's pass also yields the routing
   features (routing/features.py), exactly as the router computes them at serving time;
3. splits: at random (70 / 30) and by task family (the pair's held-out families in PAIRS,
   chosen before any result of the pair was seen, held out entirely);
4. a head per split (routing/head.py), trained on 80% of its train part and calibrated on
   the other 20%; the random split's head is the one the router loads. Its inputs (the
   named features, all or only the prompt's, and 0-32 principal components of the weak
   model's hidden state) are chosen among CANDIDATES on the train part alone: by
   leave-one-family-out, each candidate's heads rank the requests of a family they never
   saw, and the candidate with the largest mean quality over random routing wins (so the
   choice is made for questions of a new kind, and never looks at the held-out part).

Writes paged_jax/routing/trained/<weak>+<strong>/: `data.npz` (features, labels, family and
difficulty per item), `head` (the router's), and `metrics.json` (accuracies, calibration
error, costs). Pairs: Qwen2.5-Coder 0.5B / 1.5B (the default; all families, code included)
and SmolLM2-135M / Gemma 3 270M (the general families; `--weak smollm2 --strong gemma3`).
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
PROMPT_ONLY = tuple(range(4, len(feat.NAMES)))
CANDIDATES = tuple((cols, k) for cols in (None, PROMPT_ONLY) for k in (0, 4, 8, 16, 32))


def answer(llm: LLM, items: list[Item], probe: bool) -> dict:
    """Greedy answers of one model: correctness [N], output tokens and seconds; with `probe`,
    also the routing features [N, F] from the first position's top logprobs."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["\n"],
                        logprobs=feat.TOP_K if probe else None, return_hidden_states=probe)
    t0 = time.perf_counter()
    outs = llm.generate([it.prompt for it in items], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    res = dict(correct=np.array([it.correct(o.outputs[0].text) for it, o in
                                 zip(items, outs, strict=True)]),
               tokens=int(sum(len(o.outputs[0].token_ids) for o in outs)), seconds=seconds,
               texts=[o.outputs[0].text for o in outs])
    if probe:
        res["x"] = np.stack([feat.features(it.prompt, o.outputs[0].logprobs[0], o.hidden_states)
                             for it, o in zip(items, outs, strict=True)])
    return res


def pair_items(n: int, models: tuple[str, str] = MODELS, seed: int = 0) -> list[Item]:
    """The pair's evaluation set: n items over its families."""
    return make_items(n, seed=seed, families=PAIRS[models][0])


def splits(items: list[Item], models: tuple[str, str] = MODELS, seed: int = 0
           ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Index arrays (train, test): at random, and by family (the pair's held-out ones)."""
    n = len(items)
    perm = np.random.default_rng(seed).permutation(n)
    fam = np.array([it.family in PAIRS[models][1] for it in items])
    return {"random": (np.sort(perm[: int(0.7 * n)]), np.sort(perm[int(0.7 * n):])),
            "family": (np.flatnonzero(~fam), np.flatnonzero(fam))}


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


def choose(x: np.ndarray, y: np.ndarray, family: np.ndarray) -> tuple[tuple, dict]:
    """The candidate whose heads, trained without one family, beat random routing on that
    family by the most (mean over families and over the interior strong shares); and each
    candidate's score."""
    scores = {}
    for cand in CANDIDATES:
        adv = []
        for f in np.unique(family):
            held = family == f
            c = cv.curves(y[held], fit(x[~held], y[~held], cand).gain(x[held]))
            adv.append(np.mean([r["quality"] - q["quality"] for r, q in
                                zip(c["router"][1:-1], c["random"][1:-1], strict=True)]))
        scores[candidate_name(cand)] = float(np.mean(adv))
    best = max(CANDIDATES, key=lambda c: scores[candidate_name(c)])
    return best, scores


def candidate_name(candidate: tuple) -> str:
    """'all+pca4', 'prompt+pca32': which named features, how many components."""
    cols, k = candidate
    return f"{'all' if cols is None else 'prompt'}+pca{k}"


def probe_seconds(weak: LLM, n: int, models: tuple[str, str]) -> float:
    """Seconds per request of the router's probe alone (prefill + one token with its top
    logprobs), on n questions the weak model has not seen (no prefix-cache hits)."""
    items = pair_items(n, models, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=feat.TOP_K,
                        return_hidden_states=True)
    t0 = time.perf_counter()
    weak.generate([it.prompt for it in items], sp, use_tqdm=False)
    return (time.perf_counter() - t0) / n


def modeled_seconds(llm: LLM, prompt_tokens: float, output_tokens: float) -> float:
    """A request's roofline seconds on the paper's GPU (paged_jax/study/cost_model.py) with this
    model's size: one prefill pass, then one pass per further output token (batch 1)."""
    n = sum(x.size for x in jax.tree.leaves(llm.llm_engine.params))
    gpu = GpuCostModel(name="fp16 roofline", weight_bytes=2.0 * n, parameters=float(n))
    pool = 1 << 20  # KV is a rounding error for these short requests
    first = gpu.step_seconds(1, round(prompt_tokens), 0, pool)
    return first + max(output_tokens - 1, 0) * gpu.step_seconds(1, 1, 0, pool)


def costs(weak: LLM, strong: LLM, w: dict, s: dict, items: list[Item],
          models: tuple[str, str]) -> dict:
    """Seconds per request: measured here (batched runs) and modeled on a GPU, per model, and
    the router's probe."""
    prompt = float(np.mean([len(weak.get_tokenizer().encode(it.prompt)) for it in items]))
    out = {m: r["tokens"] / len(items) for m, r in zip(models, (w, s), strict=True)}
    measured = {m: r["seconds"] / len(items) for m, r in zip(models, (w, s), strict=True)}
    measured["probe"] = probe_seconds(weak, max(8, len(items) // 4), models)
    modeled = {m: modeled_seconds(llm, prompt, out[m])
               for m, llm in zip(models, (weak, strong), strict=True)}
    modeled["probe"] = modeled_seconds(weak, prompt, 1)
    return dict(measured_cpu=measured, modeled_gpu=modeled, output_tokens=out)


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


def build(weak: LLM, strong: LLM, items: list[Item], models: tuple[str, str] = MODELS) -> dict:
    """Labels, features, costs, splits and one head per split."""
    w, s = answer(weak, items, probe=True), answer(strong, items, probe=False)
    y = np.stack([w["correct"], s["correct"]], 1).astype(np.float32)
    opened = open_labels(weak, strong, items, y, models)
    heads, fam = {}, np.array([it.family for it in items])
    cost = costs(weak, strong, w, s, items, models)
    for name, (tr, te) in splits(items, models).items():
        cand, scores = choose(w["x"][tr], y[tr], fam[tr])
        head = fit(w["x"][tr], y[tr], cand)
        p = head.predict(w["x"][te])
        head.metrics = dict(
            split=name, train=len(tr), test=len(te), inputs=candidate_name(cand), candidates=scores,
            cost=cost, models=list(models),
            ece=[head_lib.calibration(p[:, j], y[te, j]) for j in range(2)],
            train_gains=sorted(head.gain(w["x"][tr]).round(5).tolist()))
        heads[name] = head
    return dict(x=w["x"], y=y, heads=heads, cost=cost, models=models,
                texts=(w["texts"], s["texts"]), open=opened,
                accuracy=dict(zip(models, y.mean(0).tolist(), strict=True)))


def save(data: dict, items: list[Item], folder: Path | None = None) -> Path:
    """Writes the training data (data.npz), the random split's head, and metrics.json (to
    the pair's folder by default)."""
    models = data["models"]
    folder = (folder or head_lib.pair_folder(*models)).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    arrays = dict(x=data["x"], y=data["y"],
                  family=np.array([list(ALL_FAMILIES).index(it.family) for it in items]),
                  difficulty=np.array([it.difficulty for it in items]))
    np.savez_compressed(folder / "data.npz", **arrays)
    head_lib.save(data["heads"]["random"], folder / "head")
    metrics = dict(models=models, items=len(items), accuracy=data["accuracy"], cost=data["cost"],
                   features=[*feat.NAMES, "hidden state"], families=list(ALL_FAMILIES),
                   held_out_families=PAIRS[tuple(models)][1],
                   inputs={k: h.metrics["inputs"] for k, h in data["heads"].items()},
                   open={k: v for k, v in data["open"].items() if k not in ("index", "scores")},
                   ece={k: h.metrics["ece"] for k, h in data["heads"].items()})
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return folder


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=840)
    ap.add_argument("--quick", action="store_true", help="168 items")
    ap.add_argument("--weak", default=MODELS[0])
    ap.add_argument("--strong", default=MODELS[1])
    ap.add_argument("--out", type=Path, default=None, help="default: the pair's folder")
    args = ap.parse_args(argv)
    models = (args.weak, args.strong)
    if models not in PAIRS:
        raise SystemExit(f"no task set for the pair {models}; pairs: {list(PAIRS)}")
    items = pair_items(168 if args.quick else args.items, models)
    weak, strong = (LLM(m, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512)
                    for m in models)
    data = build(weak, strong, items, models)
    save(data, items, args.out)
    print(json.dumps(dict(accuracy=data["accuracy"], cost=data["cost"]), indent=1))
    return data


if __name__ == "__main__":
    main()
