"""Every stored verdict judged again by the project's one rule, from the rounds the results
files already hold (no experiment reruns):

    python -m experiments.rejudge            rewrites the verdicts and targets in place, each
                                             file's `rejudged` saying by which commit and rule,
                                             and results/verdict_changes.json: every verdict
                                             whose word changed, before and after

The rule (experiments/common.py): on paired rounds a bar is met only when the worst round
clears it, not met when the best round misses it, not separable otherwise; a comparison of
two sides is "higher" / "lower" only when every round is; "not slower" is >= 0.95x. Targets
are recomputed by each experiment's own `targets` from its stored cells, so the next run of
the experiment writes what this writes.
"""

from __future__ import annotations

import json

from experiments import common

COMPARE_KEYS = {"ours", "theirs", "ratio", "spread", "verdict"}
TARGET_KEYS = {"runs", "target", "margin", "median", "verdict"}


def _runs_of(data: dict, path: tuple) -> tuple[list, list] | None:
    """(ours, theirs) runs behind the comparison at `path`, by where each experiment keeps
    them (None where the file does not hold them)."""
    *up, _ = path
    node = _at(data, up)
    if path[0] == "cells":  # speculative*: a side against its cell's plain side
        return node["runs"], _at(data, path[:2])["plain"]["runs"]
    if path[0] == "models":  # weight_quantization: a side's batch against float32's
        side = next(s for s in _at(data, path[:3]) if s["side"] == "float32")
        return node["runs"], side[path[4]]["runs"]
    if path[0] == "rows" and path[-1] == "vs_window":  # async_scheduling
        base = next(r for r in data["rows"] if r["batch"] == node["batch"]
                    and r["side"] == "window 8")
        return node["runs"], base["runs"]
    if path[:2] == ("decode", "ragged_dot_vs_dense"):  # moe
        tok = data["decode"]["tok_s"]
        return tok["ragged_dot"]["runs"], tok["dense"]["runs"]
    if path[0] == "speed" and path[-1] == "unpaired_vs_bar":  # structured outputs
        from experiments.structured_outputs import BAR

        runs = node["runs"]
        return runs["ours constrained"], [BAR * x for x in runs["ours unconstrained"]]
    if path[-1] == "cached_vs_unconstrained":
        return node["runs"]["unconstrained"], node["runs"]["cached schema"]
    return None


def _at(data, path):
    for k in path:
        data = data[k]
    return data


def _walk(obj, path=()):
    if isinstance(obj, dict):
        yield path, obj
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))


def rejudge_file(data: dict, name: str) -> list[dict]:
    """Rewrites `data`'s verdicts in place; returns the words that changed."""
    before = {p: d.get("verdict") for p, d in _walk(data) if "verdict" in d}
    for path, d in list(_walk(data)):
        if TARGET_KEYS <= d.keys() and "targets" not in path:
            higher = abs(d["margin"] - (d["median"] - d["target"])) < 1e-9
            d.update(common.target_verdict(d["runs"], d["target"], higher))
        elif COMPARE_KEYS <= d.keys() and (runs := _runs_of(data, path)) is not None:
            d.update(common.compare(*runs))
    if name == "bench":
        _bench(data)
    _TARGETS.get(name, lambda d: None)(data)
    nodes = {p: d for p, d in _walk(data) if "verdict" in d}
    after = {p: d.get("verdict") for p, d in nodes.items()}
    return [dict(file=f"results/{name}.json", path="/".join(map(str, p)),
                 target=nodes.get(p, {}).get("target") if isinstance(
                     nodes.get(p, {}).get("target"), str) else None,
                 before=before.get(p), after=after.get(p))
            for p in sorted(set(before) | set(after), key=str) if before.get(p) != after.get(p)]


def _bench(data: dict) -> None:
    """bench.json: each side against paged-jax's (the same row's "paged-jax float32", or its
    +prefix cache side where the row ran one)."""
    for row in data["rows"]:
        if "verdict" not in row:
            continue
        ours = [r for r in data["rows"] if r["row"] == row["row"]
                and r["side"].startswith("paged-jax float32") and "verdict" not in r]
        ours = [r for r in ours if ("prefix" in r["side"]) == ("prefix" in row["side"])]
        if len(ours) == 1:
            row["verdict"] = common.compare(ours[0]["runs"], row["runs"])["verdict"]


def _speculative(data: dict) -> None:
    from experiments import speculative

    data["targets"] = speculative.targets(data["cells"], data.get("disable_by_batch_size"))


def _speculative_draft(data: dict) -> None:
    from experiments import speculative_draft

    data["targets"] = speculative_draft.targets(data["cells"], data["disable_by_batch_size"])


def _structured(data: dict) -> None:
    from experiments import structured_outputs

    ttft = data.get("ttft")
    if ttft and "cached_schema" not in ttft:  # an older run kept only the rounds
        ttft["cached_schema"] = common.target_verdict(ttft["added_runs"]["cached schema"],
                                                      0.0, False)
    data["targets"] = structured_outputs.targets(data)


def _moe(data: dict) -> None:
    g = data["decode"]["grouped_over_dense"]
    for t in data["targets"].values():
        t.update(speedup=g["median"], verdict=g["verdict"] if data["decode"]["same_tokens"]
                 else "tokens differ")


def _weight_quantization(data: dict) -> None:
    from experiments import weight_quantization

    data["targets"] = weight_quantization.targets(data["models"])


def _long_prompt(data: dict) -> None:
    """Its p99 < 3x p50 target could not fail (the cap raises the p50 with the p99): the
    short requests' ITL during the long prefill against before it instead (one round)."""
    for row in data["rows"]:
        row.pop("target", None)
        row["itl_during_over_before"] = row["itl_during"] / row["itl_before"]


def _routing(data: dict) -> None:
    from experiments import routing

    data["targets"] = routing.targets(data)


def _gpu_check(data: dict) -> None:
    from experiments import gpu_check

    data["targets"] = gpu_check.targets(data)


_TARGETS = {"speculative": _speculative, "speculative_draft": _speculative_draft,
            "structured_outputs": _structured, "structured_outputs_ttft": _structured,
            "moe": _moe, "weight_quantization": _weight_quantization,
            "long_prompt": _long_prompt, "gpu_check": _gpu_check, "routing": _routing}
FILES = ("async_scheduling", "bench", "gpu_check", "long_prompt", "moe", "routing",
         "speculative", "speculative_draft", "structured_outputs", "structured_outputs_ttft",
         "weight_quantization")


def main(argv: list[str] | None = None) -> list[dict]:
    changes = []
    for name in FILES:
        path = common.RESULTS / f"{name}.json"
        data = json.loads(path.read_text())
        changed = rejudge_file(data, name)
        if changed or "rejudged" not in data:  # a second pass changes nothing: keep the first
            data["rejudged"] = dict(rule=common.RULE, commit=common.CODE_STATE,
                                    time=common.START, changes=len(changed))
        path.write_text(json.dumps(data, indent=1, default=common._plain) + "\n")
        changes += changed
    for c in changes:
        print(f"{c['file']} {c['path']}: {c['before']} -> {c['after']}")
    if changes:  # the list of the pass that changed them stays until another does
        common.save_json("verdict_changes", dict(rule=common.RULE, changes=changes))
    return changes


if __name__ == "__main__":
    main()
