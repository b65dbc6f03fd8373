"""The project's one verdict rule (experiments/common.py): on paired rounds a bar is "met" only
when the worst round clears it, "not met" when the best round misses it, "not separable"
otherwise; "not slower" is a bound with a number."""

import pytest

from experiments import common


@pytest.mark.parametrize("runs, verdict", [
    ([1.20, 1.25, 1.30], "met"),            # the worst round, 1.30, is under 1.5
    ([1.20, 1.25, 1.55], "not separable"),  # one round over the bar
    ([1.40, 1.48, 1.49], "met"),            # every round under: a small margin is enough
    ([1.45, 1.60, 1.80], "not separable"),  # the best round clears it
    ([1.60, 1.70, 1.80], "not met"),        # even the best round misses
])
def test_the_worst_round_decides_met_the_best_not_met(runs, verdict):
    v = common.target_verdict(runs, 1.5, higher_is_better=False)
    assert v["verdict"] == verdict and v["rounds"] == 3
    assert (v["worst"], v["best"]) == (max(runs), min(runs))


def test_a_median_past_the_bar_with_one_slow_round_is_not_met():
    """What the old median-and-half-range rule called met: median 1.8 clears 1.5 by 0.3 >
    the half-range 0.25, yet one round (1.3) misses the bar."""
    assert common.target_verdict([1.3, 1.8, 1.8], 1.5)["verdict"] == "not separable"


def test_one_run_says_it_has_no_spread():
    assert "no spread" in common.target_verdict([2.0], 1.0)["verdict"]


@pytest.mark.parametrize("ours, theirs, verdict", [
    ([100, 104, 108], [80, 82, 84], "higher"),
    ([100, 104, 108], [98, 103, 110], "not separable"),
    ([60, 61, 62], [80, 82, 84], "lower"),
    ([100, 104, 108], [101, 99, 107], "not separable"),  # round 1 lower, the others higher
])
def test_compare_is_a_ratio_with_a_verdict_on_its_rounds(ours, theirs, verdict):
    cmp = common.compare(ours, theirs)
    medians = sorted(ours)[1] / sorted(theirs)[1]
    assert cmp["verdict"] == verdict and cmp["ratio"] == pytest.approx(medians)
    assert cmp["round_ratios"] == pytest.approx(
        [a / b for a, b in zip(ours, theirs, strict=True)])


def test_not_slower_is_a_bound_with_a_number():
    """Chat at batch 16 at 0.90x passed the old "not slower" (the drop within both spreads
    added); against the bound 0.95 every round misses it."""
    plain = [100.0, 98.0, 103.0, 101.0, 99.0]
    ngram = [90.0, 88.0, 93.0, 91.0, 89.0]
    assert common.not_slower(ngram, plain)["verdict"] == "not met"
    assert common.not_slower([99.0, 97.0, 103.0, 100.0, 98.0], plain)["verdict"] == "met"


def test_unpaired_runs_take_the_extreme_ratios():
    assert common.round_ratios([10, 12], [5, 6, 8]) == [10 / 8, 12 / 5]


def test_provenance_names_the_cpu_generation_and_its_kernel_isa(tmp_path, monkeypatch):
    """A results file records the CPU's family / model and the ISA flags that pick kernel
    paths, read from /proc/cpuinfo's first processor (a model name alone, "AMD EPYC", named
    no generation)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n"
                       "model\t\t: 2\nstepping\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
                       "\nprocessor\t: 1\ncpu family\t: 99\n")
    real = common.Path
    monkeypatch.setattr(common, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real(p))
    assert common.cpu_id() == {"vendor": "AuthenticAMD", "cpu family": 26, "model": 2,
                               "stepping": 1, "isa": ["avx2", "avx512f", "avx512_bf16"]}
    monkeypatch.setattr(common, "Path", lambda p: tmp_path / "missing")
    assert common.cpu_id() == {}
