"""Training: resume after SIGKILL, faults, MLflow tracking, and `megabase run` end to end."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megabase.pipeline.cli import main
from megabase.pipeline.train import loss_curve, read_train_log


def tiny(workdir, store, steps=8, name="tiny", **more):
    sets = {"name": name, "workdir": str(workdir), "data.store": str(store.path),
            "data.window_length": "2048", "model.preset": "debug", "train.steps": str(steps),
            "train.seq_warmup": "false", "train.checkpoint_every": "2", "train.warmup_steps": "2",
            "eval.enabled": "false", **more}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def test_resume_after_sigkill_gives_the_same_losses(bundled_store, tmp_path):
    steps = 40
    assert main(["train", *tiny(tmp_path / "a", bundled_store, steps), "--quiet"]) == 0
    whole = loss_curve(tmp_path / "a" / "runs" / "tiny")
    assert len(whole) == steps

    cmd = [sys.executable, "-m", "megabase.pipeline.cli", "train",
           *tiny(tmp_path / "b", bundled_store, steps), "--quiet"]
    run = tmp_path / "b" / "runs" / "tiny"
    killed_at = _kill_once_past(cmd, run, "step-000004")
    assert killed_at < steps  # really interrupted mid-run

    assert main(["train", *tiny(tmp_path / "b", bundled_store, steps), "--resume", "--quiet"]) == 0
    resumed = loss_curve(run)
    np.testing.assert_allclose(resumed, whole, rtol=1e-6, atol=0)


def test_init_from_fine_tunes_a_checkpoint_and_refuses_a_changed_model(bundled_store, tmp_path,
                                                                       capsys):
    from safetensors.torch import load_file

    from megabase.model import read_checkpoint_config

    assert main(["train", *tiny(tmp_path, bundled_store, 4, name="base"), "--quiet"]) == 0
    base = tmp_path / "runs" / "base"
    stage = {"model.overrides.dsa_stage.start": "0", "model.overrides.dsa_stage.block": "16",
             "model.overrides.dsa_stage.blocks": "4", "model.overrides.dsa_stage.local": "64"}
    args = tiny(tmp_path, bundled_store, 2, name="long", **{"train.init_from": str(base),
                                                           "data.window_length": "4096", **stage})
    assert main(["train", *args, "--quiet"]) == 0
    tuned = tmp_path / "runs" / "long" / "checkpoints" / "step-000002"
    config = read_checkpoint_config(tuned)
    assert config["init_from"] == str((base / "checkpoints" / "step-000004").resolve())
    assert config["model"]["dsa_stage"]["start"] == 0 and config["model"]["d_model"] == 32
    first = read_train_log(tmp_path / "runs" / "long")[1]["loss"]
    assert first < read_train_log(base)[1]["loss"]  # it started from the trained weights
    assert load_file(str(tuned / "model.safetensors")).keys() == \
        load_file(str(base / "checkpoints" / "step-000004" / "model.safetensors")).keys()
    capsys.readouterr()
    bad = tiny(tmp_path, bundled_store, 2, name="bad", **{"train.init_from": str(base),
                                                         "model.overrides.d_model": "64"})
    assert main(["train", *bad, "--quiet"]) == 2
    assert "model.overrides.d_model would change the model" in capsys.readouterr().err
    missing = tiny(tmp_path, bundled_store, 2, name="bad", **{"train.init_from": "/nonexistent"})
    assert main(["train", *missing, "--quiet"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err and not (tmp_path / "runs" / "bad").exists()
    assert main(["run", *missing, "--quiet"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err and not (tmp_path / "runs" / "bad").exists()


def test_fresh_train_refuses_to_overwrite_a_run(bundled_store, tmp_path, capsys):
    assert main(["train", *tiny(tmp_path, bundled_store, 2), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", *tiny(tmp_path, bundled_store, 2), "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(bundled_store, tmp_path,
                                                                    monkeypatch, capsys):
    import torch

    from megabase.model.lm import HybridLM

    real, calls = HybridLM.forward, []

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 5:
            out.loss = out.loss * torch.tensor(float("nan"))
        return out

    monkeypatch.setattr(HybridLM, "forward", poisoned)
    # the memory check's probe steps would be counted as the first calls
    monkeypatch.setattr("megabase.pipeline.train.check_fits", lambda cfg: None)
    assert main(["train", *tiny(tmp_path, bundled_store, 8), "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "at step 5" in err and len(err.strip().splitlines()) == 1
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000004"
    assert sorted(read_train_log(tmp_path / "runs" / "tiny")) == [1, 2, 3, 4]


def test_failed_checkpoint_write_keeps_the_previous(bundled_store, tmp_path, monkeypatch, capsys):
    import errno

    import safetensors.torch

    from megabase.model import load_checkpoint

    real, calls = safetensors.torch.save_file, []

    def disk_full(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            with open(filename, "wb") as fh:  # half a file, then the disk is full
                fh.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    assert main(["train", *tiny(tmp_path, bundled_store, 8), "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err and "step-000002" in err
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002"]  # no debris
    load_checkpoint(ckpts / "step-000002")


def test_missing_store_is_one_clear_error(tmp_path, capsys):
    code = main(["train", "--set", f"workdir={tmp_path}", "--set", "data.store=nowhere", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "nowhere" in err and "megabase prepare" in err


def test_run_end_to_end_then_every_stage_skips(bundled_store, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    args = [*tiny(tmp_path, bundled_store, 4), "--set", "eval.enabled=true",
            "--set", "eval.regions=chr22:1-4,096", "--set", "eval.bootstrap=10",
            "--set", "eval.probe=false", "--set", "eval.baselines=0", "--quiet"]
    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert "held-out:" in out and "mlflow ui --backend-store-uri" in out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("megabase").experiment_id])
    for key in ("loss", "bits_per_base", "lr", "tokens_per_s", "peak_mem_gib",
                "moe_load_max_over_mean", "moe_load_max_over_mean/layer_0", "moe_bias_norm",
                "indexer_kl/layer_0", "eval/bits_per_base"):
        assert key in run.data.metrics, key
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 4
    assert run.data.params["train.steps"] == "4"
    assert {"config.yaml", "manifest.json", "checkpoint.json", "eval"} <= {a.path for a in
                                                        client.list_artifacts(run.info.run_id)}
    assert run.data.tags["megabase.checkpoint"].endswith("step-000004")

    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 4


def test_sequence_length_warmup_doubles():
    from megabase.pipeline.config import load_config
    from megabase.pipeline.warmup import window_length_at

    cfg = load_config(None, ["train.seq_warmup_start=4096", "train.seq_warmup_steps=8",
                             "data.window_length=16384"])
    assert [window_length_at(s, cfg) for s in (0, 7, 8, 16, 100)] == [4096, 4096, 8192, 16384,
                                                                       16384]


@pytest.mark.parametrize("knob", ["train.recompute=layer", "train.offload=true"])
def test_memory_knobs_train_the_same(bundled_store, tmp_path, knob):
    assert main(["train", *tiny(tmp_path / "a", bundled_store, 3), "--quiet"]) == 0
    assert main(["train", *tiny(tmp_path / "b", bundled_store, 3), "--set", knob, "--quiet"]) == 0
    np.testing.assert_allclose(loss_curve(tmp_path / "b" / "runs" / "tiny"),
                               loss_curve(tmp_path / "a" / "runs" / "tiny"), rtol=1e-5)


def test_a_window_past_train_segment_is_walked_and_trains_as_the_whole_window(bundled_store,
                                                                              tmp_path):
    """8 steps over 4,096-base windows walked in segments of 1,024 (train.segment; past
    train.segment_from=0) against the
    whole-window backward (train.segment=null). Step by step the two are equal from the same
    weights (tests/model/test_walk.py); two runs agree to 1e-6 only until fp32 round-off,
    amplified by the optimizer, drifts them apart as it drifts any reordered sum (the loss_chunk
    knob's too): ~1e-3 of the loss within 12 steps."""
    sets = {"data.window_length": "4096", "train.warmup_steps": "4", "train.segment_from": "0"}
    assert main(["train", *tiny(tmp_path / "a", bundled_store, 8, **sets,
                                **{"train.segment": "null"}), "--quiet"]) == 0
    assert main(["train", *tiny(tmp_path / "b", bundled_store, 8, **sets,
                                **{"train.segment": "1024"}), "--quiet"]) == 0
    whole, walked = (read_train_log(tmp_path / run / "runs" / "tiny") for run in "ab")
    assert {row["segments"] for row in whole.values()} == {1}
    assert {row["segments"] for row in walked.values()} == {4}
    a, b = ([rows[s]["loss"] for s in sorted(rows)] for rows in (walked, whole))
    np.testing.assert_allclose(a[:4], b[:4], rtol=1e-6, atol=0)
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=0)
    # what cannot be walked runs whole: the dense indexer's attention over whole rows
    assert main(["train", *tiny(tmp_path / "c", bundled_store, 2, **sets,
                                **{"train.segment": "1024", "model.overrides.indexer_mode": "dense"}),
                 "--quiet"]) == 0
    assert {row["segments"] for row in read_train_log(tmp_path / "c" / "runs" / "tiny").values()} == {1}
    # and a window no longer than train.segment_from runs whole
    assert main(["train", *tiny(tmp_path / "d", bundled_store, 1, **{**sets, "train.segment": "1024",
                                                                   "train.segment_from": "4096"}),
                 "--quiet"]) == 0
    assert {row["segments"] for row in read_train_log(tmp_path / "d" / "runs" / "tiny").values()} == {1}


def test_a_walked_step_shows_its_segments_move(bundled_store, tmp_path, capsys, monkeypatch):
    """In a log (stderr not a terminal) a walked step prints lines as its segments pass, forward
    then backward, and one closing line when its backward is done."""
    monkeypatch.setenv("MEGABASE_PROGRESS_EVERY_S", "0")
    sets = {"data.window_length": "4096", "train.segment": "1024", "train.segment_from": "0"}
    assert main(["train", *tiny(tmp_path, bundled_store, 1, **sets)]) == 0
    err = capsys.readouterr().err
    passes = re.findall(r"step 1 \(4,096 tokens, forward \+ backward\): (\d)/8 segments", err)
    assert [int(n) for n in passes] == list(range(1, 9))
    assert "step 1 (4,096 tokens, forward + backward): 8 segments done in" in err


def _kill_once_past(cmd: list[str], run, step: str) -> int:
    """Start ``cmd``, SIGKILL it once ``run`` has a checkpoint at ``step`` or later; the number of
    log rows it had written."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = run / "checkpoints" / "latest"
    while proc.poll() is None and not (latest.is_file() and latest.read_text().strip() >= step):
        time.sleep(0.02)
    rows = len(read_train_log(run))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    return rows


def test_a_walked_run_resumes_bit_for_bit(bundled_store, tmp_path):
    """A run walked in segments, killed and resumed, logs the uninterrupted run's losses exactly."""
    steps = 12
    sets = {"data.window_length": "4096", "train.segment": "1024", "train.segment_from": "0"}
    assert main(["train", *tiny(tmp_path / "a", bundled_store, steps, **sets), "--quiet"]) == 0
    whole = loss_curve(tmp_path / "a" / "runs" / "tiny")
    args = tiny(tmp_path / "b", bundled_store, steps, **sets)
    run = tmp_path / "b" / "runs" / "tiny"
    killed_at = _kill_once_past([sys.executable, "-m", "megabase.pipeline.cli", "train", *args,
                                 "--quiet"], run, "step-000004")
    assert killed_at < steps
    assert main(["train", *args, "--resume", "--quiet"]) == 0
    assert {row["segments"] for row in read_train_log(run).values()} == {4}
    np.testing.assert_array_equal(loss_curve(run), whole)


def test_max_minutes_stops_early_with_a_checkpoint_and_says_so(bundled_store, tmp_path, capsys):
    # 0.0001 minutes: Lightning's timer ends the run after its first step
    assert main(["train", *tiny(tmp_path, bundled_store, 50), "--set", "train.max_minutes=0.0001"]) == 0
    run = tmp_path / "runs" / "tiny"
    steps = len(read_train_log(run))
    assert 1 <= steps < 50
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{steps:06d}"
    assert f"{steps} of 50: train.max_minutes reached" in capsys.readouterr().out
    assert main(["train", *tiny(tmp_path, bundled_store, 50), "--set", "train.max_minutes=0",
                 "--resume"]) == 2
    assert "train.max_minutes must be a positive number of minutes, got 0" in capsys.readouterr().err


def test_bf16_and_gradient_accumulation_train(bundled_store, tmp_path):
    assert main(["train", *tiny(tmp_path, bundled_store, 3), "--set", "train.precision=bf16",
                 "--set", "train.grad_accum=2", "--quiet"]) == 0
    rows = read_train_log(tmp_path / "runs" / "tiny")
    assert sorted(rows) == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows.values())


def test_resume_with_another_batch_shape_is_refused(bundled_store, tmp_path, capsys):
    assert main(["train", *tiny(tmp_path, bundled_store, 4), "--set", "train.steps=2",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", *tiny(tmp_path, bundled_store, 4), "--set", "train.grad_accum=2",
                 "--resume", "--quiet"]) == 2
    assert "train.grad_accum: 1 -> 2" in capsys.readouterr().err  # the resume check names it


def test_curriculum_indexer_warmup_and_routing_health_in_the_log(bundled_store, tmp_path, capsys,
                                                                 monkeypatch):
    from megabase.model.dsa import DSALayer

    dense_calls = []
    original = DSALayer.attend_dense
    monkeypatch.setattr(DSALayer, "attend_dense",
                        lambda self, *a: dense_calls.append(1) or original(self, *a))
    args = tiny(tmp_path / "c", bundled_store, 4, **{
        "data.repeat_frac": "0.3", "data.repeat_frac_first": "null",
        "train.indexer_warmup_steps": "2",
        "model.overrides.n_experts": "16", "model.overrides.bias_update": "sign",
        "model.overrides.bias_update_rate": "0"})
    assert main(["train", *args, "--quiet"]) == 0
    assert len(dense_calls) == 2  # one DSA layer, dense for the first two steps only
    rows = read_train_log(tmp_path / "c" / "runs" / "tiny")
    assert all(len(r["moe_load_per_layer"]) == 4 and len(r["moe_idle_experts"]) == 4
               for r in rows.values())
    out = capsys.readouterr().out
    # without balancing, 16 experts over 2,048 tokens route unevenly: a layer past max/mean 3 or
    # with idle experts is named once during training (and again in the summary)
    warned = re.findall(r"warning: MoE layer \d+ at step \d+: max/mean expert load ([\d.]+)(, \d+ "
                        r"expert\(s\) idle)?", out)
    assert warned and all(float(ratio) > 3 or idle for ratio, idle in warned)
    planted = loss_curve(tmp_path / "c" / "runs" / "tiny")
    args = tiny(tmp_path / "d", bundled_store, 4, **{
        "data.repeat_frac": "0", "data.repeat_frac_first": "null",
        "train.indexer_warmup_steps": "2", "model.overrides.n_experts": "16",
        "model.overrides.bias_update": "sign", "model.overrides.bias_update_rate": "0"})
    assert main(["train", *args, "--quiet"]) == 0
    plain = loss_curve(tmp_path / "d" / "runs" / "tiny")
    assert not np.allclose(planted, plain)  # the copies change what is trained on


@pytest.mark.parametrize("sig, quiet", [(signal.SIGTERM, True), (signal.SIGINT, True),
                                        (signal.SIGTERM, False)])  # progress lines into a log
def test_train_interrupted_mid_step_says_so_and_exits_130(bundled_store, tmp_path, sig, quiet):
    cmd = [sys.executable, "-m", "megabase.pipeline.cli", "train",
           *tiny(tmp_path, bundled_store, 400), *(["--quiet"] if quiet else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = tmp_path / "runs" / "tiny" / "train_log.jsonl"
    while proc.poll() is None and not (log.is_file() and log.read_text().count("\n") >= 2):
        time.sleep(0.02)
    os.kill(proc.pid, sig)  # inside trainer.fit: Lightning's own handler sees it first
    _, err = proc.communicate()
    err = err.decode()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == \
        "megabase train: interrupted; nothing half-written was kept", err[-2000:]
    assert "Traceback" not in err


def test_training_progress_reaches_a_log_file_as_lines(bundled_store, tmp_path):
    log = tmp_path / "job.err"
    with open(log, "w") as err:  # a cluster job's stderr: a file, not a terminal
        subprocess.run([sys.executable, "-m", "megabase.pipeline.cli", "train",
                        *tiny(tmp_path, bundled_store, 4)], stdout=subprocess.DEVNULL, stderr=err,
                       env={**os.environ, "MEGABASE_PROGRESS_EVERY_S": "0"}, check=True)
    lines = log.read_text().splitlines()
    steps = [line for line in lines if line.startswith("megabase: train: ")]
    assert len(steps) == 5, lines  # one a step, then the closing line
    assert re.match(r"megabase: train: 2/4 steps \(50%\), .* tokens/s, ETA .*, loss \d\.\d{4} "
                    r"bits/base at step 2 \(2,048 tokens\)$", steps[1]), steps
    assert steps[-1].startswith("megabase: train: 4 steps done in ")
    assert "\r" not in log.read_text()  # no bar redrawn into the file


def test_a_walked_steps_eta_counts_the_backward_passes_as_dearer():
    """A step of 512 segments, a quarter of its forward passes done in 2 minutes: the mean rate
    of passes would say 14 more minutes; the forwards left and the backwards at 3x say 30."""
    from megabase.pipeline.lit import BACKWARD_PER_FORWARD, walk_eta

    assert BACKWARD_PER_FORWARD == 3.0
    assert walk_eta(128, 512, 120.0) == pytest.approx(1800.0)
    assert walk_eta(768, 512, 512 + 256 * 3.0) == pytest.approx(768.0)  # mid-backward
    assert walk_eta(1024, 512, 2048.0) == 0.0
