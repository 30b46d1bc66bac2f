"""`megabase rl` end to end on the debug checkpoint with prompts of the bundled genome: the
synchronous and asynchronous loops, their files and MLflow run; bad input refused in one line."""

import json

import pytest

from megabase.pipeline.cli import main


def strict(text: str):
    """JSON as strict parsers read it: a bare NaN or Infinity (Python's extension) is refused."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_rl_runs_and_records(config, asynchronous, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    from megabase.model import load_checkpoint

    monkeypatch.setenv("MEGABASE_PROGRESS_EVERY_S", "0")  # a progress line after every step
    path = config(f"rl-{asynchronous}.yaml", asynchronous=asynchronous, out=f"out-{asynchronous}")
    assert main(["rl", "--config", str(path)]) == 0  # stderr is not a terminal here: a log's lines
    out = path.parent / f"out-{asynchronous}"
    summary = strict((out / "summary.json").read_text())
    rows = [strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(rows) == 3
    lags = summary["staleness"]["lag_histogram"]
    assert summary["staleness"]["kept"] == 6 and summary["staleness"]["dropped"] == 0
    if asynchronous:
        assert set(map(int, lags)) <= {0, 1}  # one step ahead at most
    else:
        assert list(lags) == ["0"] and all(r["mismatch/bases"] == 6 * 24 for r in rows)
        assert all(r["mismatch/k3"] < 1e-6 for r in rows)  # fp32, same weights: round-off only
    for key in ("reward", "kl_start", "start_bits_per_base", "sample/hamming",
                "sample/distinct_kmers", "heldout/motif_hits", "mismatch/routing_differs"):
        assert all(key in r for r in rows), key
    load_checkpoint(out / "checkpoint")
    assert (out / "samples.fa").read_text().count(">") == 6
    client = MlflowClient(summary["config"]["tracking_uri"])
    run = client.search_runs([client.get_experiment_by_name("megabase-rl").experiment_id],
                             f"tags.`megabase.kind` = 'rl' and params.`rl.out` = '{out}'")[0]
    assert len(client.get_metric_history(run.info.run_id, "rl/reward")) == 3
    assert run.info.status == "FINISHED"
    captured = capsys.readouterr()
    assert "rl: 3 steps" in captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith("megabase: rl: ")]
    assert [line.split(" steps")[0] for line in lines[:3]] == [f"megabase: rl: {i}/3"
                                                                 for i in (1, 2, 3)]
    assert lines[-1].startswith("megabase: rl: 3 steps done in"), captured.err
    # the policy evaluated (evaluate leaves its readers' hold file there) is still rl's own
    from megabase.core.locks import hold_reading, release_reading
    from megabase.rl.run import check_checkpoint_folder

    release_reading(hold_reading(out / "checkpoint"))
    check_checkpoint_folder(out / "checkpoint")


@pytest.mark.parametrize("sets, message", [
    (["bogus=1"], "unknown key 'bogus'"),
    (["steps=many"], "steps must be an integer"),
    (["group_size=1"], "group_size must be at least 2"),
    (["generator_dtype=fp8"], "generator_dtype = 'fp8' is not one of fp32, bf16"),
    (["prompt.regions=[chr99]"], "chr99"),
    (["prompt.length=100000000"], "fewer than prompt.length"),
    (["reward.motifs=[MA9999.9]"], "MA9999.9"),
    (["reward.function=nowhere.py:f"], "file not found"),
    (["checkpoint=/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_bad_input_is_one_line(config, capsys, sets, message):
    path = config()
    args = ["rl", "--config", str(path), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_reward_code_that_fails_is_refused_before_any_process(config, capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def reward(seqs):\n    return [float('nan')] * len(seqs)\n")
    path = config("bad.yaml", **{"reward.function": str(bad) + ":reward"})
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    assert "one finite number per sequence" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused(config, capsys):
    path = config("file-out.yaml", out="taken")
    (path.parent / "taken").write_text("not ours")
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert (path.parent / "taken").read_text() == "not ours"
