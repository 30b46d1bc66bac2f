"""``megabase export-model``: the folder loads with transformers where megabase is not importable,
and gives megabase's log-probs, hidden states and sampled bases on real DNA; bad input is refused
in one line and leaves nothing behind.

transformers runs in a subprocess, from a temporary folder where megabase is blocked as on a
machine without it, and once from the repository root (whose ``kernels/`` folder must not shadow
the ``kernels`` package transformers imports).
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
refused = {}
for text in ("AC<sep>GT", "A<pad>", "ACGT</s>"):  # special-token strings in text are not DNA
    try:
        refused[text] = tok(text)["input_ids"]
    except ValueError as exc:
        refused[text] = str(exc)
print(json.dumps({"modules": sorted(m for m, v in sys.modules.items()
                                     if v is not None and m.split(".")[0] == "megabase"),
                  "decoded": tok.decode(tok("ACGNNTnr")["input_ids"], skip_special_tokens=True),
                  "decoded_padded": tok.batch_decode(batch["input_ids"], skip_special_tokens=True),
                  "special": tok.all_special_tokens, "refused": refused}))
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
            **json.loads(done.stdout.strip().splitlines()[-1])}


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


SELECTIONS = """
import sys, numpy as np, torch
from megabase.model import load_checkpoint
from megabase.model.dsa import capture_selections
model = load_checkpoint(sys.argv[1]).eval()
ids = torch.from_numpy(np.load(sys.argv[2]))[None]
caps = capture_selections(model, 0, ids.shape[1])
with torch.no_grad():
    model(ids, ctx=model.context(capture=caps))
np.save(sys.argv[3], np.stack([c.rows for c in caps]))
"""


def flipped_queries(checkpoint, tile: np.ndarray, work) -> set[int]:
    """Queries of ``tile`` where some DSA layer's top-k differs between megabase's C kernels and
    its PyTorch forms (``MEGABASE_NATIVE=0``): there fp32 round-off of the layers below moved a
    score across the k-th (modeling_megabase's docstring), and that base's log-prob moves by more
    than round-off."""
    import os

    ids = work / "ids.npy"
    np.save(ids, np.concatenate([[SEP], tile[:-1]]).astype(np.int64))
    rows = []
    for native in ("1", "0"):
        out = work / f"selections-{native}.npy"
        done = subprocess.run([sys.executable, "-c", SELECTIONS, str(checkpoint), str(ids),
                               str(out)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "MEGABASE_NATIVE": native})
        assert done.returncode == 0, done.stderr[-4000:]
        rows.append(np.load(out))
    return set(np.nonzero((rows[0] != rows[1]).any(-1).any(0))[0].tolist())


def assert_round_off_apart(lp: np.ndarray, reference: np.ndarray, checkpoint, tile, work) -> None:
    """``lp`` equals ``reference`` to 1e-4 at every base, but those predicted by a query whose
    DSA selection flips between the C kernels and the PyTorch forms (few, and each shown to be
    one)."""
    apart = set(np.nonzero(np.abs(lp - reference) > 1e-4)[0].tolist())
    assert len(apart) <= len(lp) // 1000, sorted(apart)
    assert apart <= flipped_queries(checkpoint, tile, work), sorted(apart)


def test_without_a_compiler_the_pytorch_forms_give_the_same_log_probs(exported, checkpoint,
                                                                       tmp_path):
    """MEGABASE_NATIVE=0 stands for a machine without a C compiler: the carried code runs its
    PyTorch forms (fp32 round-off apart, 8.8e-6 at most on this tile, but at a base whose DSA
    top-k that round-off flips: two of 3,000 here, 0.05 and 0.09 nats)."""
    import os

    code = LOAD.replace('f"{work}/hf.npz"', 'f"{work}/hf-torch.npz"')
    work = exported["out"].parent
    done = subprocess.run([sys.executable, "-c", code, str(exported["out"]), str(work)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MEGABASE_NATIVE": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    torch_forms = np.load(work / "hf-torch.npz")["lp"]
    assert_round_off_apart(torch_forms, exported["hf"]["lp"], checkpoint, exported["tile"],
                           tmp_path)


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


def test_n_is_a_base_and_special_token_strings_in_text_are_not_tokens(exported):
    # N is not the unknown token: skip_special_tokens keeps it, and drops <sep> and <pad> only
    assert exported["decoded"] == "ACGNNTNN" and sorted(exported["special"]) == ["<pad>", "<sep>"]
    assert exported["decoded_padded"] == ["ACGTACGTAC", "ACGTNNNN"]
    # "<sep>" written in a sequence is not the separator: refused where it starts, as any non-DNA
    for text, got in exported["refused"].items():
        assert isinstance(got, str), got
        assert f"invalid nucleotide '<' at position {text.index('<')}" in got


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


def test_export_again_replaces_only_what_megabase_wrote(checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    ours = json.loads((out / "megabase_export.json").read_text())["files"]
    # what a user adds beside an export: an adapter, a fine-tune's checkpoint folder
    (out / "adapter_model.safetensors").write_bytes(b"adapter")
    (out / "checkpoint-500").mkdir()
    (out / "checkpoint-500" / "trainer_state.json").write_text("{}")
    (out / "config.json").write_text((out / "config.json").read_text())  # unchanged: megabase's
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    assert (out / "adapter_model.safetensors").read_bytes() == b"adapter"
    assert (out / "checkpoint-500" / "trainer_state.json").read_text() == "{}"
    assert json.loads((out / "megabase_export.json").read_text())["files"] == ours
    capsys.readouterr()
    # one of megabase's files that the user changed is not replaced: refused, nothing moved
    (out / "README.md").write_text("my own notes")
    before = sorted(p.name for p in out.iterdir())
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out / 'README.md'}: is not the file megabase " \
        "export-model wrote there" in err, err
    assert (out / "README.md").read_text() == "my own notes"
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left


def test_a_report_of_another_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    import shutil

    import torch

    from megabase.model import build_model, save_checkpoint
    from megabase.model.checkpoint import weights_sha256

    torch.manual_seed(1)
    other = save_checkpoint(build_model("debug"), tmp_path / "other")
    report = {"overall": {"n_tokens": 1000, "bits_per_base": 1.07}, "n_windows": 4}
    cases = {
        "names another": {**report, "checkpoint": str(other)},
        "names this path, other weights": {**report, "checkpoint": str(checkpoint),
                                           "checkpoint_sha256": weights_sha256(other)},
        "names a folder that is gone": {**report, "checkpoint": str(tmp_path / "gone")},
    }
    for why, data in cases.items():
        (tmp_path / "report.json").write_text(json.dumps(data))
        code = main(["export-model", "--checkpoint", str(checkpoint), "--out",
                     str(tmp_path / "o"), "--report", str(tmp_path / "report.json")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, (why, err)
        assert f"report.json: is not a report of {checkpoint}" in err, (why, err)
        assert not (tmp_path / "o").exists()
    # a report of this checkpoint, whose folder was moved since: its weights' checksum matches
    moved = tmp_path / "moved"
    shutil.copytree(checkpoint, moved)
    (tmp_path / "report.json").write_text(json.dumps(
        {**report, "checkpoint": str(tmp_path / "gone"),
         "checkpoint_sha256": weights_sha256(checkpoint)}))
    assert main(["export-model", "--checkpoint", str(moved), "--out", str(tmp_path / "o"),
                 "--report", str(tmp_path / "report.json")]) == 0
    assert "| this model | 1.0700 |" in (tmp_path / "o" / "README.md").read_text()


def test_an_unwritable_cache_uses_a_copy_removed_at_exit(exported, checkpoint, tmp_path):
    """Where $MEGABASE_CACHE cannot be written, the carried code goes to a temporary folder for
    the process; it used to stay in the temp folder after every such process."""
    import os

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code = LOAD.replace('f"{work}/hf.npz"', 'f"{work}/hf-scratch.npz"')
    env = {**os.environ, "MEGABASE_CACHE": str(blocker / "cache"), "TMPDIR": str(scratch)}
    done = subprocess.run([sys.executable, "-c", code, str(exported["out"]),
                           str(exported["out"].parent)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    lp = np.load(exported["out"].parent / "hf-scratch.npz")["lp"]
    # no cache to build C kernels into: the PyTorch forms
    assert_round_off_apart(lp, exported["hf"]["lp"], checkpoint, exported["tile"], tmp_path)
    assert not list(scratch.glob("megabase-hf-*"))


def test_an_export_loads_in_transformers_from_the_repository_root(exported):
    """A shell or notebook at the repository root has the root on sys.path, where the folder
    kernels/ (megabase.kernels) used to shadow the kernels package transformers imports."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = r'''
import sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import kernels
out, work = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
lm = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
tile = np.load(f"{work}/tile.npy")
ids = tok("".join("ACGTN"[t] for t in tile), return_tensors="pt").input_ids
with torch.no_grad():
    lp = lm(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
np.save(f"{work}/root.npy", lp.numpy())
print(kernels.__file__)
'''
    work = exported["out"].parent
    done = run_python(code, exported["out"], work, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] != str(root / "kernels" / "__init__.py")
    assert np.array_equal(np.load(work / "root.npy"), exported["hf"]["lp"])


def test_a_full_disk_while_exporting_is_one_line_naming_the_file(checkpoint, tmp_path):
    """A file-size limit (EFBIG, as a full disk gives ENOSPC) while safetensors writes the
    weights: one line naming the export's model.safetensors, exit 2, nothing left."""
    import resource

    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # noqa: E731
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "megabase.pipeline.cli", "export-model",
                           "--checkpoint", str(checkpoint), "--out", str(out)],
                          capture_output=True, text=True, preexec_fn=limit)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert err == f"megabase export-model: error: {out / 'model.safetensors'}: File too large"
    assert list(tmp_path.iterdir()) == []


def test_a_name_too_long_for_a_temporary_names_the_export_not_the_temporary(checkpoint, tmp_path,
                                                                            capsys):
    out = tmp_path / ("x" * 245)  # a valid name; its temporary sibling's name is too long
    assert main(["export-model", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    # os_error_line shortens a long name to its ends and its length: the export's own
    assert len(err.splitlines()) == 1, err
    assert err.endswith(f"x ({len(str(out))} characters): File name too long"), err
    assert ".tmp-" not in err and list(tmp_path.iterdir()) == []


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


def test_the_report_evaluate_writes_for_a_run_checkpoint_is_found(checkpoint, bundled_store,
                                                                  tmp_path):
    import shutil

    from megabase.infer.hf.export import find_report

    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step-000002"
    shutil.copytree(checkpoint, ckpt)
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-4,000", "--length", "2048", "--controls", "",
                 "--baselines", "", "--no-copy", "--no-probe", "--bootstrap", "20", "--quiet",
                 "--no-mlflow"]) == 0
    assert find_report(ckpt) == tmp_path / "runs" / "r" / "eval" / "step-000002" / "report.json"


GATED = r'''
import sys
sys.modules["megabase"] = None
import numpy as np, torch
from transformers import AutoModelForCausalLM
lm = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.from_numpy(np.load(sys.argv[2]))[None]
with torch.no_grad():
    np.save(sys.argv[3], lm(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].numpy())
'''


def test_a_model_with_dsa_gates_exports_with_them(bundled_store, tmp_path):
    import torch

    from megabase.model import log_probs, save_checkpoint
    from tests.model.test_dsa_gate import _gated
    from tests.model.conftest import live_model

    model = _gated(live_model("debug", dsa_gate=True)).eval()
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    assert main(["export-model", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    seq = np.concatenate([[SEP], np.asarray(bundled_store.tokens("chr22")[40_000:41_000])])
    np.save(tmp_path / "ids.npy", seq.astype(np.int64))
    done = run_python(GATED, tmp_path / "out", tmp_path / "ids.npy", tmp_path / "lp.npy",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    ours = log_probs(model, torch.from_numpy(seq.astype(np.int64))[None])[0].numpy()
    assert np.abs(np.load(tmp_path / "lp.npy") - ours).max() <= 1e-5
