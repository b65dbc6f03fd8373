"""Where every README number comes from, and which results are older than their code.

    python -m experiments.provenance            every README table: its results files, the
                                                commit and date they were measured on
    python -m experiments.provenance --stale    only the tables whose results predate a change
                                                to the code they measure (rerun those)

The README quotes results inside blocks that name their files (and goals inside
`<!-- targets -->` ... `<!-- /targets -->`):

    <!-- results: results/bench.json -->
    ...numbers quoted from that file...
    <!-- /results -->

`tests/test_readme.py` checks that every number inside a block appears in its files (as
written there, or rounded to the digits shown, or as a percentage of a fraction), that every
file exists with its provenance, that `make experiments` produces it, and that the rest of
the README quotes no measurement.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- results: (?P<files>[^>]*?) -->(?P<body>.*?)<!-- /results -->", re.S)
# Targets, not results: goals an experiment is measured against (e.g. the GPU table's bounds).
TARGETS = re.compile(r"<!-- targets -->.*?<!-- /targets -->", re.S)
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w])")
# The experiment module that writes each results file (results/<name>.json <- experiments/<name>)
WRITERS = {"headline_memory": "headline", "headline_latency": "headline",
           "headline_bench": "headline"}


def blocks(readme: str) -> list[tuple[list[str], str]]:
    """(results files, quoted text) of every results block."""
    return [(m["files"].split(), m["body"]) for m in BLOCK.finditer(readme)]


def outside(readme: str) -> str:
    """The README without its results blocks and targets."""
    return TARGETS.sub("", BLOCK.sub("", readme))


def writer(path: str) -> str:
    """The experiment module behind a results file: as its provenance names it, else (files
    written before it did) by the file's name."""
    prov = json.loads((ROOT / path).read_text()).get("provenance", {})
    if "experiment" in prov:
        return prov["experiment"].removeprefix("experiments.")
    stem = Path(path).stem
    if stem in WRITERS:
        return WRITERS[stem]
    return "bench" if stem.startswith("bench_") and stem != "bench_serving" else stem


def values(obj) -> list[float]:
    """Every number in a results file: numeric leaves and numbers inside strings."""
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in values(x)]
    if isinstance(obj, list):
        return [v for x in obj for v in values(x)]
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, int | float):
        return [float(obj)]
    return [float(n.replace(",", "")) for n in NUMBER.findall(str(obj))]


def traced(shown: str, pool: list[float]) -> bool:
    """Whether a number as shown (e.g. "253", "1.93", "79") is some value of `pool` rounded
    to the digits shown, or that value as a percentage."""
    text = shown.replace(",", "")
    digits = len(text.split(".")[1]) if "." in text else 0
    want = float(text)
    tol = 0.5 * 10 ** -digits + 1e-9
    return any(abs(v - want) <= tol or abs(100 * v - want) <= tol or abs(abs(v) - want) <= tol
               for v in pool)


def untraced(readme: str) -> list[str]:
    """Numbers inside results blocks that no value of their files accounts for."""
    bad = []
    for files, body in blocks(readme):
        pool = [v for f in files for v in values(json.loads((ROOT / f).read_text()))]
        bad += [f"{n} (in a block from {', '.join(files)})" for n in NUMBER.findall(body)
                if not traced(n, pool)]
    return bad


def stale(path: str) -> list[str]:
    """Commits since the results file's own that touched the code it measures."""
    data = json.loads((ROOT / path).read_text())
    commit = data.get("provenance", {}).get("commit", "unknown").removesuffix("+dirty")
    deps = ["paged_jax", "kernels", f"experiments/{writer(path)}.py"]
    out = subprocess.run(["git", "log", "--format=%h %s", f"{commit}..HEAD", "--", *deps],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        return [f"(commit {commit} is not in this history)"]
    return [line[:100] for line in out.stdout.splitlines()]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stale", action="store_true", help="only tables to rerun")
    a = ap.parse_args(argv)
    readme = (ROOT / "README.md").read_text()
    rows = []
    for files, _ in blocks(readme):
        for f in files:
            prov = json.loads((ROOT / f).read_text()).get("provenance", {})
            newer = stale(f)
            if a.stale and not newer:
                continue
            rows.append(dict(file=f, experiment=f"experiments/{writer(f)}.py",
                             commit=prov.get("commit"), time=prov.get("time"),
                             command=prov.get("command"), newer_commits=len(newer)))
            print(f"{f}: {prov.get('commit')} {prov.get('time')} `{prov.get('command')}`"
                  + (f"  STALE: {len(newer)} newer commits touch its code" if newer else ""))
    return rows


if __name__ == "__main__":
    main()
