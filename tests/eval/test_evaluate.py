import json
import math

import numpy as np
import pytest

from megabase.pipeline.cli import main


def test_markov_order0_report_matches_base_counts(bundled_store, tmp_path, capsys):
    code = main(["baseline", "markov", "--data", str(bundled_store.path), "--order", "0",
                 "--train", "chr01,chr02", "--eval", "chr22", "--out", str(tmp_path / "r"),
                 "--quiet", "--bootstrap", "50"])
    assert code == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    train = np.concatenate([np.array(bundled_store.tokens(c)) for c in ("chr01", "chr02")])
    evaluate = np.array(bundled_store.tokens("chr22"))
    p = (np.bincount(train[train < 4], minlength=4) + 0.5) / ((train < 4).sum() + 2.0)
    counts = np.bincount(evaluate[evaluate < 4], minlength=4)
    direct = -(counts * np.log(p)).sum() / counts.sum() / math.log(2)
    assert report["overall"]["bits_per_base"] == pytest.approx(direct, rel=1e-9)
    assert report["overall"]["n_tokens"] == counts.sum()
    assert (tmp_path / "r" / "report.csv").read_text().startswith("series,context_lo,context_hi")
    assert (tmp_path / "r" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "published anchors" in capsys.readouterr().out


def test_debug_checkpoint_evaluates_end_to_end(bundled_store, tmp_path):
    import torch

    from megabase.model import build_model, save_checkpoint

    torch.manual_seed(0)
    ckpt = save_checkpoint(build_model("debug"), tmp_path / "ckpt", extra={"window_length": 2048})
    code = main(["evaluate", "--checkpoint", str(ckpt), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-6,000", "--controls", "500", "--baseline", "1",
                 "--train", "chr01:1-100,000", "--bootstrap", "20", "--quiet",
                 "--out", str(tmp_path / "eval")])
    assert code == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["n_windows"] == 3 and report["edges"] == [0, 1000, 2048]
    for key in ("context_lo", "context_hi", "n_tokens", "nats_per_base", "bits_per_base"):
        assert key in report["bins"][0] and key in report["overall"]
    n_bases = int((np.array(bundled_store.tokens("chr22")[:6_000]) < 4).sum())
    assert report["overall"]["n_tokens"] == n_bases
    assert set(report["controls"]) == {"500"} and "markov order 1" in report["baselines"]
    assert report["probe"][0]["distance"] == 1_000
    assert 1.5 < report["overall"]["bits_per_base"] < 5
    ref = report["copy_reference"]  # the copy model, scored on the same windows and controls
    assert ref["overall"]["n_tokens"] == n_bases and set(ref["controls"]) == {"500"}
    assert ref["controls"]["500"]["overall"]["n_tokens"] == n_bases
    worth = report["context_worth"]["500"]
    assert (worth["context_lo"], worth["context_hi"]) == (1000, 2048)
    # the model's pooled gain is its per-bin gain where one bin lies beyond the limit
    assert worth["model"]["all"]["gain_bits_per_base"] == pytest.approx(
        report["context_gain"]["500"][1]["all"]["gain_bits_per_base"])
    assert worth["copy"]["all"]["gain_bits_per_base"] == pytest.approx(
        ref["controls"]["500"]["bins"][1]["bits_per_base"] - ref["bins"][1]["bits_per_base"])
    assert "copy model" in {row.split(",")[0] for row in
                            (tmp_path / "eval" / "report.csv").read_text().splitlines()}


def test_evaluate_rejects_a_missing_checkpoint(tmp_path, capsys):
    code = main(["evaluate", "--checkpoint", str(tmp_path / "none"), "--data", str(tmp_path)])
    assert code == 2 and "not a checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("genome, eval_region, train_region", [
    ("umaydis_store", "chr22:1-4,096", "chr01,chr02:1-200,000"),
    # a region split of human chr22: fit on one part, score another
    ("hsap_store", "chr22:30,024,577-30,028,672", "chr22:20,000,001-30,000,000"),
])
def test_debug_checkpoint_on_the_real_genomes(request, tmp_path, genome, eval_region,
                                              train_region):
    import torch

    from megabase.data.names import parse_region
    from megabase.model import build_model, save_checkpoint

    store = request.getfixturevalue(genome)
    torch.manual_seed(0)
    ckpt = save_checkpoint(build_model("debug"), tmp_path / "ckpt", extra={"window_length": 2048})
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(store.path),
                 "--regions", eval_region, "--controls", "500", "--baseline", "0",
                 "--train", train_region, "--no-probe", "--bootstrap", "20", "--quiet",
                 "--no-mlflow", "--out", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    region = parse_region(eval_region, store.names)
    bases = np.array(store.tokens(region.name)[region.start : region.end])
    assert report["overall"]["n_tokens"] == int((bases < 4).sum()) > 0
    assert sum(b["n_tokens"] for b in report["bins"]) == report["overall"]["n_tokens"]
    assert 1.0 < report["baselines"]["markov order 0"]["overall"]["bits_per_base"] < 2.1


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("command, names", [
    (["baseline", "markov", "--order", "8", "--train", "chr22", "--eval", "chr22:1-20,000"],
     "--train region chr22 shares bases with the scored chr22:1-20,000"),
    (["baseline", "copy", "--train", "chr01,chr22:100,001-200,000",
      "--eval", "chr22:150,001-160,000"],
     "--train region chr22:100,001-200,000 shares bases with the scored chr22:150,001-160,000"),
    # a training region nested in a longer one of its own must not hide the overlap
    (["baseline", "markov", "--order", "2", "--train", "chr22:1-100,000,chr22:11-20",
      "--eval", "chr22:50,001-60,000"], "--train region chr22:1-100,000 shares bases"),
])
def test_baselines_fitted_on_the_bases_they_score_are_refused(umaydis_store, tmp_path, capsys,
                                                              command, names):
    out = tmp_path / "r"
    assert main([*command, "--data", str(umaydis_store.path), "--out", str(out), "--quiet"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"megabase {command[0]}: error: ") and names in line, line
    assert not out.exists()


def test_evaluate_refuses_baselines_fitted_on_its_windows(umaydis_store, tmp_path, capsys):
    import torch

    from megabase.model import build_model, save_checkpoint

    torch.manual_seed(0)
    ckpt = save_checkpoint(build_model("debug"), tmp_path / "ckpt", extra={"window_length": 2048})
    common = ["evaluate", "--checkpoint", str(ckpt), "--data", str(umaydis_store.path),
              "--no-probe", "--no-mlflow", "--quiet", "--out", str(tmp_path / "eval")]
    assert main([*common, "--regions", "chr22:1-4,096", "--train", "chr22"]) == 2
    assert "--train region chr22 shares bases with the scored chr22:1-4,096" in _one_line(capsys)
    bed = tmp_path / "w.bed"  # windows from a BED are checked too, one by one
    bed.write_text("chr22\t0\t2048\teval\nchr01\t5000\t7048\teval\n")
    assert main([*common, "--windows", str(bed), "--regions", "chr22:1-4,096",
                 "--train", "chr01:1-6,000"]) == 2
    assert "--train region chr01:1-6,000 shares bases with the scored chr01:5,001-7,048" \
        in _one_line(capsys)
    assert not (tmp_path / "eval").exists()


def test_edges_short_of_the_window_get_a_last_bin_and_compare_stays_honest(
        checkpoint, hsap_store, tmp_path, capsys):
    """--edges 0,100,1000 on 4,096-base windows: every scored base stays in the report (a last
    bin [1000, 4096) is added), so the same checkpoint scored with other edges is no gain."""
    region = "chr22:30,024,577-30,032,768"  # human, N runs inside: not every base is scored
    common = ["evaluate", "--checkpoint", str(checkpoint), "--data", str(hsap_store.path),
              "--regions", region, "--length", "4096", "--controls", "100000", "--no-probe",
              "--no-copy", "--baseline", "2", "--train", "chr22:20,000,001-30,000,000",
              "--bootstrap", "10", "--no-mlflow", "--quiet"]
    assert main([*common, "--edges", "0,100,1000", "--out", str(tmp_path / "edges")]) == 0
    assert main([*common, "--out", str(tmp_path / "default")]) == 0
    report = json.loads((tmp_path / "edges" / "report.json").read_text())
    bases = np.array(hsap_store.tokens("chr22")[30_024_576:30_032_768])
    assert report["edges"] == [0, 100, 1000, 4096]
    for curve in (report, report["baselines"]["markov order 2"]):
        assert curve["overall"]["n_tokens"] == int((bases < 4).sum()) < len(bases)
        assert sum(b["n_tokens"] for b in curve["bins"]) == curve["overall"]["n_tokens"]
    capsys.readouterr()
    csv_path = tmp_path / "table.csv"
    assert main(["compare", str(tmp_path / "edges"), str(tmp_path / "default"),
                 "--csv", str(csv_path)]) == 0
    overall = csv_path.read_text().splitlines()[-1].split(",")
    assert overall[:2] == ["all", "all"] and float(overall[4]) == 0.0
    assert "note:" not in capsys.readouterr().out


def test_baseline_copy_refuses_a_zero_control(umaydis_store, tmp_path, capsys):
    assert main(["baseline", "copy", "--data", str(umaydis_store.path), "--train", "chr01",
                 "--eval", "chr22:1-4,096", "--controls", "0", "--out", str(tmp_path / "r"),
                 "--quiet"]) == 2
    assert "--controls must be positive context lengths, got 0" in _one_line(capsys)
    assert not (tmp_path / "r").exists()


def test_scoring_logs_progress_lines_when_stderr_is_not_a_terminal(umaydis_store, tmp_path,
                                                                   capsys, monkeypatch):
    import torch

    from megabase.model import build_model, save_checkpoint

    monkeypatch.setenv("MEGABASE_PROGRESS_EVERY_S", "0")  # a line per window, not per 30 s
    torch.manual_seed(0)
    ckpt = save_checkpoint(build_model("debug"), tmp_path / "ckpt", extra={"window_length": 2048})
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(umaydis_store.path),
                 "--regions", "chr22:1-4,096", "--train", "chr01:1-50,000", "--baseline", "1",
                 "--controls", "500", "--probe-windows", "2", "--bootstrap", "5", "--no-mlflow",
                 "--out", str(tmp_path / "eval")]) == 0
    err = capsys.readouterr().err
    for phase in ("model", "control <= 500", "copy model", "markov 1", "recall probe"):
        assert f"megabase: {phase}: 1/" in err, (phase, err)
    assert "megabase: model: 2/2 windows (100%)" in err and "bases/s" in err
    assert "megabase: model: 2 windows done in" in err
