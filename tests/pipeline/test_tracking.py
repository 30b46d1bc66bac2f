"""MLflow logging of reports, and `megabase compare` over report files and runs."""

import json

import pytest

from megabase.core.errors import InputError
from megabase.eval.report import report_metrics
from megabase.pipeline.tracking import resolve_tracking_uri
from megabase.pipeline.cli import main


def test_report_lands_in_its_run(tracked):
    from mlflow.tracking import MlflowClient

    report = tracked["reports"]["model"]
    run_id = report["mlflow"]["run_id"]
    client = MlflowClient(tracked["uri"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["megabase.kind"] == "evaluate"
    first = report["bins"][0]
    key = f"eval/bits_per_base/ctx_{first['context_lo']}-{first['context_hi']}"
    assert run.data.metrics[key] == pytest.approx(first["bits_per_base"])
    assert run.data.metrics["eval/bits_per_base"] == pytest.approx(
        report["overall"]["bits_per_base"])
    assert "eval/control_500/bits_per_base" in run.data.metrics
    ref = report["copy_reference"]
    assert run.data.metrics["eval/copy/bits_per_base"] == pytest.approx(ref["overall"]["bits_per_base"])
    assert run.data.metrics["eval/copy/control_500/bits_per_base"] == pytest.approx(
        ref["controls"]["500"]["overall"]["bits_per_base"])
    worth = report["context_worth"]["500"]
    for who in ("model", "copy"):
        assert run.data.metrics[f"eval/context_worth_500/{who}/all"] == pytest.approx(
            worth[who]["all"]["gain_bits_per_base"])
    curve = client.get_metric_history(run_id, "eval/bits_per_base_by_context")
    assert sorted(m.step for m in curve) == [b["context_hi"] for b in report["bins"]]
    artifacts = {a.path for a in client.list_artifacts(run_id, "eval")}
    assert {"eval/report.json", "eval/report.csv", "eval/report.png", "eval/bins.json"} <= artifacts


def test_logged_table_reads_back_with_load_table(tracked):
    import mlflow

    run = tracked["reports"]["model"]["mlflow"]
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracked["uri"])  # load_table searches the global store
    try:
        table = mlflow.MlflowClient().load_table(run["experiment_id"], "eval/bins.json",
                                                 run_ids=[run["run_id"]])
    finally:
        mlflow.set_tracking_uri(before)
    model = table[table["role"] == "model"]
    assert list(model["bits_per_base"]) == pytest.approx(
        [b["bits_per_base"] for b in tracked["reports"]["model"]["bins"]])
    assert set(table["role"]) == {"model", "control", "reference", "reference control"}


def test_checkpoint_from_a_run_reports_into_that_run(tracked, bundled_store, tmp_path):
    """A checkpoint whose config names its run (what training writes) needs no flag."""
    from mlflow.tracking import MlflowClient

    from megabase.model import load_checkpoint, save_checkpoint

    client = MlflowClient(tracked["uri"])
    exp = client.get_experiment_by_name("tiny").experiment_id
    run = client.create_run(exp, run_name="training run")
    ckpt = save_checkpoint(load_checkpoint(tracked["ckpt"]), tmp_path / "ckpt", extra={
        "window_length": 2048, "mlflow": {"tracking_uri": tracked["uri"], "run_id": run.info.run_id}})
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-2,048", "--controls", "", "--no-probe", "--bootstrap", "5",
                 "--baselines", "", "--no-copy",
                 "--quiet", "--out", str(tmp_path / "eval")]) == 0
    after = client.get_run(run.info.run_id)
    assert after.info.status == "RUNNING"  # the trainer owns its run's status
    assert "eval/bits_per_base" in after.data.metrics


def test_another_store_gets_a_new_run(tracked, bundled_store, tmp_path):
    """--tracking-uri naming another store than the training run's: a new run there, not an
    error about the training run missing from it."""
    from mlflow.tracking import MlflowClient

    from megabase.model import load_checkpoint, save_checkpoint

    ckpt = save_checkpoint(load_checkpoint(tracked["ckpt"]), tmp_path / "ckpt", extra={
        "window_length": 2048, "mlflow": {"tracking_uri": tracked["uri"], "run_id": "f" * 32}})
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-2,048", "--controls", "", "--no-probe", "--bootstrap", "5",
                 "--baselines", "", "--no-copy", "--tracking-uri", other,
                 "--quiet", "--out", str(tmp_path / "eval")]) == 0
    client = MlflowClient(other)
    (run,) = client.search_runs([client.get_experiment_by_name("megabase").experiment_id])
    assert "eval/bits_per_base" in run.data.metrics and run.info.status == "FINISHED"


def test_unknown_run_fails_before_scoring(tracked, bundled_store, tmp_path, capsys):
    code = main(["evaluate", "--checkpoint", str(tracked["ckpt"]), "--data",
                 str(bundled_store.path), "--tracking-uri", tracked["uri"],
                 "--mlflow-run", "0123456789abcdef", "--regions", "chr22", "--baselines", "", "--no-copy",
                 "--out", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert code == 2 and "0123456789abcdef" in err and "not found" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "eval").exists()


def test_file_stores_are_refused_with_the_fix(tmp_path):
    for uri in ("file:./mlruns", "mlruns"):
        with pytest.raises(InputError, match="sqlite:///"):
            resolve_tracking_uri(uri)
    assert resolve_tracking_uri(str(tmp_path / "x.db")) == f"sqlite:///{tmp_path / 'x.db'}"


def test_metrics_skip_empty_bins():
    empty = {"n_tokens": 0, "bits_per_base": None, "nats_per_base": None, "perplexity": None,
             "bits_per_base_ci": [None, None], "context_lo": 0, "context_hi": 10,
             "unique": {"bits_per_base": None}, "repeat": {"bits_per_base": None}}
    metrics = report_metrics({"bins": [empty], "overall": empty})
    assert metrics == {"eval/n_tokens": 0.0, "eval/n_tokens/ctx_0-10": 0.0}


def test_compare_runs_and_files_side_by_side(tracked, tmp_path, capsys):
    model, markov = tracked["reports"]["model"], tracked["reports"]["markov"]
    csv_path = tmp_path / "table.csv"
    code = main(["compare", model["mlflow"]["run_id"], str(tracked["root"] / "markov"),
                 "--tracking-uri", tracked["uri"], "--csv", str(csv_path)])
    out = capsys.readouterr().out
    assert code == 0 and "gain of markov order 2" in out
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("context_lo,context_hi,evaluate ckpt bits/base")
    overall = rows[-1].split(",")
    assert overall[:2] == ["all", "all"]
    gain = float(overall[4])
    assert gain == pytest.approx(model["overall"]["bits_per_base"]
                                 - markov["overall"]["bits_per_base"])


def test_compare_with_baselines_and_bad_refs(tracked, tmp_path, capsys):
    csv_path = tmp_path / "table.csv"
    assert main(["compare", str(tracked["root"] / "model" / "report.json"), "--baselines",
                 "--csv", str(csv_path)]) == 0
    header = csv_path.read_text().splitlines()[0]
    assert "control, context <= ~500 bits/base" in header
    capsys.readouterr()
    (tmp_path / "junk.json").write_text("{}")
    (tmp_path / "half.json").write_text('{"bins": [{"context_lo": 0}], "overall": {}}')
    for ref in (str(tmp_path / "junk.json"), str(tmp_path / "missing.json"),
                str(tmp_path / "half.json")):
        assert main(["compare", ref]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and ref in err


def test_compare_of_a_sweep_prints_a_row_per_curve(tracked, capsys):
    report = str(tracked["root"] / "model" / "report.json")
    assert main(["compare", report, report, report, report]) == 0
    out = capsys.readouterr().out
    assert "one row per curve" in out and "(4)" in out and "gain (all)" in out


def test_two_processes_creating_one_fresh_store(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from megabase.pipeline.tracking import resolve_tracking_uri, _client, "
            "experiment_id; uri = resolve_tracking_uri(sys.argv[1]); "
            "print(experiment_id(_client(uri), uri, 'race'))")
    db = str(tmp_path / "fresh" / "mlflow.db")
    procs = [subprocess.Popen([sys.executable, "-c", code, db], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(), p.stdout.read().strip(), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err[-1500:] for _, _, err in results]


def test_compare_shows_no_gain_between_reports_of_other_bases(umaydis_store, tmp_path, capsys):
    """One Markov model scored on two stretches of as many bases (U. maydis has no N): the
    difference of their bits/base is not a gain, whatever the counts say."""
    common = ["baseline", "markov", "--data", str(umaydis_store.path), "--order", "2",
              "--train", "chr01", "--length", "2048", "--bootstrap", "5", "--quiet"]
    for name, region in (("a", "chr22:1-6,144"), ("b", "chr22:6,145-12,288"),
                         ("c", "chr22:1-8,192")):
        assert main([*common, "--eval", region, "--out", str(tmp_path / name)]) == 0
    old = json.loads((tmp_path / "c" / "report.json").read_text())
    old.pop("windows_sha256")  # as reports written before it: the counts tell
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(json.dumps(old))
    for other, why in (("b", "scored other windows (6,144 bases against 6,144)"),
                       ("c", "scored other windows (8,192 bases against 6,144)"),
                       ("old", "scored other bases (8,192 against 6,144 in all)")):
        capsys.readouterr()
        csv_path = tmp_path / f"{other}.csv"
        assert main(["compare", str(tmp_path / "a"), str(tmp_path / other),
                     "--csv", str(csv_path)]) == 0
        out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
        assert f"note: no gain of 'markov order 2 (2)' where it {why}" in out, out
        overall = csv_path.read_text().splitlines()[-1].split(",")
        assert overall[:2] == ["all", "all"] and overall[4] == "nan"


@pytest.mark.parametrize("damage, says", [
    (lambda r: r.update(bins="none"), "no 'bins' list and 'overall' table"),
    (lambda r: r.pop("overall"), "no 'bins' list and 'overall' table"),
    (lambda r: r["bins"][0].pop("n_tokens"), "bins[0].n_tokens is missing"),
    (lambda r: r["overall"].pop("unique"), "no 'unique' field"),
    (lambda r: r["baselines"]["markov order 2"]["overall"].update(bits_per_base="x"),
     "not a complete megabase report"),
], ids=["bins-not-a-list", "no-overall", "bin-without-count", "no-unique", "baseline-bits-text"])
def test_log_refuses_a_malformed_report_in_one_line(umaydis_store, tmp_path, capsys, damage,
                                                    says):
    out = tmp_path / "r"
    assert main(["baseline", "markov", "--data", str(umaydis_store.path), "--order", "2",
                 "--train", "chr01", "--eval", "chr22:1-4,096", "--length", "2048",
                 "--bootstrap", "5", "--quiet", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    report["baselines"] = {"markov order 2": {k: report[k] for k in ("bins", "overall")}}
    damage(report)
    (out / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    db = tmp_path / "mlflow.db"
    assert main(["log", str(out), "--tracking-uri", f"sqlite:///{db}", "--experiment", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and str(out / "report.json") in err[0], err
    assert not db.exists()  # refused before the store was even opened: no run holds half of it
