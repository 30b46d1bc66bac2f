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
    assert loaded.cfg == model.cfg and not loaded.training
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
