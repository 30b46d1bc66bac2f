"""Faults around a run (issue 18): config values that cannot work, checkpoint lineage, damaged
checkpoint files. Each is one line on stderr, exit status 2, before any work, or a warned fallback."""

import pytest

from megabase.pipeline.cli import main
from megabase.pipeline.train import loss_curve


def tiny(workdir, store, steps=4, **more):
    sets = {"name": "tiny", "workdir": str(workdir), "data.store": str(store.path),
            "data.window_length": "2048", "model.preset": "debug", "train.steps": str(steps),
            "train.seq_warmup": "false", "train.checkpoint_every": "2", "train.warmup_steps": "1",
            "eval.enabled": "false", **more}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 400, err[:2000]
    return err


@pytest.mark.parametrize("assignment, needle", [
    ("train.lr=nan", "train.lr must be a finite number"),
    ("train.lr=-1", "train.lr must be within (0, 1)"),
    ("train.beta1=2", "train.beta1 must be within [0, 1)"),
    ("data.window_length=1000000000000", "data.window_length must be within 64-16,777,216"),
    ("data.window_length=3", "data.window_length must be within 64-16,777,216"),
    ("train.batch_size=1000000", "use train.grad_accum"),
    ("train.steps=1000000000000000000000000000000", "train.steps must be at most"),
    ("name=../../x", "must be a plain name"),
    ("name=/abs/path", "must be a plain name"),
    ("model.overrides.topk=[1, 2", "not valid YAML"),
])
def test_values_that_cannot_work_are_one_line_before_any_work(bundled_store, tmp_path, capsys,
                                                             assignment, needle):
    assert main(["train", *tiny(tmp_path, bundled_store), "--set", assignment]) == 2
    assert needle in one_line(capsys)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_yaml_alias_bomb_is_refused_unexpanded(tmp_path, capsys):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    assert main(["train", "--config", str(tmp_path / "bomb.yaml")]) == 2
    err = one_line(capsys)
    assert "bomb.yaml" in err and "YAML alias at line 2" in err


def _ckpt(run, step):
    return run / "checkpoints" / f"step-{step:06d}"


def test_checkpoint_lineage_is_refused_or_resumed_never_mixed(bundled_store, tmp_path, capsys):
    assert main(["train", *tiny(tmp_path, bundled_store), "--quiet"]) == 0
    run = tmp_path / "runs" / "tiny"
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip() == "step-000004" and _ckpt(run, 2).is_dir()
    capsys.readouterr()

    # a pointer to a folder that does not exist: a fresh start refuses, --resume falls back
    latest.write_text("step-000009\n")
    assert main(["train", *tiny(tmp_path, bundled_store, 6), "--quiet"]) == 2
    assert "names step-000009, which is missing" in one_line(capsys)
    assert _ckpt(run, 4).is_dir() and _ckpt(run, 2).is_dir()  # nothing pruned

    # a pointer that is a path out of the run: never followed
    latest.write_text("../../other/checkpoints/step-000008\n")
    assert main(["train", *tiny(tmp_path, bundled_store, 6), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "not a checkpoint of this run" in err and "resuming from" in err and "step-000004" in err
    assert latest.read_text().strip() == "step-000006" and len(loss_curve(run)) == 6

    # no pointer, yet checkpoints: refused without --resume
    latest.unlink()
    assert main(["train", *tiny(tmp_path, bundled_store, 8), "--quiet"]) == 2
    assert "is missing, yet the run holds checkpoints" in one_line(capsys)


def test_damaged_weights_are_caught_and_resume_falls_back(bundled_store, tmp_path, capsys):
    assert main(["train", *tiny(tmp_path, bundled_store), "--quiet"]) == 0
    run = tmp_path / "runs" / "tiny"
    weights = _ckpt(run, 4) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(_ckpt(run, 4)), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-2,048", "--no-probe", "--quiet"]) == 2
    err = one_line(capsys)
    assert "model.safetensors is damaged" in err and "step-000004" in err
    assert main(["train", *tiny(tmp_path, bundled_store, 6), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "damaged" in err and "resuming from the checkpoint before it, step-000002" in err


def test_temps_of_a_killed_checkpoint_write_are_removed_on_resume(bundled_store, tmp_path):
    import os
    import subprocess
    import sys

    assert main(["train", *tiny(tmp_path, bundled_store), "--quiet"]) == 0
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    dead_dir, dead_file = ckpts / f".step-000006.tmp-{gone}-a", ckpts / f".latest.tmp-{gone}-b"
    alive, mine = ckpts / f".step-000006.tmp-{os.getpid()}-c", ckpts / f"notes.tmp-{gone}-d"
    dead_dir.mkdir(), alive.mkdir(), mine.mkdir()
    (dead_dir / "model.safetensors").write_bytes(b"half")
    dead_file.write_text("step-0000")
    assert main(["train", *tiny(tmp_path, bundled_store, 6), "--resume", "--quiet"]) == 0
    assert not dead_dir.exists() and not dead_file.exists() and alive.is_dir() and mine.is_dir()
    assert (ckpts / "step-000006" / "config.json").is_file()


def test_a_truncated_trainer_state_is_one_line(bundled_store, tmp_path, capsys):
    assert main(["train", *tiny(tmp_path, bundled_store, 2), "--quiet"]) == 0
    state = _ckpt(tmp_path / "runs" / "tiny", 2) / "trainer.pt"
    state.write_bytes(state.read_bytes()[:500])
    capsys.readouterr()
    assert main(["train", *tiny(tmp_path, bundled_store, 4), "--resume", "--quiet"]) == 2
    err = one_line(capsys)
    assert "trainer.pt" in err and "weights_only" not in err


@pytest.mark.parametrize("flags, needle", [
    (["--edges", "a,b"], "--edges[0] must be an integer, got 'a'"),
    (["--edges", "100,10"], "--edges must be integers that start at 0 and increase strictly"),
    (["--controls", "-5"], "--controls must be positive context lengths, got -5"),
    (["--bootstrap", "-1"], "--bootstrap must be a positive integer, got -1"),
    (["--baselines", "[0, 99]"], "--baselines must be Markov orders 0..14, got 99"),
])
def test_evaluate_arguments_are_checked_before_scoring(bundled_store, tmp_path, capsys, flags,
                                                       needle, monkeypatch):
    monkeypatch.setattr("megabase.model.read_checkpoint_config",
                        lambda *a: pytest.fail("read the checkpoint before checking arguments"))
    assert main(["evaluate", "--checkpoint", str(tmp_path / "none"), "--data",
                 str(bundled_store.path), *flags, "--quiet"]) == 2
    assert needle in one_line(capsys)


def test_evaluate_out_on_a_file_and_compare_csv_on_a_folder(bundled_store, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["evaluate", "--checkpoint", str(tmp_path / "none"), "--data",
                 str(bundled_store.path), "--out", str(tmp_path / "file"), "--quiet"]) == 2
    assert "exists and is not a directory" in one_line(capsys)
    assert main(["compare", str(tmp_path / "missing.json"), "--csv", str(tmp_path)]) == 2
    assert "--csv takes a file name" in one_line(capsys)


def test_trained_with_one_backend_evaluated_with_another(bundled_store, tmp_path, capsys):
    import json

    sets = tiny(tmp_path, bundled_store, **{"model.overrides": "{dsa_backend: reference, kda_backend: torch}"})
    assert main(["train", *sets, "--quiet"]) == 0
    ckpt = _ckpt(tmp_path / "runs" / "tiny", 4)
    assert "dsa_backend" not in json.loads((ckpt / "config.json").read_text())["model"]
    out = tmp_path / "eval"
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-4,096", "--no-probe", "--controls", "", "--baselines", "",
                 "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["overall"]["bits_per_base"] > 0


def test_library_errors_name_arguments_and_the_cli_names_its_flags_or_keys(bundled_store, tmp_path,
                                                                           capsys):
    from megabase.data import InputError, make_windows

    with pytest.raises(InputError) as caught:
        make_windows(bundled_store, {"eval": ["chr22"]}, 1 << 20, on_short="refuse")
    assert "use a shorter length, or keep short regions (on_short)" in str(caught.value)
    assert main(["windows", str(bundled_store.path), "--length", "1048576", "--split",
                 "eval=chr22", "--short", "refuse"]) == 2
    assert "use a shorter --length, or keep short regions (--short keep)" in one_line(capsys)
    (tmp_path / "file").write_text("x")
    assert main(["prepare", "--out", str(tmp_path / "file")]) == 2
    assert "choose another --out" in one_line(capsys)
    assert main(["train", *tiny(tmp_path, bundled_store), "--set",
                 f"data.store={tmp_path / 'file'}"]) == 2
    assert "no token store here" in one_line(capsys)
    assert main(["run", *tiny(tmp_path, bundled_store), "--set", f"data.store={tmp_path / 'file'}"]) == 2
    assert "is not a directory; choose another data.store" in one_line(capsys)


def test_run_refuses_baselines_fitted_on_the_scored_bases_before_training(bundled_store, tmp_path,
                                                                          capsys):
    sets = tiny(tmp_path, bundled_store)
    sets[sets.index("eval.enabled=false")] = "eval.enabled=true"
    assert main(["run", *sets, "--set", "eval.train=chr01,chr22:1-1000"]) == 2
    assert "eval.train region chr22:1-1,000 shares bases with the scored chr22" in one_line(capsys)
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()
