"""Targets that can fail: "met" needs a margin larger than the runs' spread, and a tie within
the noise is "not separable" (experiments/common.py)."""

import pytest

from experiments import common


@pytest.mark.parametrize("runs, verdict", [
    ([1.20, 1.25, 1.30], "met"),            # 1.25 clears 1.5 by 0.25 > spread 0.05
    ([1.40, 1.48, 1.60], "not separable"),  # margin 0.02 < spread 0.10
    ([1.60, 1.70, 1.80], "not met"),
])
def test_target_verdict_needs_a_margin_past_the_spread(runs, verdict):
    assert common.target_verdict(runs, 1.5, higher_is_better=False)["verdict"] == verdict


def test_one_run_says_it_has_no_spread():
    assert "no spread" in common.target_verdict([2.0], 1.0)["verdict"]


@pytest.mark.parametrize("ours, theirs, verdict", [
    ([100, 104, 108], [80, 82, 84], "higher"),
    ([100, 104, 108], [98, 103, 110], "not separable"),
    ([60, 61, 62], [80, 82, 84], "lower"),
])
def test_compare_is_a_ratio_with_a_verdict(ours, theirs, verdict):
    cmp = common.compare(ours, theirs)
    assert cmp["verdict"] == verdict and cmp["ratio"] == pytest.approx(ours[1] / theirs[1])
