"""Synthetic workloads: the paper's means, Poisson gaps, seeding, exact prompt lengths."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.models.testing import byte_tokenizer
from paged_jax.study.workloads import (
    ALPACA,
    SHAREGPT,
    arrivals,
    describe,
    make_workload,
    sample_lengths,
    text_prompt,
)


@pytest.mark.parametrize("dist", [SHAREGPT, ALPACA])
def test_length_means_match_the_paper(dist):
    inp, out = sample_lengths(dist, 200_000, np.random.default_rng(0))
    assert inp.mean() == pytest.approx(dist.input_mean, rel=0.03)
    assert out.mean() == pytest.approx(dist.output_mean, rel=0.03)
    assert inp.min() >= 1 and out.min() >= 1


def test_scale_and_clipping():
    inp, out = sample_lengths(SHAREGPT, 100_000, np.random.default_rng(1), scale=0.25)
    assert out.mean() == pytest.approx(SHAREGPT.output_mean * 0.25, rel=0.03)
    inp, out = sample_lengths(SHAREGPT, 10_000, np.random.default_rng(1), 1.0, 256)
    assert inp.max() <= 128 and (inp + out).max() <= 256


def test_sharegpt_is_long_tailed():
    _, out = sample_lengths(SHAREGPT, 100_000, np.random.default_rng(2))
    assert np.percentile(out, 99) > 5 * np.median(out)


@pytest.mark.parametrize("cv", [1.0, 2.0])
def test_arrival_gaps_have_mean_one_over_rate(cv):
    t = arrivals(100_000, 4.0, np.random.default_rng(3), cv)
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert np.all(arrivals(5, float("inf"), np.random.default_rng(0)) == 0)


def test_seeded_and_exact_prompt_lengths():
    tok = byte_tokenizer()
    a = make_workload("sharegpt", 50, 2.0, tok, seed=7, scale=0.25, max_model_len=256)
    b = make_workload("sharegpt", 50, 2.0, tok, seed=7, scale=0.25, max_model_len=256)
    c = make_workload("sharegpt", 50, 2.0, tok, seed=8, scale=0.25, max_model_len=256)
    assert a == b and a != c
    assert all(len(w.prompt_token_ids) + w.output_len <= 256 for w in a)
    assert tok.decode(a[0].prompt_token_ids, True) in tok.decode(text_prompt(400, tok), True)
    assert describe(a)["n"] == 50 and a[3].params().max_tokens == a[3].output_len
