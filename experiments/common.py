"""Shared bits of experiment scripts: provenance and result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax

RESULTS = Path(os.environ.get("PAGED_JAX_RESULTS", "results"))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return ""


# The code a measurement runs is the code at its start: commit and whether the measured
# paths (the library, kernels, experiments, deps) differ from it, read when this module loads,
# so an edit made elsewhere while a long run goes on does not mark its result.
CODE_PATHS = ("paged_jax", "kernels", "experiments", "setup.cfg")


def _code_state() -> str:
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS))
    return commit + ("+dirty" if dirty else "")


CODE_STATE = _code_state()
START = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")  # what decides which kernel paths run


def cpu_id() -> dict:
    """The CPU's vendor, family, model and stepping, and which of ISA_FLAGS it has
    (/proc/cpuinfo; {} elsewhere): a model name like "AMD EPYC" names no generation, and
    one results file called this 2-core machine Zen 4 where its family (26) is Zen 5's."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    out = {"vendor": info.get("vendor_id", "")}
    out.update({k: int(info[k]) for k in ("cpu family", "model", "stepping")
                if info.get(k, "").isdigit()})
    flags = set(info.get("flags", "").split())
    out["isa"] = [f for f in ISA_FLAGS if f in flags]
    return out


def versions(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Versions of the libraries a measurement ran on (those installed here), plus `extra`
    (a peer measured in its own venv reports its own)."""
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "numpy", "torch", "transformers", "vllm", "llama_cpp_python"):
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            pass
    return {**out, **(extra or {})}


def provenance(extra_versions: dict[str, str] | None = None) -> dict:
    """Which commit (as the run started: CODE_STATE), machine, libraries and command produced
    a result, and when it started and ended."""
    return {
        "commit": CODE_STATE,
        "started": START,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.platform(),
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "versions": versions(extra_versions),
        "command": " ".join(["python", "-m", _module()] + sys.argv[1:]),
    }


def _module() -> str:
    """The experiment module being run (`python -m experiments.X`), from argv[0]."""
    path = Path(sys.argv[0])
    if path.parent.name == "experiments":
        return f"experiments.{path.stem}"
    return path.stem


def save_json(name: str, payload: dict, extra_versions: dict[str, str] | None = None) -> Path:
    """Writes results/<name>.json with provenance attached (and the experiment module that
    wrote it, for experiments/provenance.py); returns the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    caller = sys._getframe(1).f_globals  # its __spec__ names it under `python -m` too
    module = caller["__spec__"].name if caller.get("__spec__") else caller["__name__"]
    prov = {**provenance(extra_versions), "experiment": module}
    path.write_text(json.dumps({"provenance": prov, **payload},
                               indent=1, default=_plain) + "\n")
    return path


def _plain(x):
    """JSON for numpy scalars and arrays in payloads."""
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x)}")


def save_plot(name: str, fig) -> Path:
    """Writes results/<name>.png (closing the figure); returns the path."""
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    """A plain text table of `rows` (floats shown with 3 significant digits)."""
    def fmt(v) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [cols] + [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in cells)


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (scripts, tests, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rotated(names: list, r: int) -> list:
    """`names` in round r's order: each round starts one later, so no side always runs
    first (or right after another) while sides alternate in one run."""
    k = r % len(names)
    return names[k:] + names[:k]


def alternated(sides: dict, rounds: int, work: float) -> dict[str, list[float]]:
    """Each side (a name -> a call) run once per round, `rounds` rounds in `rotated` order:
    per side, `work` units (tokens, say) per second of each run."""
    import time

    runs: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in rotated(list(sides), r):
            t0 = time.perf_counter()
            sides[name]()
            runs[name].append(work / (time.perf_counter() - t0))
    return runs


# ---- verdicts that can fail: the project's one rule ---------------------------------------
# Sides alternate in paired rounds (MIN_ROUNDS or more where a run takes under 10 minutes); a
# bar is "met" only when the worst round clears it, "not met" when the best round misses it,
# "not separable" otherwise; "not slower" is a bound with a number (NOT_SLOWER).
MIN_ROUNDS = 5
NOT_SLOWER = 0.95
RULE = ("met: the worst paired round clears the bar; not met: the best round misses it; "
        "not separable: otherwise (experiments/common.py)")


def spread(runs: list[float]) -> float:
    """Half the range of repeated runs: how far one run strays from the middle."""
    return (max(runs) - min(runs)) / 2 if runs else 0.0


def target_verdict(runs: list[float], target: float, higher_is_better: bool = True) -> dict:
    """The one rule on the per-round values of a target (module comment above). One run has
    no spread: its verdict says so; fewer than MIN_ROUNDS are counted in `rounds`."""
    import statistics

    worst, best = (min(runs), max(runs)) if higher_is_better else (max(runs), min(runs))
    clears = (lambda v: v >= target) if higher_is_better else (lambda v: v <= target)
    verdict = "met" if clears(worst) else "not met" if not clears(best) else "not separable"
    if len(runs) < 2:
        verdict += " (one run: no spread measured)"
    med = statistics.median(runs)
    return dict(median=med, target=target, higher_is_better=higher_is_better,
                margin=(med - target) if higher_is_better else (target - med),
                worst=worst, best=best, spread=spread(runs), runs=list(runs),
                rounds=len(runs), verdict=verdict)


def round_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Per-round ratios of two sides' paired runs (higher is better); unpaired runs (another
    count) give the two extreme ratios, the worst and the best any pairing could show."""
    if len(ours) == len(theirs):
        return [a / b for a, b in zip(ours, theirs, strict=True)]
    return [min(ours) / max(theirs), max(ours) / min(theirs)]


def not_slower(ours: list[float], theirs: list[float], bound: float = NOT_SLOWER) -> dict:
    """"Not slower than" as a bound with a number: the per-round ratios against `bound`."""
    return target_verdict(round_ratios(ours, theirs), bound)


def compare(ours: list[float], theirs: list[float]) -> dict:
    """Two sides' paired runs (higher is better): the ratio of the medians, and the one rule
    against 1 on the per-round ratios: "higher" when every round is, "lower" when every round
    is lower, "not separable" otherwise."""
    import statistics

    a, b = statistics.median(ours), statistics.median(theirs)
    ratios = round_ratios(ours, theirs)
    verdict = ("higher" if min(ratios) > 1 else "lower" if max(ratios) < 1
               else "not separable")
    return dict(ours=a, theirs=b, ratio=a / b if b else float("inf"),
                spread=spread(ours) + spread(theirs), round_ratios=ratios, verdict=verdict)
