"""Nothing mixed: two processes on one run folder, and a resume with other settings."""

import subprocess
import sys
import time

import yaml

from megabase.core.locks import holding, lock_path
from megabase.pipeline.cli import main
from megabase.pipeline.train import read_train_log

from tests.pipeline.test_train import tiny


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(bundled_store, tmp_path,
                                                                   capsys):
    args = tiny(tmp_path, bundled_store, 12)
    first = subprocess.Popen([sys.executable, "-m", "megabase.pipeline.cli", "run", *args,
                              "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = tmp_path / "runs" / "tiny"
    lock = lock_path(run)
    while first.poll() is None and not (lock.is_file() and lock.read_text().startswith(
            str(first.pid))):
        time.sleep(0.01)
    assert first.poll() is None, first.stderr.read().decode()[-2000:]
    for command in ("run", "train"):
        assert main([command, *args, *(["--resume"] if command == "train" else []), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"in use by process {first.pid} (megabase run)" in err[0], err
    assert first.wait() == 0, first.stderr.read().decode()[-2000:]
    assert sorted(read_train_log(run)) == list(range(1, 13))
    steps = [yaml.safe_load(line)["step"] for line in
             (run / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # one writer: no step logged twice
    assert main(["run", *args, "--quiet"]) == 0  # the lock went with its holder


def test_the_lock_is_reentrant_and_released(tmp_path):
    target = tmp_path / "runs" / "x"
    with holding(target, "run 'x'"):
        with holding(target, "run 'x'"):
            pass
        probe = subprocess.run([sys.executable, "-c", (
            "import sys; from megabase.core.locks import holding\n"
            "from megabase.core.errors import InputError\n"
            f"try:\n    holding({str(target)!r}, 'run x').__enter__()\n"
            "except InputError as e:\n    print(e); sys.exit(3)\n")], capture_output=True,
            text=True)
        assert probe.returncode == 3 and "in use by process" in probe.stdout
    again = subprocess.run([sys.executable, "-c", (
        "from megabase.core.locks import holding\n"
        f"with holding({str(target)!r}, 'run x'): print('held')\n")], capture_output=True,
        text=True)
    assert again.returncode == 0 and again.stdout.strip() == "held"


def test_a_resume_with_other_settings_refuses_before_writing(bundled_store, tmp_path, capsys):
    args = tiny(tmp_path, bundled_store, 4)
    assert main(["train", *args, "--quiet"]) == 0
    run = tmp_path / "runs" / "tiny"
    config = (run / "config.yaml").read_text()
    log = (run / "train_log.jsonl").read_text()
    capsys.readouterr()
    for change, shown in ((["--set", "data.window_length=1024"], "data.window_length: 2048 -> 1024"),
                          (["--set", "model.preset=cpu-small"], "model.preset: 'debug' -> 'cpu-small'"),
                          (["--set", "train.lr=0.01"], "train.lr")):
        for command in (["train", "--resume"], ["run"]):
            assert main([command[0], *args, *change, *command[1:], "--quiet"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and shown in err[0] and "--set name=" in err[0], err
            assert (run / "config.yaml").read_text() == config  # nothing rewritten
            assert (run / "train_log.jsonl").read_text() == log
    # how long it runs may change, and the new config records it
    assert main(["train", *tiny(tmp_path, bundled_store, 6), "--resume", "--quiet"]) == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 6
    assert sorted(read_train_log(run)) == list(range(1, 7))


def test_a_moved_workdir_resumes(bundled_store, tmp_path, capsys):
    assert main(["train", *tiny(tmp_path / "a", bundled_store, 4), "--quiet"]) == 0
    (tmp_path / "a").rename(tmp_path / "b")  # to other storage, as a cluster's scratch is
    # a new process, as a resume is (MLflow caches a run's artifact folder in the process)
    subprocess.run([sys.executable, "-m", "megabase.pipeline.cli", "train",
                    *tiny(tmp_path / "b", bundled_store, 6), "--resume", "--quiet"], check=True)
    run = tmp_path / "b" / "runs" / "tiny"
    assert sorted(read_train_log(run)) == list(range(1, 7))
    assert yaml.safe_load((run / "config.yaml").read_text())["workdir"] == str(tmp_path / "b")
    assert not (tmp_path / "a").exists(), sorted(p for p in (tmp_path / "a").rglob("*"))
    assert list((tmp_path / "b" / "mlartifacts").rglob("checkpoint.json"))
