"""The README's numbers are traceable: each quoted result sits in a block naming its results
file, appears in that file, and the file records how it was made (experiments/provenance.py);
`make experiments` makes every such file; outside the blocks the README quotes no result."""

import json
import re

import pytest

from experiments import provenance as pv
from experiments.run_all import FULL

README = (pv.ROOT / "README.md").read_text()
# What a measured result looks like in prose: a speed, a ratio, a share, a latency.
MEASUREMENT = re.compile(r"\d(?:[\d,]*\.?\d*)\s?(?:tok/s|x\b|%|ms\b|GB/s|req/s)")


def test_every_quoted_number_is_in_its_results_file():
    assert pv.blocks(README), "the README quotes no results blocks"
    assert pv.untraced(README) == []


def test_results_files_exist_with_their_provenance():
    for files, _ in pv.blocks(README):
        for f in files:
            data = json.loads((pv.ROOT / f).read_text())
            prov = data["provenance"]
            assert {"commit", "time", "cpu", "cpus", "versions", "command"} <= set(prov), f


def test_make_experiments_produces_every_quoted_file():
    made = {m.__name__.split(".")[-1] for m, _ in FULL}
    for files, _ in pv.blocks(README):
        for f in files:
            assert pv.writer(f) in made, f"{f}: `make experiments` does not run {pv.writer(f)}"


def test_no_result_is_quoted_outside_a_block():
    found = MEASUREMENT.findall(pv.outside(README))
    assert found == [], f"results quoted without a results file: {found}"


@pytest.mark.parametrize("shown, pool, ok", [
    ("253", [253.4], True), ("1.93", [1.934], True), ("79%", [0.7912], True),
    ("1.5", [1.7], False), ("12", [0.5], False), ("-0.5", [-0.49], True)])
def test_tracing_rounds_as_shown(shown, pool, ok):
    assert pv.traced(shown.rstrip("%"), pool) is ok
