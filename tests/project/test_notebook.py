"""The notebooks run top to bottom in a fresh kernel (nbclient), quickly, and show what they say;
the committed files carry their outputs (a notebook on GitHub is read, not run).

To refresh the committed outputs after editing a notebook: ``python tests/project/test_notebook.py``
(executes both and writes them back, without timing metadata).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
QUICKSTART = NOTEBOOKS / "quickstart.ipynb"
BENCHMARKS = NOTEBOOKS / "benchmarks.ipynb"


def execute(path: Path):
    """(the executed notebook, seconds): a fresh kernel whose working folder is notebooks/, as
    Jupyter's would be."""
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb, time.monotonic() - start


def outputs(nb) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def stream_text(nb) -> str:
    return "".join(o.get("text", "") for o in outputs(nb) if o.output_type == "stream")


def shown(nb, mime: str) -> str:
    """What the cells' results and displays show as ``mime``."""
    return "".join(o.get("data", {}).get(mime, "") for o in outputs(nb))


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs(nb))


def check_ran(nb) -> None:
    """Every code cell ran, in order, in one session, and none failed."""
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"not run top to bottom: {counts}"
    errors = [o for o in outputs(nb) if o.output_type == "error"]
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)


def check_quickstart(nb) -> None:
    check_ran(nb)
    text = stream_text(nb)
    assert "'The capital of France is' -> '" in text, "text in, text out"
    assert "the same tokens at P = 1 and P = 2" in text
    measured = {int(p): [int(b) for b in kv.split(",")] for p, kv in re.findall(
        r"^P = (\d+), .*: KV bytes per rank \[([\d, ]+)\]$", text, re.MULTILINE)}
    assert sorted(measured) == [1, 2], f"the two runs' KV lines: {measured}"
    (whole,), halves = measured[1], measured[2]
    assert whole > 0 and halves == [whole // 2] * 2 and whole % 2 == 0, measured
    # computed for 128k tokens: bytes per rank halve from P = 1 to 2 and again to 4
    assert "P = 1:" in text and "P = 4:" in text and "18.00 GiB" in text and "4.50 GiB" in text
    assert images(nb) >= 2, "the measured and the computed KV plots are drawn"


def check_benchmarks(nb) -> None:
    check_ran(nb)
    assert images(nb) == 1, "the tokens/s figure is drawn"
    tables = shown(nb, "text/markdown")
    assert "| shape | batch x ctx |" in tables and "| torch_cp_compiled |" in tables, "the tables"
    assert "generate_run32.json" in shown(nb, "text/plain"), "the runs listed"


@pytest.mark.parametrize("path, check", [(QUICKSTART, check_quickstart),
                                         (BENCHMARKS, check_benchmarks)], ids=["quickstart",
                                                                               "benchmarks"])
def test_committed_notebook_has_its_outputs(path, check):
    check(nbformat.read(path, as_version=4))


@pytest.mark.slow
def test_quickstart_runs(tmp_path):
    nb, elapsed = execute(QUICKSTART)
    check_quickstart(nb)
    if elapsed > 150:  # ~25 s alone on 2 cores (two CLI runs, one of two ranks); generous
        pytest.fail(f"the quickstart took {elapsed:.0f} s; keep it fast")


@pytest.mark.slow
def test_benchmarks_notebook_runs():
    nb, elapsed = execute(BENCHMARKS)
    check_benchmarks(nb)
    if elapsed > 90:  # ~10 s alone on 2 cores
        pytest.fail(f"the benchmarks notebook took {elapsed:.0f} s; keep it fast")


if __name__ == "__main__":
    for path, check in ((QUICKSTART, check_quickstart), (BENCHMARKS, check_benchmarks)):
        nb, elapsed = execute(path)
        check(nb)
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {elapsed:.0f} s and written", file=sys.stderr)
