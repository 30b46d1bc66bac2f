"""notebooks/use_a_model.ipynb runs headless on a small checkpoint and the bundled genome."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "use_a_model.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count")
               for c in nb.cells if c.cell_type == "code")


def test_notebook_scores_embeds_generates_and_scores_variants(checkpoint, bundled_store, tmp_path,
                                                              monkeypatch):
    for key, value in {"CHECKPOINT": str(checkpoint), "STORE": str(bundled_store.path),
                       "REGION": "chr22:1-6,000", "GENERATE": "120", "VARIANTS": "12"}.items():
        monkeypatch.setenv(f"MEGABASE_{key}", value)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("text", "")) for o in outputs)
    assert "mean surprisal" in text and "embeddings: (40, 32)" in text
    assert "4-mer total variation" in text and "12 SNVs" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
