"""`python -m experiments.rejudge`: the stored verdicts are the one rule's on the stored rounds
(a second pass changes nothing), and a verdict written by the old rule is caught."""

from __future__ import annotations

import copy
import json

import pytest

from experiments import common, rejudge


@pytest.mark.parametrize("name", rejudge.FILES)
def test_the_committed_files_hold_the_rules_verdicts(name):
    data = json.loads((common.RESULTS / f"{name}.json").read_text())
    assert rejudge.rejudge_file(copy.deepcopy(data), name) == []


def test_an_old_rule_verdict_is_changed():
    """speculative.json's chat batch 16 cell: k = 4 was slower than plain in every round,
    which the old rule (medians within both spreads) called not separable."""
    data = json.loads((common.RESULTS / "speculative.json").read_text())
    cell = data["cells"]["chat batch 16"]["ngram 4"]
    assert cell["vs_plain"]["verdict"] == "lower"
    cell["vs_plain"]["verdict"] = "not separable"
    changes = rejudge.rejudge_file(data, "speculative")
    assert [(c["path"], c["before"], c["after"]) for c in changes] == [
        ("cells/chat batch 16/ngram 4/vs_plain", "not separable", "lower")]


def test_a_met_bar_with_a_round_under_it_is_caught():
    data = json.loads((common.RESULTS / "moe.json").read_text())
    g = data["decode"]["grouped_over_dense"]
    g["runs"] = [g["target"] - 0.1] + g["runs"][1:]  # one round under the bar
    changes = rejudge.rejudge_file(data, "moe")
    assert {c["after"] for c in changes} == {"not separable"}
