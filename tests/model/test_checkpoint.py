import json

import pytest
import torch

from megabase.data import InputError
from megabase.model import build_model, load_checkpoint, log_probs, save_checkpoint


def test_round_trip_keeps_weights_buffers_and_outputs(tmp_path, real_tokens):
    torch.manual_seed(0)
    model = build_model("debug", topk=16)
    model.moe_layers()[0].bias += 0.25  # a buffer, not a parameter
    path = save_checkpoint(model, tmp_path / "ckpt", extra={"step": 7})
    assert json.loads((path / "config.json").read_text())["step"] == 7
    loaded = load_checkpoint(path)
    assert loaded.cfg.model_dict() == model.cfg.model_dict() and not loaded.training
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b)
    x = real_tokens[:, :300]
    assert torch.equal(log_probs(model.eval(), x), log_probs(loaded, x))
    save_checkpoint(model, path)  # overwriting is atomic and leaves no temporaries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(InputError, match="not a checkpoint"):
        load_checkpoint(tmp_path)
    path = save_checkpoint(build_model("debug"), tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    del config["config_sha256"]  # as written before configs were checksummed: no check to fail
    config["model"]["n_layerz"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="unknown model config key 'n_layerz'"):
        load_checkpoint(path)


def test_a_checkpoint_holds_the_model_and_the_loader_picks_the_kernels(tmp_path, real_tokens):
    from megabase.model.config import RUNTIME_FIELDS

    torch.manual_seed(0)
    trained = build_model("debug", kda_backend="torch", dsa_backend="reference", dsa_block=64,
                          moe_chunk=2048)
    path = save_checkpoint(trained, tmp_path / "c")
    saved = json.loads((path / "config.json").read_text())["model"]
    assert not set(RUNTIME_FIELDS) & set(saved)
    loaded = load_checkpoint(path)  # this machine's choice: auto (the C kernels on a CPU)
    assert (loaded.cfg.kda_backend, loaded.cfg.dsa_backend, loaded.cfg.dsa_block) == ("auto", "auto", 256)
    x = real_tokens[:, :2_000]
    torch.testing.assert_close(log_probs(loaded, x), log_probs(trained.eval(), x), atol=1e-4, rtol=0)
    assert load_checkpoint(path, dsa_backend="reference").cfg.dsa_backend == "reference"
    with pytest.raises(ValueError, match="not a runtime choice"):
        load_checkpoint(path, n_layers=2)
    # a checkpoint written before runtime choices were left out, trained on a GPU: loads on a CPU
    config = json.loads((path / "config.json").read_text())
    del config["config_sha256"]  # that checkpoint predates config checksums too
    config["model"].update(dsa_backend="triton", kda_backend="fla", loss_chunk=1 << 20)
    (path / "config.json").write_text(json.dumps(config))
    old = load_checkpoint(path)
    assert (old.cfg.dsa_backend, old.cfg.kda_backend) == ("auto", "auto")
    torch.testing.assert_close(log_probs(old, x), log_probs(loaded, x), atol=0, rtol=0)


def test_the_checkpoints_dsa_stage_loads_as_saved_or_with_the_fields_chosen(tmp_path, real_tokens):
    from megabase.kernels.dsa import Stage

    torch.manual_seed(0)
    trained = build_model("debug", dsa_stage={"start": 0, "block": 16, "blocks": 4, "local": 64})
    path = save_checkpoint(trained, tmp_path / "c")
    assert load_checkpoint(path).cfg.dsa_stage == trained.cfg.dsa_stage
    # a loader changes only the fields it names
    assert load_checkpoint(path, dsa_stage={"start": 4096}).cfg.dsa_stage == \
        Stage(start=4096, block=16, blocks=4, local=64)
    assert load_checkpoint(path, dsa_stage="exact").cfg.stage() is None
    # written before the stage was one sub-config: its flat fields read as the same stage
    config = json.loads((path / "config.json").read_text())
    del config["config_sha256"]
    stage = config["model"].pop("dsa_stage")
    config["model"].update(dsa_stage=stage.pop("summary"),
                           **{f"dsa_stage_{'from' if k == 'start' else k}": v for k, v in stage.items()})
    (path / "config.json").write_text(json.dumps(config))
    old = load_checkpoint(path)
    assert old.cfg.dsa_stage == trained.cfg.dsa_stage
    x = real_tokens[:, :700]
    torch.testing.assert_close(log_probs(old, x), log_probs(trained.eval(), x), atol=0, rtol=0)


def _edit_config(path, **model_fields):
    """Change model fields in a checkpoint's config.json by hand, its recorded checksum kept."""
    config = json.loads((path / "config.json").read_text())
    config["model"].update(model_fields)
    (path / "config.json").write_text(json.dumps(config, indent=1))


def test_an_edited_config_is_refused_and_an_old_or_reformatted_one_loads(tmp_path, real_tokens):
    from megabase.model.checkpoint import read_checkpoint_config

    torch.manual_seed(0)
    model = build_model("debug")
    path = save_checkpoint(model, tmp_path / "c", extra={"step": 3})
    config = json.loads((path / "config.json").read_text())
    assert len(config["config_sha256"]) == 64
    # the same content written another way (indent, key order) is the same config
    (path / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=4))
    assert read_checkpoint_config(path)["step"] == 3
    # experts_per_token 2 -> 3: a model the weights were never trained as (surprisal moved by up
    # to 0.71 bits when this loaded)
    _edit_config(path, experts_per_token=3)
    with pytest.raises(InputError) as refused:
        load_checkpoint(path)
    assert str(refused.value).startswith(f"{path / 'config.json'}: was changed after the")
    # a checkpoint from before config checksums: loads, unchecked (its weights are checked)
    config = json.loads((path / "config.json").read_text())
    del config["config_sha256"]
    config["model"]["experts_per_token"] = 2
    (path / "config.json").write_text(json.dumps(config))
    x = real_tokens[:, :500]
    assert torch.equal(log_probs(load_checkpoint(path), x), log_probs(model.eval(), x))


@pytest.mark.parametrize("command", ["score", "embed", "generate", "variants", "evaluate",
                                     "export-model", "resume"])
def test_every_loader_refuses_an_edited_config_in_one_line(checkpoint, bundled_store, tmp_path,
                                                           capsys, command):
    """score, embed, generate, variants, evaluate and export-model through the CLI; train's
    --resume through the trainer state's check. rl loads with score's loader
    (infer.common.load_model) and train's init_from with load_checkpoint, both refused above."""
    import shutil

    from megabase.pipeline.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    _edit_config(ckpt, experts_per_token=3)
    before = sorted(p.name for p in tmp_path.iterdir())
    data, out = ["--data", str(bundled_store.path)], str(tmp_path / "out")
    if command == "resume":
        from megabase.pipeline.checkpointing import trainer_state

        with pytest.raises(InputError, match="config.json: was changed after the checkpoint"):
            trainer_state(ckpt)
        return
    args = {"score": [*data, "--regions", "chr22:1-1,000", "--out", out],
            "embed": [*data, "--regions", "chr22:1-1,000", "--out", out],
            "generate": [*data, "--prompt-region", "chr22:1-100", "--length", "10", "--out",
                         out + ".fa"],
            "variants": [*data, "--vcf", str(tmp_path / "v.vcf"), "--out", out],
            "evaluate": [*data, "--regions", "chr22:1-6,000", "--length", "2048", "--no-mlflow",
                         "--out", out],
            "export-model": ["--out", out]}[command]
    if command == "variants":
        (tmp_path / "v.vcf").write_text("##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\t"
                                        "FILTER\tINFO\nchr22\t500\t.\tC\tG\t.\t.\t.\n")
        before = sorted(p.name for p in tmp_path.iterdir())
    assert main([command, "--checkpoint", str(ckpt), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"megabase {command}: error: {ckpt / 'config.json'}: was changed after the "
                   "checkpoint was written (its sha256 differs from the one recorded in it, "
                   "config_sha256); the model it describes is not the one trained: restore the "
                   "file as written"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_full_disk_while_writing_a_checkpoint_is_an_os_error_naming_the_file(tmp_path):
    """safetensors' own error on a full disk (here a file-size limit, which Python turns into
    EFBIG) becomes the OSError naming the checkpoint's file, not its temporary; nothing is left."""
    import subprocess
    import sys

    code = """
import errno, json, resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
from megabase.model import build_model, save_checkpoint
try:
    save_checkpoint(build_model("debug"), sys.argv[1])
except OSError as exc:
    print(json.dumps([exc.errno, exc.filename]))
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    import errno

    assert json.loads(done.stdout) == [errno.EFBIG, str(tmp_path / "ckpt" / "model.safetensors")]
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_training_writes_a_checkpoint_is_one_line(bundled_store, tmp_path):
    """`megabase train` whose checkpoint does not fit (weights of ~1.6 MB past a 1.5 MB file-size
    limit that the run's other files stay under): one line naming the checkpoint, no traceback,
    no half-written checkpoint folder."""
    import resource
    import subprocess
    import sys

    sets = {"name": "tiny", "workdir": str(tmp_path), "data.store": str(bundled_store.path),
            "data.window_length": "2048", "model.preset": "debug",
            "model.overrides.expert_dim": "512", "train.steps": "2", "train.seq_warmup": "false",
            "train.checkpoint_every": "2", "train.warmup_steps": "1", "eval.enabled": "false"}
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, 1_500_000))  # noqa: E731
    proc = subprocess.run([sys.executable, "-m", "megabase.pipeline.cli", "train", "--quiet",
                           *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]],
                          capture_output=True, text=True, preexec_fn=limit)
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    err = proc.stderr.strip()
    assert proc.returncode == 3 and len(err.splitlines()) == 1, err[-3000:]
    assert err == (f"megabase train: error: could not write checkpoint {ckpts / 'step-000002'}: "
                   "File too large; no earlier checkpoint")
    assert not ckpts.exists() or list(ckpts.iterdir()) == []


def test_the_weights_are_readable_as_the_umask_says(tmp_path):
    import os

    before = os.umask(0o022)
    try:
        path = save_checkpoint(build_model("debug"), tmp_path / "ckpt")
    finally:
        os.umask(before)
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes
