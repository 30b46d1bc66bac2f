"""A tracking store another process holds locked: commands wait, then end in one line, and what
they computed stays on disk to be logged later (`megabase log`)."""

import json
import subprocess
import sys

import pytest

from megabase.pipeline.tracking import resolve_tracking_uri
from megabase.pipeline.cli import main

HOLD = ("import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n")


@pytest.fixture
def locked_store(tmp_path):
    """``(uri, hold)``: a fresh SQLite store, and ``hold(seconds)`` -> a process holding its lock."""
    uri = resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    procs = []

    def hold(seconds: float):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, uri[len("sqlite:///"):], str(seconds)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "locked"
        procs.append(proc)
        return proc

    yield uri, hold
    for proc in procs:
        proc.kill()
        proc.wait()


def _evaluate(ckpt, store, out, uri):
    return ["evaluate", "--checkpoint", str(ckpt), "--data", str(store.path), "--regions",
            "chr22:1-4,096", "--controls", "", "--no-probe", "--baselines", "", "--no-copy", "--bootstrap", "5",
            "--quiet", "--out", str(out), "--tracking-uri", uri, "--experiment", "locked"]


def test_evaluate_keeps_its_report_and_it_can_be_logged_later(tracked, bundled_store, tmp_path,
                                                              locked_store, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    uri, hold = locked_store
    monkeypatch.setenv("MEGABASE_TRACKING_WAIT_S", "0")  # one try: SQLite's own 20 s wait
    holder = hold(600)
    out = tmp_path / "report"
    assert main(_evaluate(tracked["ckpt"], bundled_store, out, uri)) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "locked by another process" in err[0], err
    assert f"megabase log {out}" in err[0]
    report = json.loads((out / "report.json").read_text())
    assert "mlflow" not in report and report["bins"]
    holder.kill()
    holder.wait()

    assert main(["log", str(out), "--tracking-uri", uri, "--experiment", "locked"]) == 0
    logged = json.loads((out / "report.json").read_text())["mlflow"]
    run = MlflowClient(uri).get_run(logged["run_id"])
    assert run.data.metrics["eval/bits_per_base"] == pytest.approx(
        report["overall"]["bits_per_base"])
    assert main(["log", str(tmp_path), "--tracking-uri", uri]) == 2  # no report there


def test_a_short_lock_is_waited_out(tracked, bundled_store, tmp_path, locked_store, capsys):
    uri, hold = locked_store
    hold(3)
    assert main(_evaluate(tracked["ckpt"], bundled_store, tmp_path / "r", uri)) == 0
    assert json.loads((tmp_path / "r" / "report.json").read_text())["mlflow"]["run_id"]


def test_run_refuses_in_one_line_when_the_store_stays_locked(bundled_store, tmp_path, locked_store,
                                                             monkeypatch, capsys):
    from tests.pipeline.test_train import tiny

    uri, hold = locked_store
    monkeypatch.setenv("MEGABASE_TRACKING_WAIT_S", "0")
    hold(600)
    args = tiny(tmp_path, bundled_store, 2, **{"tracking.tracking_uri": uri})
    assert main(["run", *args, "--quiet"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "locked by another process" in err[0] and "nothing was trained" in \
        err[0], err
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()


def _limited(kib: int):
    """For a child process: files it writes end at ``kib`` KiB (``ulimit -f``); a write past that
    fails with EFBIG (Python ignores SIGXFSZ), as a write to a full disk fails with ENOSPC."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, kib * 1024))
    return limit


def test_a_store_that_cannot_be_written_keeps_the_report(umaydis_store, tmp_path):
    """The MLflow store under `ulimit -f`: SQLite's "disk I/O error" ends the command in one line
    naming the store (exit 3, the machine's trouble), and the report waits on disk for `log`."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # made before the limit
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "megabase.pipeline.cli", "baseline", "markov",
         "--data", str(umaydis_store.path), "--order", "2", "--train", "chr01",
         "--eval", "chr22:1-4,096", "--length", "2048", "--bootstrap", "5", "--quiet",
         "--out", str(out), "--tracking-uri", uri, "--experiment", "full"],
        capture_output=True, text=True, preexec_fn=_limited(100))  # the report fits, the store not
    err = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(err) == 1, done.stderr[-3000:]
    assert err[0].startswith(f"megabase baseline: error: {uri}: the MLflow store cannot be "
                             "written ("), err
    assert "(disk I/O error)" in err[0] or "(database or disk is full)" in err[0], err
    assert f"log it later with `megabase log {out} --tracking-uri {uri} --experiment full`" \
        in err[0]
    report = json.loads((out / "report.json").read_text())
    assert "mlflow" not in report and report["overall"]["n_tokens"] == 4096

    assert main(["log", str(out), "--tracking-uri", uri, "--experiment", "full"]) == 0
    logged = json.loads((out / "report.json").read_text())["mlflow"]
    run = MlflowClient(uri).get_run(logged["run_id"])
    assert run.data.metrics["eval/bits_per_base"] == pytest.approx(
        report["overall"]["bits_per_base"])


def test_a_full_database_is_a_store_failure(tmp_path):
    """SQLite's own "database or disk is full" (a page limit stands in for the disk), as MLflow
    wraps it: recognised through the chain of causes."""
    import sqlite3

    from megabase.pipeline.tracking import TrackingStoreError, retry_locked, store_failure

    db = sqlite3.connect(tmp_path / "small.db")
    db.execute("CREATE TABLE t (x BLOB)")
    db.execute("PRAGMA max_page_count = 3")

    def fill():
        try:
            db.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
        except sqlite3.OperationalError as exc:
            raise RuntimeError("(sqlite3.OperationalError) wrapped") from exc

    with pytest.raises(RuntimeError) as caught:
        fill()
    assert store_failure(caught.value) == "database or disk is full"
    with pytest.raises(TrackingStoreError, match=r"^sqlite:///x\.db: the MLflow store cannot be "
                       r"written \(database or disk is full\); kept here$"):
        retry_locked(fill, "sqlite:///x.db", "kept here")
