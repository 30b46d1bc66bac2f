"""The installed ``megabase`` command, run as a user runs it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def megabase(*args, cwd=None):
    exe = shutil.which("megabase", path=str(Path(sys.executable).parent)) or shutil.which("megabase")
    assert exe, "the megabase console script is not installed"
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env)


def test_main_job_on_the_bundled_genome(tmp_path):
    store = tmp_path / "store"
    done = megabase("prepare", "--out", store)
    assert done.returncode == 0, done.stderr
    for text in ("chr01", "2,476,500", "chr22", "403,592", "total (3)", "Mbp/s"):
        assert text in done.stdout
    again = megabase("prepare", "--out", store)
    assert again.returncode == 0 and "up to date" in again.stdout
    win = megabase("windows", store, "--length", "65536", "--split", "train=chr1,chr2",
                   "--split", "eval=chr22")
    assert win.returncode == 0, win.stderr
    bed = store / "windows-65536.bed"
    rows = [line.split("\t") for line in bed.read_text().splitlines() if not line.startswith("#")]
    assert sum(r[3] == "eval" for r in rows) == 7 and sum(r[3] == "train" for r in rows) == 38 + 29
    assert "eval" in win.stdout and "dropped (N)" in win.stdout


def test_export_command(tmp_path):
    pytest.importorskip("datasets")
    store = tmp_path / "store"
    assert megabase("prepare", "--out", store, "--chroms", "chr22", "--quiet").returncode == 0
    assert megabase("windows", store, "--length", "200000", "--split", "eval=chr22",
                    "--out", tmp_path / "w.bed").returncode == 0
    done = megabase("export", store, "--windows", tmp_path / "w.bed", "--out", tmp_path / "hf",
                    "--cache-dir", tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    assert "exported 3 windows" in done.stdout


def test_error_exit_status_and_single_line(tmp_path):
    done = megabase("prepare", tmp_path / "missing.fa", "--out", tmp_path / "s")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"megabase prepare: error: {tmp_path / 'missing.fa'}: no such file"]


def test_the_cli_lets_idle_threads_sleep_soon_unless_told_otherwise():
    # spinning OpenMP threads took the cores of a job beside them (benchmarks/bench_threads.py)
    probe = ("import os; from megabase.pipeline import cli; cli.share_cores(); import torch; "
             "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for given, expected in (({}, "10000 None"), ({"OMP_WAIT_POLICY": "active"}, "None active"),
                            ({"GOMP_SPINCOUNT": "5"}, "5 None")):
        got = subprocess.run([sys.executable, "-c", probe], env={**env, **given},
                             capture_output=True, text=True)
        assert got.stdout.strip() == expected, (given, got.stderr[-2000:])


def test_prepare_log_and_compare_start_without_torch():
    """The CLI and the tracking module (megabase log, compare) load no torch: prepare's start-up
    time is the user's first impression, and reading a report needs no model."""
    import subprocess
    import sys

    code = ("import sys, megabase.pipeline.cli, megabase.pipeline.tracking, megabase.data; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
