"""notebooks/finetune_hf.ipynb runs headless: export, a repeat-vs-unique task from real human
chr22, the k-mer baseline, a linear probe and a LoRA fine-tune with the transformers Trainer."""

import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "finetune_hf.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count")
               for c in nb.cells if c.cell_type == "code")


def test_notebook_fine_tunes_beside_the_baselines(checkpoint, hsap_store, tmp_path, monkeypatch):
    for package in ("transformers", "peft", "sklearn"):  # not imported here: see test_hf_export
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    for key, value in {"CHECKPOINT": str(checkpoint), "HF_MODEL": str(tmp_path / "hf"),
                       "STORE": str(hsap_store.path), "WINDOW": "100", "N_TRAIN": "64",
                       "N_TEST": "64", "STEPS": "4", "LORA": "1"}.items():
        monkeypatch.setenv(f"MEGABASE_{key}", value)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for o in outputs)
    assert "train: 64 windows of 100 bases" in text and "trainable params" in text
    for name in ("k-mer counts + logistic regression", "frozen model, linear probe",
                 "fine-tuned (LoRA)"):
        assert f"{name}: accuracy" in text, name
    assert (tmp_path / "hf" / "config.json").is_file()
