"""``megabase export-model``: the folder loads with transformers where megabase is not importable,
and gives megabase's log-probs, hidden states and sampled bases on real DNA; bad input is refused
in one line and leaves nothing behind.

transformers runs in a subprocess from a temporary folder: the repository's own ``kernels/``
folder would shadow the ``kernels`` package transformers imports when the repository root is the
working directory, and megabase is blocked there as on a machine without it.
"""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from megabase.data import SEP, tokenize
from megabase.pipeline.cli import main

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

LOAD = r'''
import json, sys
sys.modules["megabase"] = None  # not importable, as where megabase is not installed
import numpy as np, torch
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer)
out, work = sys.argv[1], sys.argv[2]
tile = np.load(f"{work}/tile.npy")
tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
lm = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
text = "".join("ACGTN"[t] for t in tile)
ids = tok(text, return_tensors="pt").input_ids
with torch.no_grad():
    res = lm(ids, output_hidden_states=True)
    base = AutoModel.from_pretrained(out, trust_remote_code=True).eval()(ids[:, :300])
lp = res.logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
fast = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, canonical_tiles=False).eval()
with torch.no_grad():
    lp_fast = fast(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
torch.manual_seed(7)
gen = lm.generate(ids[:, :501], max_new_tokens=100, do_sample=True, top_k=0)
cls = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True, num_labels=3)
batch = tok(["ACGTACGTAC", "acgtnRYK"], padding=True, return_tensors="pt")
logits = cls(**batch).logits
np.savez(f"{work}/hf.npz", lp=lp.numpy(), lp_fast=lp_fast.numpy(), gen=gen[0, 501:].numpy(),
         hidden=res.hidden_states[2][0, 1:].numpy(), base=base.last_hidden_state.numpy(),
         cls=logits.detach().numpy(), mixed=np.array(tok("Ac gT\nnR-y.\r\nu")["input_ids"]),
         batch=batch["input_ids"].numpy(), mask=batch["attention_mask"].numpy())
print(json.dumps({"modules": sorted(m for m, v in sys.modules.items()
                                     if v is not None and m.split(".")[0] == "megabase")}))
'''


def run_python(code: str, *args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def exported(checkpoint, bundled_store, tmp_path_factory):
    """The debug checkpoint exported, and what transformers made of it on held-out DNA."""
    work = tmp_path_factory.mktemp("hf")
    tile = np.asarray(bundled_store.tokens("chr22")[40_000:43_000])
    np.save(work / "tile.npy", tile)
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(work / "out")]) == 0
    done = run_python(LOAD, work / "out", work, cwd=work)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"out": work / "out", "tile": tile, "hf": dict(np.load(work / "hf.npz")),
            "modules": json.loads(done.stdout.strip().splitlines()[-1])["modules"]}


def test_log_probs_equal_megabases_on_held_out_dna(exported, checkpoint):
    import torch

    from megabase.model import load_checkpoint, log_probs

    model = load_checkpoint(checkpoint)
    seq = torch.from_numpy(np.concatenate([[SEP], exported["tile"]]).astype(np.int64))[None]
    ours = log_probs(model, seq)[0].numpy()
    assert np.abs(exported["hf"]["lp"] - ours).max() <= 1e-5
    assert ours.std() > 0.1  # the log-probs depend on the bases: a real comparison
    assert exported["modules"] == []  # megabase itself was never imported
    # canonical_tiles=False (products on the rows as given, for batches of short sequences):
    # megabase's numbers to fp32 round-off, not to the bit
    fast = exported["hf"]["lp_fast"]
    assert np.abs(fast - ours).max() <= 1e-4


def test_without_a_compiler_the_pytorch_forms_give_the_same_log_probs(exported, tmp_path):
    """MEGABASE_NATIVE=0 stands for a machine without a C compiler: the carried code runs its
    PyTorch forms (fp32 round-off apart: 8.8e-6 at most on this tile)."""
    import os

    code = LOAD.replace('f"{work}/hf.npz"', 'f"{work}/hf-torch.npz"')
    work = exported["out"].parent
    done = subprocess.run([sys.executable, "-c", code, str(exported["out"]), str(work)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MEGABASE_NATIVE": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    torch_forms = np.load(work / "hf-torch.npz")["lp"]
    assert np.abs(torch_forms - exported["hf"]["lp"]).max() <= 1e-4


def test_generate_draws_megabases_bases_and_hidden_states_equal_embed(exported, checkpoint):
    from megabase.infer.embedding import embed_tokens
    from megabase.infer.sampling import generate_tokens
    from megabase.model import load_checkpoint

    model = load_checkpoint(checkpoint)
    sample = generate_tokens(model, exported["tile"][:500], 100, seed=7)
    assert np.array_equal(exported["hf"]["gen"], sample.tokens)
    hidden = embed_tokens(model, exported["tile"], layer=2, per_base=True)
    assert np.abs(exported["hf"]["hidden"] - hidden).max() <= 1e-5
    assert exported["hf"]["base"].shape == (1, 300, model.cfg.d_model)


def test_tokenizer_maps_text_as_prepare_does_and_pads_right(exported):
    hf = exported["hf"]
    assert hf["mixed"].tolist() == [SEP, *tokenize("AcgTnR-y.u").tolist()]
    assert hf["batch"][1].tolist() == [SEP, *tokenize("acgtnRYK").tolist(), 5, 5]
    assert hf["mask"][1].tolist() == [1] * 9 + [0, 0] and hf["cls"].shape == (2, 3)


def test_the_folder_has_a_model_card_and_its_provenance(exported, checkpoint):
    out = exported["out"]
    card = (out / "README.md").read_text()
    assert "parameters: 103,488 total, 68,160 active" in card and "Intended use and limits" in card
    assert "No evaluation report was found" in card  # the fixture checkpoint was never evaluated
    marker = json.loads((out / "megabase_export.json").read_text())
    assert marker["checkpoint"] == str(checkpoint.resolve())
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_megabase.MegabaseForCausalLM"


def test_a_report_reaches_the_card(checkpoint, tmp_path, capsys):
    report = {"checkpoint": str(checkpoint), "n_windows": 4,
              "overall": {"n_tokens": 1000, "bits_per_base": 1.9, "bits_per_base_ci": [1.85, 1.95],
                          "unique": {"bits_per_base": 1.95}, "repeat": {"bits_per_base": 1.7}},
              "baselines": {"markov order 4": {"overall": {"bits_per_base": 1.93}}},
              "best_baseline": {"name": "markov order 4", "bits_per_base": 1.93}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"),
                 "--report", str(path)]) == 0
    card = (tmp_path / "o" / "README.md").read_text()
    assert "1.9000 (1.8500-1.9500)" in card and "(markov order 4): -0.0300 bits/base" in card
    assert "exported" in capsys.readouterr().out


def test_a_report_of_megabase_evaluate_reaches_the_card(checkpoint, bundled_store, tmp_path):
    # the evaluator's own report, probe included (its hit rates are one per DSA layer)
    assert main(["evaluate", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-6,000", "--length", "2048", "--controls", "500",
                 "--probe-windows", "2", "--probe-distances", "1000", "--baselines", "0",
                 "--train", "chr01:1-200,000", "--no-copy", "--bootstrap", "20", "--quiet",
                 "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                 "--out", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    rates = report["probe"][0]["dsa_hit_rate"]
    assert isinstance(rates, list) and len(rates) >= 1
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"),
                 "--report", str(tmp_path / "eval" / "report.json")]) == 0
    card = (tmp_path / "o" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| 1,000 |"))
    assert " / ".join(f"{r:.0%}" for r in rates) in row
    assert "markov order 0" in card and "What context beyond ~500 bases gives" in card


def test_export_again_replaces_an_earlier_export(exported, checkpoint):
    (exported["out"] / "stale.txt").write_text("from before")
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(exported["out"])]) == 0
    assert not (exported["out"] / "stale.txt").exists()


@pytest.mark.parametrize("case, message", [
    ("missing", "not a checkpoint"),
    ("damaged", "model.safetensors is damaged"),
    ("foreign_out", "holds files megabase export-model did not write"),
    ("file_out", "exists and is not a folder"),
    ("bad_report", "is not a megabase report"),
])
def test_bad_input_is_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys, case, message):
    import shutil

    ckpt, out, extra = tmp_path / "nothing", tmp_path / "out", []
    if case == "damaged":
        ckpt = tmp_path / "ckpt"
        shutil.copytree(checkpoint, ckpt)
        with open(ckpt / "model.safetensors", "r+b") as fh:
            fh.seek(-8, 2)
            fh.write(b"\0" * 8)
    elif case in ("foreign_out", "file_out", "bad_report"):
        ckpt = checkpoint
    if case == "foreign_out":
        out.mkdir()
        (out / "mine.txt").write_text("keep me")
    if case == "file_out":
        out.write_text("keep me")
    if case == "bad_report":
        (tmp_path / "r.json").write_text("{not json")
        extra = ["--report", str(tmp_path / "r.json")]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export-model", "--checkpoint", str(ckpt), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no half-written folder
    if case == "foreign_out":
        assert (out / "mine.txt").read_text() == "keep me"
