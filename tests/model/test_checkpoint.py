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
    config["model"].update(dsa_backend="triton", kda_backend="fla", loss_chunk=1 << 20)
    (path / "config.json").write_text(json.dumps(config))
    old = load_checkpoint(path)
    assert (old.cfg.dsa_backend, old.cfg.kda_backend) == ("auto", "auto")
    torch.testing.assert_close(log_probs(old, x), log_probs(loaded, x), atol=0, rtol=0)
