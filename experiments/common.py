"""Shared bits of experiment scripts: provenance and result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import jax

RESULTS = Path(os.environ.get("PAGED_JAX_RESULTS", "results"))


def provenance() -> dict:
    """Which commit and machine produced a result."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=False).stdout.strip())
    except OSError:
        commit, dirty = "unknown", False
    return {
        "commit": commit + ("+dirty" if dirty else ""),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save_json(name: str, payload: dict) -> Path:
    """Writes results/<name>.json with provenance attached; returns the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"provenance": provenance(), **payload}, indent=2))
    return path


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
