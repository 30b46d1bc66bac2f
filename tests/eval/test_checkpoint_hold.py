"""`evaluate --checkpoint RUN` while the run trains: the checkpoint it reads is held against
rotation, and its report lands outside the checkpoint (rotation removes checkpoints whole)."""

import errno
import fcntl
import json
import os
import threading
import time

import pytest

from megabase.model.checkpoint import LATEST, TRAINER_STATE

from megabase.pipeline.checkpointing import rotate_checkpoints
from megabase.pipeline.cli import main


def _save(run, step: int, model) -> None:
    from megabase.model import save_checkpoint

    save_checkpoint(model, run / "checkpoints" / f"step-{step:06d}",
                    extra={"window_length": 2048, "step": step},
                    files={TRAINER_STATE: b"written by the trainer"})
    (run / "checkpoints" / LATEST).write_text(f"step-{step:06d}\n")


def _gated_store(store, folder):
    """``store`` seen through ``folder``: its records linked, its manifest a FIFO, so that a
    reader of the store waits, at a known point, until the test writes the manifest."""
    folder.mkdir()
    for entry in store.path.iterdir():
        if entry.name != "manifest.json":
            (folder / entry.name).symlink_to(entry)
    os.mkfifo(folder / "manifest.json")
    return folder


def _writer_when_read(fifo, thread) -> int:
    """A descriptor writing to ``fifo`` once a reader has it open (the evaluation, blocked
    there); fails the test if the evaluation ended before getting there."""
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            assert thread.is_alive(), "evaluate ended before it read the store"
            time.sleep(0.05)
            continue
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd


def test_rotation_keeps_the_checkpoint_evaluate_reads(umaydis_store, tmp_path, capsys):
    import torch

    from megabase.model import build_model

    torch.manual_seed(0)
    model = build_model("debug")
    run = tmp_path / "runs" / "demo"
    for step in (1, 2):
        _save(run, step, model)
    gated = _gated_store(umaydis_store, tmp_path / "store")
    codes = []
    evaluation = threading.Thread(target=lambda: codes.append(main([
        "evaluate", "--checkpoint", str(run), "--data", str(gated), "--regions", "chr22:1-4,096",
        "--train", "chr01:1-50,000", "--baseline", "0", "--no-copy", "--no-probe",
        "--bootstrap", "5", "--no-mlflow", "--quiet"])))
    evaluation.start()
    fd = _writer_when_read(gated / "manifest.json", evaluation)
    try:
        # the run trains on meanwhile: two more checkpoints, and rotation keeping two
        for step in (3, 4):
            _save(run, step, model)
        kept = rotate_checkpoints(run, 4, keep=2)
        held = run / "checkpoints" / "step-000002"
        assert kept == [held] and (held / "model.safetensors").is_file()
        os.write(fd, (umaydis_store.path / "manifest.json").read_bytes())
    finally:
        os.close(fd)
    evaluation.join()
    assert codes == [0], capsys.readouterr().err

    report_dir = run / "eval" / "step-000002"  # beside the checkpoints, not inside one
    report = json.loads((report_dir / "report.json").read_text())
    assert report["checkpoint"] == str(held.resolve()) and report["overall"]["n_tokens"] == 4096
    assert not (held / "eval").exists()
    assert str(report_dir / "report.json") in "".join(capsys.readouterr().out.split())  # wrapped
    # once the evaluation is done, the next rotation removes it; the report stays
    assert rotate_checkpoints(run, 4, keep=2) == [] and not held.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == \
        [LATEST, "step-000003", "step-000004"]
    assert (report_dir / "report.json").is_file()


def test_a_hold_and_a_removal_exclude_each_other(tmp_path):
    """A held checkpoint is not removed; a removed one cannot be held; a run folder's hold is on
    its latest checkpoint."""
    import torch

    from megabase.core.locks import hold_reading, release_reading, remove_unless_read
    from megabase.model import build_model
    from megabase.model.checkpoint import held_checkpoint

    torch.manual_seed(0)
    model = build_model("debug")
    run = tmp_path / "run"
    _save(run, 1, model)
    first = run / "checkpoints" / "step-000001"
    fd = hold_reading(first)
    assert not remove_unless_read(first)  # a reader holds it
    release_reading(fd)
    _save(run, 2, model)
    assert remove_unless_read(first) and not first.exists()
    with held_checkpoint(run) as ckpt:
        assert ckpt == run / "checkpoints" / "step-000002"
        assert not remove_unless_read(ckpt) and ckpt.is_dir()
    with pytest.raises(FileNotFoundError):
        hold_reading(first)
