"""notebooks/compare_runs.ipynb runs headless against a store made by a tiny evaluation."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "compare_runs.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count")
               for c in nb.cells if c.cell_type == "code")


def test_notebook_compares_the_runs_of_a_store(tracked, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGABASE_TRACKING_URI", tracked["uri"])
    monkeypatch.setenv("MEGABASE_EXPERIMENT", "tiny")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for o in outputs)
    model = tracked["reports"]["model"]["mlflow"]["run_id"]
    assert model in text and "markov order 2" in text and "gains vs" in text
    assert ": copy model" in text and "copy model gain" in text  # the reference's curve and worth
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the figure
