"""Where every README number comes from, and which results are older than their code.

    python -m experiments.provenance            every README table: its results files, the
                                                commit and date they were measured on
    python -m experiments.provenance --stale    only the tables whose results predate a change
                                                to the code they measure (rerun those)
    python -m experiments.provenance --targets  the README's table of every target and the
                                                verdict word its file holds

The README quotes results inside blocks that name their files (and goals inside
`<!-- targets -->` ... `<!-- /targets -->`):

    <!-- results: results/bench.json -->
    ...numbers quoted from that file...
    <!-- /results -->

`tests/test_readme.py` checks that every number inside a block is traced to its files (read
whole with its unit, at the precision shown: experiments/readme_numbers.py), that every file
exists with its provenance, that `make experiments` (or, for a GPU's results, its make
target) produces it, and that the rest of the README quotes no measurement.
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
# The experiment module that writes each results file (results/<name>.json <- experiments/<name>)
WRITERS = {"headline_memory": "headline", "headline_latency": "headline",
           "headline_bench": "headline"}
# Results made on a GPU machine by a make target, not by `make experiments` (which runs here).
GPU_WRITERS = {"gpu_check": "gpu-check"}


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


def untraced(readme: str) -> list[str]:
    """Numbers inside results blocks that their files do not account for, read whole with
    their units and traced at the precision shown (experiments/readme_numbers.py)."""
    from experiments.readme_numbers import Pool
    from experiments.readme_numbers import untraced as block_untraced

    bad = []
    for files, body in blocks(readme):
        pool = Pool([json.loads((ROOT / f).read_text()) for f in files])
        bad += [f"{n} (in a block from {', '.join(files)})" for n in block_untraced(body, pool)]
    return bad


TARGETS_BLOCK = re.compile(r"<!-- targets table -->\n(?P<table>.*?)<!-- /targets table -->", re.S)


def verdict_rows(path: str) -> list[tuple[str, str]]:
    """(target, verdict word) of every target a results file holds, in its order: a
    `verdict` as written, else `met` as met / not met (sliding_window_kv's `*_met` flags)."""
    data = json.loads((ROOT / path).read_text())
    raw = data.get("targets")
    items = ([(t["target"], t) for t in raw] if isinstance(raw, list)
             else list(raw.items()) if isinstance(raw, dict) else [])
    rows = []
    for name, t in items:
        if isinstance(t, dict) and "verdict" in t:
            rows.append((name, t["verdict"]))
        elif isinstance(t, dict) and isinstance(t.get("met"), bool):
            rows.append((name, "met" if t["met"] else "not met"))
        elif isinstance(t, bool) and (name.endswith("_met") or name.startswith("met_")):
            rows.append((name.removesuffix("_met").removeprefix("met_"),
                         "met" if t else "not met"))
    return rows


def targets_table(readme: str) -> str:
    """The README's table of every target of the files it quotes, with the verdict word
    each file holds (`python -m experiments.provenance --targets` prints it)."""
    files = sorted({f for fs, _ in blocks(readme) for f in fs})
    lines = ["| results file | target | verdict |", "|---|---|---|"]
    for f in files:
        lines += [f"| {f} | {name} | {word} |" for name, word in verdict_rows(f)]
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--targets", action="store_true",
                    help="print the README's table of every target and its verdict")
    a = ap.parse_args(argv)
    readme = (ROOT / "README.md").read_text()
    if a.targets:
        print(targets_table(readme), end="")
        return []
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
