"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel (nbclient), quickly."""

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def test_quickstart_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.monotonic()
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    elapsed = time.monotonic() - start
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    # bytes per rank halve from P = 1 to 2 and again to 4 (printed for the Qwen3-8B shape)
    assert "P = 1:" in text and "P = 4:" in text and "18.00 GiB" in text and "4.50 GiB" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is drawn"
    if elapsed > 90:  # ~15 s alone on 2 cores; generous for a loaded machine
        pytest.fail(f"the quickstart took {elapsed:.0f} s; keep it fast")
