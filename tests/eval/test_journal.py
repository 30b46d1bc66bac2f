"""A stopped evaluation resumes from the windows it finished, with an uninterrupted one's numbers."""

import json

import pytest

from megabase.eval.journal import NAME, Journal
from megabase.pipeline.cli import main

REGION, TRAIN = "chr22:30,024,577-30,036,864", "chr22:29,000,001-30,000,000"


@pytest.fixture(scope="module")
def debug_ckpt(tmp_path_factory):
    import torch

    from megabase.model import build_model, save_checkpoint

    torch.manual_seed(0)
    return save_checkpoint(build_model("debug"), tmp_path_factory.mktemp("ckpt") / "ckpt",
                           extra={"window_length": 4096})


def _evaluate(ckpt, store, out, *extra) -> int:
    return main(["evaluate", "--checkpoint", str(ckpt), "--data", str(store.path),
                 "--regions", REGION, "--train", TRAIN, "--controls", "500,2000",
                 "--baselines", "2", "--probe-distances", "1000,3000", "--probe-windows", "2",
                 "--probe-pairs", "2", "--bootstrap", "50", "--ci-block", "1024",
                 "--edges", "0,1000,2000", "--quiet",
                 "--no-mlflow", "--out", str(out), *extra])


def _numbers(report):
    """The report without what is not a number of the model's (wall times, the files' paths)."""
    if isinstance(report, dict):
        return {k: _numbers(v) for k, v in report.items()
                if k not in ("seconds", "tries", "files", "journaled")}
    return [_numbers(v) for v in report] if isinstance(report, list) else report


@pytest.fixture(scope="module")
def uninterrupted(debug_ckpt, hsap_store, tmp_path_factory):
    """The report of an evaluation run through, and the windows it journaled, in order."""
    out = tmp_path_factory.mktemp("whole") / "eval"
    mp = pytest.MonkeyPatch()
    order = []
    original = Journal.add
    mp.setattr(Journal, "add", lambda self, s, i, **d: (order.append((s, i)),
                                                        original(self, s, i, **d)))
    try:
        assert _evaluate(debug_ckpt, hsap_store, out) == 0
    finally:
        mp.undo()
    report = json.loads((out / "report.json").read_text())
    report["journaled"] = order
    return report


def test_the_report_names_its_resampling_unit(uninterrupted):
    """Blocks of 1,024 bases in three windows of 4,096 (human chr22, a few N): twelve units."""
    assert uninterrupted["n_windows"] == 3 and uninterrupted["tries"] == 1
    # model, 2 controls, copy model and its 2, markov 2: 3 windows each; 4 probe windows
    assert len(uninterrupted["journaled"]) == 7 * 3 + 4
    assert uninterrupted["ci_unit"] == {"kind": "block", "bases": 1024, "n_units": 12,
                                        "n_windows": 3}
    # contexts [0, 1000) lie in block 0 of each window, [1000, 2000) in blocks 0-1 (1,024
    # bases each), [2000, 4096) in blocks 1-3
    assert [b["n_units"] for b in uninterrupted["bins"]] == [3, 6, 9]
    last = uninterrupted["baselines"]["markov order 2"]["bins"][-1]  # the model is untrained
    assert last["bits_per_base_ci"][0] < last["bits_per_base"] < last["bits_per_base_ci"][1]
    gain = uninterrupted["context_gain"]["2000"][-1]["all"]
    assert gain["n_units"] == 9


def test_a_stopped_evaluation_resumes_with_the_same_numbers(
        debug_ckpt, hsap_store, tmp_path, monkeypatch, capsys, uninterrupted):
    """Stopped three times (in the model's windows, the copy model's, the recall probe's) and
    resumed each time: the report is the uninterrupted one's, and every window was scored once."""
    out = tmp_path / "eval"
    whole = [tuple(x) for x in uninterrupted["journaled"]]
    original = Journal.add
    scored = []
    for stop_after in (2, 11, 22):
        def stop(self, series, index, **data):
            original(self, series, index, **data)
            scored.append((series, index))
            if len(scored) == stop_after:
                raise KeyboardInterrupt

        monkeypatch.setattr(Journal, "add", stop)
        assert _evaluate(debug_ckpt, hsap_store, out) == 130
        err = capsys.readouterr().err
        assert f"interrupted; the {stop_after} windows scored so far are kept in {out / NAME}" in err
        assert not (out / "report.json").exists() and (out / NAME).is_file()
    monkeypatch.setattr(Journal, "add", lambda self, s, i, **d: (scored.append((s, i)),
                                                                  original(self, s, i, **d)))
    assert _evaluate(debug_ckpt, hsap_store, out) == 0
    report = json.loads((out / "report.json").read_text())
    assert _numbers(report) == _numbers(uninterrupted)
    assert report["tries"] == 4 and not (out / NAME).exists()
    assert report["seconds"] > 0 and "s over 4 tries)" in capsys.readouterr().out
    assert scored == whole  # each window scored once, in the order of an uninterrupted run
    assert [s for s, _ in whole[1:3]] == ["model", "model"] and whole[10][0] == "copy model"
    assert whole[21][0] == "recall probe"


def test_a_journal_of_another_evaluation_is_replaced(debug_ckpt, hsap_store, tmp_path,
                                                    uninterrupted):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / NAME).write_text(json.dumps({"fingerprint": {"checkpoint_sha256": "other"}}) + "\n"
                            + json.dumps({"series": "model", "index": 0, "try": 1, "seconds": 5,
                                          "data": {"nats": [[[1e9, 0]]], "counts": [[[1, 0]]]}})
                            + "\n{\"series\": \"model\", \"ind")  # a line cut by the stop
    assert _evaluate(debug_ckpt, hsap_store, out) == 0
    report = json.loads((out / "report.json").read_text())
    assert _numbers(report) == _numbers(uninterrupted) and report["tries"] == 1
    assert (out / "notes.txt").read_text() == "mine" and not (out / NAME).exists()


def test_a_journal_keeps_floats_to_the_last_bit_and_counts_every_try(tmp_path):
    import numpy as np

    values = np.random.default_rng(0).random((2, 3, 2)) * 1e6
    first = Journal(tmp_path, {"a": 1})
    first.add("model", 0, nats=values, counts=np.ones((2, 3, 2), np.int64))
    first.close(finished=False)
    second = Journal(tmp_path, {"a": 1})
    assert second.tries == 2 and len(second) == 1 and second.spent > 0
    assert (np.array(second.get("model", 0)["nats"]) == values).all()
    second.add("model", 1, nats=values, counts=values)
    second.close(finished=False)
    third = Journal(tmp_path, {"a": 1})
    assert third.tries == 3 and len(third) == 2 and third.spent >= second.spent
    lines = (tmp_path / NAME).read_text().splitlines()
    assert len(lines) == 1 + 2  # the header, each window once
    assert Journal(tmp_path, {"a": 2}).tries == 1  # another evaluation's journal is not read
