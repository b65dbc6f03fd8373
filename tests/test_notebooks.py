"""Every notebooks/*.ipynb runs top to bottom (so none can rot) and is committed without outputs.

The notebooks run in a fresh "python3" kernel started from this interpreter (jupyter_client
replaces the kernelspec's bare `python` with sys.executable; the test checks the kernel's
sys.prefix), with notebooks/ as the working directory and a headless matplotlib backend (Agg).
New notebooks are picked up by the glob.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
STACKS_EVERY_S = 60
"""The kernel writes every thread's Python stack to a file this often (faulthandler); a cell
that times out fails with the last of them and what else the machine was running, so a hang
seen once in CI says where it was."""
# The tests run each notebook on a smaller workload than a reader's default: the same cells,
# fewer requests, lengths and repeats (a cell after the first, parameters, cell sets these).
TEST_PARAMETERS = {
    "02_kernels.ipynb": "NUM_LENGTHS = 1000\nTIMING_CONTEXT = 1024\nTIMING_REPEATS = 3",
    "03_serving.ipynb": "NUM_REQUESTS = 4\nPOLICY_REQUESTS = 8",
    "04_kv_quantization.ipynb": "TOKENS = 64\nMAX_TOKENS = 8\nPROMPTS = PROMPTS[:2]\nKV_MIB = 32",
    "05_routing.ipynb": "BALANCE_REQUESTS = 16",
}


def _stacks_cell(log: Path) -> str:
    """The first cell run: the kernel dumps its threads' stacks to `log` every STACKS_EVERY_S."""
    return (f"import faulthandler as _fh\n_fh.dump_traceback_later({STACKS_EVERY_S}, repeat=True, "
            f"file=open({str(log)!r}, 'w'))")


def _hang_report(log: Path) -> str:
    """The kernel's last stack dump, the load average and the busiest processes."""
    dumps = log.read_text().split("Timeout (") if log.exists() else []
    top = subprocess.run(["ps", "-eo", "pid,pcpu,rss,etime,args", "--sort=-pcpu"],
                         capture_output=True, text=True, check=False).stdout.splitlines()[:12]
    return (f"load average {os.getloadavg()}; busiest processes:\n" + "\n".join(top) +
            "\nthe kernel's threads at its last dump:\n" +
            ("Timeout (" + dumps[-1] if len(dumps) > 1 else "(no dump)"))


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_stripped(path: Path) -> None:
    """Committed notebooks carry no outputs or execution counts (diffs stay readable)."""
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: code cells {dirty} have outputs; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Executes every cell; a failing cell raises CellExecutionError naming it."""
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits this environment
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    if path.name in TEST_PARAMETERS:
        nb.cells.insert(first + 1, nbformat.v4.new_code_cell(TEST_PARAMETERS[path.name]))
    # sys.prefix, not sys.executable: a venv's python is a symlink to the system one.
    probe = nbformat.v4.new_code_cell("import sys; print(sys.prefix)")
    nb.cells.append(probe)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_stacks_cell(tmp_path / "stacks.txt")))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellTimeoutError as e:
        raise AssertionError(f"{path.name}: {e}\n{_hang_report(tmp_path / 'stacks.txt')}") from e
    kernel_prefix = "".join(o.get("text", "") for o in probe.outputs).strip()
    assert Path(kernel_prefix).resolve() == Path(sys.prefix).resolve(), (
        f"{path.name} ran in the environment {kernel_prefix}, not in the test's {sys.prefix}"
    )
