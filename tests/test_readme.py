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
    """Or, for results only a GPU can make, the make target that does (pv.GPU_WRITERS)."""
    made = {m.__name__.split(".")[-1] for m, _ in FULL}
    makefile = (pv.ROOT / "Makefile").read_text()
    for files, _ in pv.blocks(README):
        for f in files:
            if (target := pv.GPU_WRITERS.get(pv.writer(f))) is not None:
                assert f"\n{target}:" in makefile, f"{f}: no `make {target}`"
                continue
            assert pv.writer(f) in made, f"{f}: `make experiments` does not run {pv.writer(f)}"


def test_no_result_is_quoted_outside_a_block():
    found = MEASUREMENT.findall(pv.outside(README))
    assert found == [], f"results quoted without a results file: {found}"


# A results file as the experiments write them: records side by side, repeated runs, a target.
FIXTURE = {
    "rows": [{"side": "ours", "tok_s": 296.6, "ttft_ms": 91.7},
             {"side": "vllm", "tok_s": 113.5, "ttft_ms": 101.0}],
    "greedy": {"same": 9, "of": 16},
    "share": 0.8212,
    "runs": [5.940421596394375, 4.53989361541718],
    "speedup": 2.614,
}
TRUE = "ours 296.6 tok/s, 2.61x vLLM's, 82.1% of the limit, 9 / 16 equal, 91.7 / 101 ms"


@pytest.mark.parametrize("planted, why", [
    ("987.65x", "a ratio read whole: never as its integer part"),
    ("2.62x", "a ratio at the precision shown"),
    ("1.31x", "not the quotient of two repeated runs"),
    ("2.613x", "not a quotient of two stored values (296.6 / 113.5): ratios are stored"),
    ("91.7 / 91.7", "a pair: the same field of two records, in their order"),
    ("82.2%", "a percentage at the precision shown"),
    ("8.2%", "not a percentage of a value a factor of 10 away"),
    ("10 / 16", "a pair stored side by side"),
    ("16 / 9", "a pair in its order"),
    ("296.7", "a plain number at the precision shown"),
    ("-296.6", "the sign"),
])
def test_a_planted_number_fails(planted, why):
    """The true sentence traces; each planted figure in it makes the check fail."""
    from experiments.readme_numbers import Pool, untraced

    pool = Pool([FIXTURE])
    assert untraced(TRUE, pool) == []
    bad = untraced(f"{TRUE}; and {planted}", pool)
    assert bad and all(b in planted for b in bad), why


def test_numbers_are_read_whole():
    from experiments.readme_numbers import PAIR, TOKEN

    read = [(m["num"], m["unit"]) for m in TOKEN.finditer("2.61x, 82%, 91.7 ms, 16k, 5B, 4.3.")]
    assert read == [("2.61", "x"), ("82", "%"), ("91.7", None), ("4.3", None)]
    assert [m.group(0) for m in PAIR.finditer("9 / 16, 192/192, n = 2 / 4 / 6")] == [
        "9 / 16", "192/192"]


@pytest.mark.parametrize("shown, unit, value, ok", [
    ("253", None, 253.4, True), ("1.93", None, 1.934, True), ("79", "%", 0.7912, True),
    ("1.5", None, 1.7, False), ("12", None, 0.5, False), ("-0.5", None, -0.49, True),
    ("0.5", None, -0.49, False), ("79", None, 0.7912, False)])
def test_tracing_rounds_as_shown(shown, unit, value, ok):
    from experiments.readme_numbers import Pool

    assert Pool([{"v": value}]).has(shown, unit) is ok


@pytest.mark.parametrize("true, planted", [
    ("1.488x", "1.588x"), ("79.917%", "97.917%"), ("192/192 equal", "191/192 equal"),
    ("87.1%", "88.1%"), ("2.468 ms", "2.568 ms")])
def test_a_number_planted_in_the_readme_fails(true, planted):
    """The README's own GPU block: one figure changed, the check names it."""
    assert README.count(true) == 1
    bad = pv.untraced(README.replace(true, planted))
    assert len(bad) == 1 and bad[0].startswith(planted.split()[0]), bad


def test_the_readme_prints_every_target_with_the_verdict_its_file_holds():
    shown = pv.TARGETS_BLOCK.search(README)
    assert shown, "the README has no targets table"
    assert shown["table"] == pv.targets_table(README)
    assert "| not met |" in shown["table"]  # failed targets are written as failed


def test_a_changed_verdict_in_a_file_fails_the_table(tmp_path, monkeypatch):
    import json
    import shutil

    root = tmp_path / "repo"
    (root / "results").mkdir(parents=True)
    for f in ("results/moe.json",):
        shutil.copy(pv.ROOT / f, root / f)
    data = json.loads((root / "results/moe.json").read_text())
    (name, target), = data["targets"].items()
    target["verdict"] = "not met" if target["verdict"] == "met" else "met"
    (root / "results/moe.json").write_text(json.dumps(data))
    monkeypatch.setattr(pv, "ROOT", root)
    readme = "<!-- results: results/moe.json -->\n<!-- /results -->"
    assert f"| {name} | {target['verdict']} |" in pv.targets_table(readme)
