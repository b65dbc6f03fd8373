"""paged_jax.routing: the question set, features, the head, the curves, and RoutedLLM on two
tiny models (each routed output must be what its model gives alone; nothing lost)."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from paged_jax.routing import curves as cv
from paged_jax.routing import features as feat
from paged_jax.routing import head as head_lib
from paged_jax.routing.router import RoutedLLM
from paged_jax.routing.tasks import FAMILIES, make_item, make_items, table
from paged_jax.routing.train import PAIRS
from tests.routing_helpers import PROMPTS, SP, answered, tiny_pair
from tests.routing_helpers import top as _top


def test_items_are_seeded_graded_and_checkable():
    a, b = make_items(60, seed=3), make_items(60, seed=3)
    assert a == b and a != make_items(60, seed=4)
    grid = {(it.family, it.difficulty) for it in make_items(200)}
    assert grid == {(f, d) for f, (_, ds) in FAMILIES.items() for d in ds}
    for it in a:
        assert it.prompt.endswith("A:") and it.prompt.count("Q: ") == 4
        assert it.correct(f" {it.answer}\nQ: next") and not it.correct(f" {it.answer}0")
    add = make_item("add", 3, random.Random(0))
    q = add.prompt.split("\n")[-2]
    x, y = (int(t.strip("?")) for t in q.removeprefix("Q: What is ").split(" + "))
    assert add.answer == str(x + y)
    look = make_item("lookup", 4, random.Random(1))
    name = look.prompt.split("what does ")[-1].split(" cost?")[0]
    assert (name, look.answer) in table()


def test_features_tell_sure_from_unsure():
    sure = feat.logprob_features(_top([-0.01] + [-8.0] * 19))
    unsure = feat.logprob_features(_top([-2.5] * 20))
    assert sure[0] > unsure[0] and sure[1] > unsure[1] and sure[2] < unsure[2]
    q = "Q: What is 1 + 2?\nA: 3\nQ: What is 4812 + 377?\nA:"
    x = feat.features(q, answered(q, [[-1.0, -2.0]]))
    assert x.shape == (len(feat.NAMES),)
    by = dict(zip(feat.NAMES, x.tolist(), strict=True))
    assert by["digits"] == 7 and by["longest_number"] == 4
    h = np.arange(5, dtype=np.float32)
    with_h = feat.features(q, answered(q, [[-1.0, -2.0]], h))
    assert with_h.shape == (len(feat.NAMES) + 5,) and with_h[-5:].tolist() == h.tolist()


def test_the_answer_window_is_read_as_far_as_the_window():
    q = "Q: What is 1 + 2?\nA:"
    steady = [[-0.1, -5.0]] * 3
    out = answered(q, steady + [[-3.0, -3.1]] * 9, finished=False)  # unsure after the window
    x = dict(zip(feat.NAMES, feat.features(q, out, window=3).tolist(), strict=True))
    assert x["answer_min"] == pytest.approx(-0.1) and x["answer_tokens"] == 3
    assert x["answer_margin_min"] == pytest.approx(4.9) and x["answer_done"] == 0
    y = dict(zip(feat.NAMES, feat.features(q, out, window=8).tolist(), strict=True))
    assert y["answer_min"] == pytest.approx(-3.0) and y["answer_tokens"] == 8
    assert y["answer_margin_min"] == pytest.approx(0.1, abs=1e-5)
    short = answered(q, steady[:2])  # ended inside the window
    z = dict(zip(feat.NAMES, feat.features(q, short, window=3).tolist(), strict=True))
    assert z["answer_done"] == 1 and z["answer_tokens"] == 2
    assert feat.ready(short, 3) and feat.ready(out, 3)
    assert not feat.ready(answered(q, steady[:2], finished=False), 3)


def test_head_learns_calibrates_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 3)).astype(np.float32)
    y = np.stack([x[:, 0] < 0.3, x[:, 1] + 0.3 * rng.standard_normal(600) > 0], 1)
    y = y.astype(np.float32)
    head = head_lib.train(x[:400], y[:400], steps=300)
    p = head.predict(x[400:])
    assert ((p > 0.5) == y[400:]).mean() > 0.85
    sharp = dataclasses.replace(head, params={**head.params, "w2": head.params["w2"] * 4,
                                              "b2": head.params["b2"] * 4})
    fixed = head_lib.calibrate(sharp, x[:400], y[:400])
    ece = lambda h: head_lib.calibration(h.predict(x[400:])[:, 1], y[400:, 1])  # noqa: E731
    assert ece(fixed) < ece(sharp)
    gain = head.gain(x)
    assert abs((gain > head_lib.threshold_for_share(gain, 0.3)).mean() - 0.3) < 0.01
    head.metrics = dict(note="kept")
    back = head_lib.load(head_lib.save(head, tmp_path / "h"))
    np.testing.assert_array_equal(back.predict(x), head.predict(x))
    assert back.metrics == head.metrics
    with pytest.raises(FileNotFoundError, match="python -m paged_jax.routing.train"):
        head_lib.load(tmp_path / "none")


def test_members_and_the_hidden_state_projection(tmp_path):
    """Three members average; a head reads its label off a direction of the hidden state
    through the PCA projection (the named features are noise), and saves and loads it."""
    rng = np.random.default_rng(1)
    b, n = len(feat.NAMES), 600
    h = rng.standard_normal((n, 12)).astype(np.float32) * np.linspace(3, 0.5, 12)
    x = np.concatenate([rng.standard_normal((n, b)).astype(np.float32), h], 1)
    y = np.stack([h[:, 0] > 0, h[:, 0] < 0], 1).astype(np.float32)
    center, comps = head_lib.pca(x[:400, b:], 2)
    assert comps.shape == (12, 2) and abs(comps[0, 0]) > 0.9  # the widest direction first
    inputs = head_lib.inputs(x[:400], b, (0, 1), center, comps)
    assert inputs.shape == (400, 4)
    head = dataclasses.replace(
        head_lib.train(inputs, y[:400], steps=300, members=3, names=feat.NAMES),
        columns=(0, 1), center=center, components=comps)
    assert head.params["w1"].shape == (3, 4, head_lib.HIDDEN)
    head = head_lib.calibrate(head, x[:400], y[:400])
    assert head.temperature.shape == (3, 2)
    assert ((head.gain(x[400:]) > 0) == y[400:, 1].astype(bool)).mean() > 0.9
    each = [dataclasses.replace(head, params={k: v[m:m + 1] for k, v in head.params.items()},
                                temperature=head.temperature[m:m + 1]) for m in range(3)]
    np.testing.assert_allclose(np.mean([e.predict(x) for e in each], 0), head.predict(x),
                               rtol=1e-5)
    with pytest.raises(ValueError, match="hidden state of size 12, but the features carry 5"):
        head.gain(x[:, :b + 5])  # a weak model with another hidden size
    back = head_lib.load(head_lib.save(head, tmp_path / "h"))
    assert back.columns == (0, 1)
    np.testing.assert_allclose(back.gain(x), head.gain(x), rtol=1e-6)


def test_choose_finds_the_inputs_that_carry_over_to_unseen_rows(monkeypatch):
    """Labels set by the hidden state in every family, named features that mean something
    different in each: cross-validation picks the hidden state's components."""
    from paged_jax.routing import train

    rng = np.random.default_rng(2)
    b, n = len(feat.NAMES), 480
    family = np.repeat(np.arange(4), n // 4)
    h = rng.standard_normal((n, 8)).astype(np.float32) * np.linspace(3, 0.5, 8)
    named = rng.standard_normal((n, b)).astype(np.float32)
    sign = np.where(family % 2, 1.0, -1.0)  # named feature 0 flips its meaning by family
    y = np.stack([named[:, 0] * sign > 0, h[:, 0] > 0], 1).astype(np.float32)
    x = np.concatenate([named, h], 1)
    monkeypatch.setattr(train, "CANDIDATES", ((None, 0), (None, 2)))
    best, scores = train.choose(x, y)
    assert best == (None, 2) and scores["all+pca2"] > scores["all+pca0"] + 0.05


def test_curves_on_a_known_case():
    # 10 requests: 4 both right, 3 only strong right, 1 only weak right, 2 both wrong.
    y = np.array([[1, 1]] * 4 + [[0, 1]] * 3 + [[1, 0]] + [[0, 0]] * 2, np.float64)
    perfect = y[:, 1] - y[:, 0]
    c = cv.curves(y, perfect)
    assert c["weak"][0]["quality"] == 0.5 and c["strong"][0]["quality"] == pytest.approx(0.7)
    assert [p["quality"] for p in c["oracle"]][:4] == pytest.approx([0.5, 0.6, 0.7, 0.8])
    assert c["router"] == c["oracle"]
    assert cv.gap_recovered(c["router"], 0.5, 0.7, 0.5) == pytest.approx(1.5)
    assert c["random"][5]["quality"] == pytest.approx(0.6)
    saved = cv.cost_saved_at(y, perfect, cost_weak=1.0, cost_strong=4.0, cost_probe=0.5)
    # 95% of 0.7 is 0.665: two moved requests (0.7) reach it; 0.8 * 1 + 0.2 * 4.5 = 1.7
    assert saved["strong_share"] == 0.2 and saved["cost_saved"] == pytest.approx(1 - 1.7 / 4)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def test_routed_outputs_are_each_models_own(pair):
    weak, strong, head = pair
    thr = float(np.median(head.gain(np.stack([feat.features(p, answered(p, [[-1.0, -2.0]]))
                                              for p in PROMPTS]))))
    router = RoutedLLM(weak, strong, head, threshold=thr, names=("w", "s"))
    outs = router.generate(PROMPTS, SP)
    assert [o.prompt for o in outs] == PROMPTS  # all served, in order
    assert {o.model for o in outs} == {"w", "s"}
    alone = {"w": weak.generate(PROMPTS, SP, use_tqdm=False),
             "s": strong.generate(PROMPTS, SP, use_tqdm=False)}
    for i, o in enumerate(outs):
        route = router.routes[o.request_id]
        assert route.model == o.model and (route.gain > thr) == (o.model == "s")
        assert o.outputs[0].token_ids == alone[o.model][i].outputs[0].token_ids
        assert o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None
        assert o.hidden_states is None  # the router asked for it, the caller did not
        assert len(route.features) == len(feat.NAMES) + tiny_config().hidden_size
        assert route.features[feat.NAMES.index("answer_tokens")] == 2  # the head's window
    assert not weak.llm_engine.has_unfinished() and not strong.llm_engine.has_unfinished()
    # a moved request's prompt blocks stay in the weak model's prefix cache
    moved = next(i for i, o in enumerate(outs) if o.model == "s")
    again = weak.generate(PROMPTS[moved], SP, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 8


def test_kept_requests_cost_the_weak_model_nothing_more(pair):
    """Two equal weak engines: one serves the prompts alone (with the router's logprobs), one
    through a router that keeps everything; they compute the same tokens."""
    _, strong, head = pair
    probe = dataclasses.replace(SP, logprobs=feat.TOP_K)
    cfg, tok = tiny_config(), byte_tokenizer()
    mk = lambda: LLM(model_parts=(cfg, random_params(cfg, seed=0), tok), max_num_seqs=8,  # noqa: E731
                     max_num_batched_tokens=64, max_model_len=256, block_size=8,
                     num_kv_blocks=160, enable_prefix_caching=False, static_shapes=True)
    a, b = mk(), mk()
    a.generate(PROMPTS, probe, use_tqdm=False)
    outs = RoutedLLM(b, strong, head, threshold=np.inf).generate(PROMPTS, SP)
    assert {o.model for o in outs} == {"weak"}
    work = lambda llm: sum(s.num_tokens for s in llm.llm_engine.stats)  # noqa: E731
    assert work(b) == work(a)  # no prompt computed twice


def test_logprobs_the_caller_asked_for_survive(pair):
    weak, strong, head = pair
    sp = dataclasses.replace(SP, logprobs=2)
    out = RoutedLLM(weak, strong, head, threshold=np.inf).generate(PROMPTS[:2], sp)
    own = weak.generate(PROMPTS[:2], sp, use_tqdm=False)
    for o, w in zip(out, own, strict=True):
        assert [set(p) for p in o.outputs[0].logprobs] == [set(p) for p in w.outputs[0].logprobs]
        assert o.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob)


def test_shares_and_bad_values(pair):
    weak, strong, head = pair
    head = dataclasses.replace(head, metrics=dict(train_gains=list(np.linspace(-1, 1, 101))))
    assert {o.model for o in RoutedLLM(weak, strong, head, strong_share=1.0).generate(
        PROMPTS[:3], SP)} == {"strong"}
    assert {o.model for o in RoutedLLM(weak, strong, head, strong_share=0.0).generate(
        PROMPTS[:3], SP)} == {"weak"}
    with pytest.raises(ValueError, match="strong_share must be in"):
        RoutedLLM(weak, strong, head, strong_share=1.5)
    with pytest.raises(ValueError, match="sampling_params"):
        RoutedLLM(weak, strong, head).generate(PROMPTS[:2], [SP])


def test_a_cost_budget_sets_the_share(pair):
    from paged_jax.routing.router import share_for_budget

    weak, strong, head = pair
    cost = dict(modeled_gpu=dict(w=1.0, s=4.0, probe=0.5))
    head = dataclasses.replace(head, metrics=dict(
        models=["w", "s"], cost=cost, train_gains=list(np.linspace(-1, 1, 101))))
    # (1 - s) * 1 + s * 4.5 = 0.5 * 4  ->  s = 1 / 3.5
    assert share_for_budget(head, 0.5) == pytest.approx(1 / 3.5)
    assert share_for_budget(head, 0.1) == 0.0 and share_for_budget(head, 2.0) == 1.0
    router = RoutedLLM(weak, strong, head, cost_budget=0.5, strong_share=0.9)
    gains = np.asarray(head.metrics["train_gains"])
    assert (gains > router.threshold).mean() == pytest.approx(1 / 3.5, abs=0.01)
    with pytest.raises(ValueError, match="cost_budget must be a positive"):
        RoutedLLM(weak, strong, head, cost_budget=0.0)
    with pytest.raises(ValueError, match="no per-model costs"):
        RoutedLLM(weak, strong, dataclasses.replace(head, metrics={}), cost_budget=0.5)


def test_build_labels_features_and_saves(pair, tmp_path, monkeypatch):
    """routing.train on two tiny models: labels from each model's own answers, features from
    the weak one's, the shipped head (its inputs chosen among two candidates) and
    out-of-fold predictions, everything saved and loaded back."""
    from paged_jax.routing import likelihood as lk
    from paged_jax.routing import train

    weak, strong, _ = pair
    monkeypatch.setattr(train, "CANDIDATES", ((None, 0), (train.PROMPT_ONLY, 4)))
    monkeypatch.setattr(train, "FOLDS", 2)
    monkeypatch.setattr(train, "COST_ITEMS", 8)
    items = train.pair_items(len(train.PAIRS[train.MODELS][0]) * 4, seed=9)
    data = train.build(weak, strong, items)
    width = len(feat.NAMES) + tiny_config().hidden_size  # named features, hidden state
    assert data["x"].shape == (len(items), width) and data["y"].shape == (len(items), 2)
    own = weak.generate([it.prompt for it in items[:4]], SamplingParams(
        temperature=0.0, max_tokens=train.MAX_TOKENS, stop=["\n"]), use_tqdm=False)
    assert data["texts"][0][:4] == [o.outputs[0].text for o in own]
    checked = [i for i, it in enumerate(items) if not it.open]
    assert data["y"][checked, 0].tolist() == [float(items[i].correct(data["texts"][0][i]))
                                              for i in checked]
    opened = data["open"]  # open items: labelled by the reference's likelihood
    assert opened["index"] == [i for i, it in enumerate(items) if it.open] != []
    assert data["y"][opened["index"]].tolist() == lk.labels(np.array(opened["scores"]))[
        0].tolist()
    held_out = set(train.PAIRS[train.MODELS][1])
    te = train.held_out(items)
    assert {it.family for it, h in zip(items, te, strict=True) if h} == held_out
    assert not {it.family for it, h in zip(items, te, strict=True) if not h} & held_out
    assert data["oof"].shape == (len(items), 2) and np.isfinite(data["oof"]).all()
    assert data["x_first"].shape == data["x"].shape
    x1 = dict(zip(feat.NAMES, data["x_first"][0].tolist(), strict=False))
    assert x1["answer_tokens"] == 1  # the first token only
    costs = {*train.MODELS, "probe", "probe_first_token"}
    assert set(data["cost"]["measured_cpu"]) == costs
    assert all(v > 0 for v in data["cost"]["measured_cpu"].values())
    assert train.save(data, items, tmp_path) == tmp_path
    assert json.loads((tmp_path / "metrics.json").read_text())["held_out_families"] == list(
        train.PAIRS[train.MODELS][1])
    head = head_lib.load(tmp_path / "head")
    np.testing.assert_allclose(head.gain(data["x"]), data["head"].gain(data["x"]))
    assert head.metrics["window"] == feat.WINDOW and (tmp_path / "metrics.json").is_file()
    assert set(head.metrics["candidates"]) == {"all+pca0", "prompt+pca4"}
    assert head.metrics["inputs"] in head.metrics["candidates"]
    assert set(head.metrics["cost"]["modeled_gpu"]) == costs


def test_slo_mode_keeps_requests_off_a_backed_up_strong_model(pair):
    from paged_jax.routing import sla

    weak, strong, head = pair
    eng = strong.llm_engine
    assert sla.Estimate(None, None).meets(1e-9, 1e-9)  # no history: assumed to meet it
    strong.generate(PROMPTS, SP, use_tqdm=False)  # history: prefill rate, decode step time
    est = sla.estimate(eng, 10)
    assert est.ttft > 0 and est.tpot > 0
    for i in range(6):  # a queue the estimate must see
        eng.add_request(f"backlog{i}", "x" * 300, SP)
    assert sla.queued_tokens(eng) >= 1800 and sla.estimate(eng, 10).ttft > 50 * est.ttft
    # routed at the first token: the backlog is what the strong model has then
    always = dataclasses.replace(head, metrics=dict(train_gains=[-1.0], window=1))
    router = RoutedLLM(weak, strong, always, threshold=-np.inf, ttft_slo=20 * est.ttft)
    outs = router.generate(PROMPTS[:3], SP)
    assert {o.model for o in outs} == {"weak"}
    assert all(r.held_by_slo for r in router.routes.values())
    while eng.has_unfinished():  # drain the backlog: now the strong model meets the bound
        eng.step()
    outs = router.generate(PROMPTS[:3], SP)
    assert {o.model for o in outs} == {"strong"}
    with pytest.raises(ValueError, match="ttft_slo must be a positive"):
        RoutedLLM(weak, strong, head, ttft_slo=0)


WEAK_HIDDEN = {"smollm2": 576, "qwen2.5-coder-0.5b": 896}  # the weak models' hidden sizes


@pytest.mark.parametrize("pair_", list(PAIRS), ids="+".join)
def test_the_shipped_heads_match_the_features(pair_):
    """paged_jax/routing/trained/<weak>+<strong> (committed; `python -m paged_jax.routing.train
    --weak W --strong S` rebuilds it) loads, speaks the current feature names, knows its
    training gains and takes the weak model's hidden state."""
    from paged_jax.routing import train

    head = head_lib.load(head_lib.pair_folder(*pair_) / "head")
    k = head.components.shape[1]
    assert head.names == feat.NAMES and head.metrics["inputs"].endswith(f"pca{k}")
    assert head.metrics["models"] == list(pair_)
    assert head.params["w1"].shape[:2] == (train.MEMBERS, len(head.columns or feat.NAMES) + k)
    gains = head.metrics["train_gains"]
    assert len(gains) > 100 and gains == sorted(gains)
    hidden = WEAK_HIDDEN[pair_[0]]
    assert head.center.shape in ((0,), (hidden,))
    p = head.predict(np.zeros((3, len(feat.NAMES) + hidden), np.float32))
    assert p.shape == (3, 2) and np.all((p > 0) & (p < 1))


def test_a_bad_request_leaves_nothing_queued(pair):
    weak, strong, head = pair
    router = RoutedLLM(weak, strong, head)
    with pytest.raises(ValueError, match="max_model_len"):
        router.generate(PROMPTS[:2] + ["x" * 5000], SP)
    assert not weak.llm_engine.has_unfinished() and not weak.llm_engine.requests


def test_reference_likelihood_is_a_dense_forwards_per_byte(pair):
    """The score of a reference is a dense forward's log-softmax summed over the reference's
    tokens, per byte; the median cut halves the labels."""
    from paged_jax.cache.config import CacheConfig
    from paged_jax.models.reference_loop import PagedLoop
    from paged_jax.routing import likelihood as lk

    weak, strong, _ = pair
    refs = [" a cat.", " 42", " no idea at all", " Paris."]
    got = lk.reference_logprob(weak, PROMPTS[:4], refs)
    cfg, tok = tiny_config(), weak.get_tokenizer()
    params = random_params(cfg, seed=0)
    for g, p, r in zip(got, PROMPTS, refs, strict=False):
        ids, k = tok.encode(p + r), len(tok.encode(p))
        logits = PagedLoop(cfg, params, CacheConfig(64, 8, 1, 32)).step([ids], all_logits=True)
        lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        want = sum(lp[i - 1, ids[i]] for i in range(k, len(ids))) / len(r.encode())
        assert g == pytest.approx(want, abs=2e-4)
    other = lk.reference_logprob(strong, PROMPTS[:4], refs)
    y, cut = lk.labels(np.stack([got, other], 1))
    assert y.shape == (4, 2) and y.mean() == 0.5 and cut == pytest.approx(np.median(
        np.r_[got, other]))
