"""Locks of run folders and stores: the folders taking a lock creates are gone with it when empty."""

import subprocess
import sys

import pytest

from megabase.core.errors import InputError
from megabase.core.locks import holding, lock_path


def test_a_lock_leaves_no_folder_it_made_and_empty(tmp_path):
    run = tmp_path / "work" / "runs" / "demo"
    with holding(run, "run 'demo'"):
        assert lock_path(run).is_file()
    assert not (tmp_path / "work").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_keeps_folders_that_hold_something_or_were_there(tmp_path):
    runs = tmp_path / "runs"
    with holding(runs / "demo", "run 'demo'"):
        (runs / "demo").mkdir()  # what the run wrote
    assert (runs / "demo").is_dir() and not lock_path(runs / "demo").exists()

    (tmp_path / "mine").mkdir()  # not the lock's: kept although empty afterwards
    with holding(tmp_path / "mine" / "x", "run 'x'"):
        pass
    assert (tmp_path / "mine").is_dir()


def test_a_refusal_inside_the_lock_leaves_nothing(tmp_path):
    with pytest.raises(InputError):
        with holding(tmp_path / "w" / "runs" / "big", "run 'big'"):
            raise InputError("a training step at 1,048,576 tokens needs ~206.9 GB")
    assert list(tmp_path.iterdir()) == []


def test_a_lock_held_by_another_process_is_refused_and_its_folder_kept(tmp_path):
    run = tmp_path / "runs" / "demo"
    code = ("import sys; from megabase.core.locks import holding\n"
            f"with holding({str(run)!r}, 'run'):\n"
            "    print('held', flush=True); sys.stdin.readline()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(InputError, match="in use by process"):
            with holding(run, "run 'demo'"):
                pass
        assert lock_path(run).is_file()  # the other's lock, and its folder, untouched
    finally:
        other.communicate("\n", timeout=60)
    assert not (tmp_path / "runs").exists()  # the holder made it and took it away
