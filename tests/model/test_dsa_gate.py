"""The DSA output gate (``dsa_gate``): open at the start, a checkpoint without it loads with it,
and with gates that are not open the walked step, streaming and the layer's arithmetic hold."""

import pytest
import torch

from megabase.core.errors import InputError
from megabase.model import load_checkpoint, log_probs, save_checkpoint
from megabase.model.context import Context
from megabase.model.dsa import DSALayer
from megabase.model.walk import walked_forward
from tests.kernels.tolerances import rel_rms
from tests.model.conftest import live_model


def _gated(model, seed=1):
    """Draw every gate's weights, so that the gates are neither open nor alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in _dsa_layers(model):
            w = layer.mixer.gate_proj.weight
            w.copy_(torch.randn(w.shape, generator=g) * 2 / w.shape[1] ** 0.5)
    return model


def _dsa_layers(model):
    return [b for b in model.blocks if isinstance(b.mixer, DSALayer)]


def test_an_open_gate_changes_nothing_and_every_other_weight_is_drawn_alike(real_tokens):
    x = real_tokens[:, :1_500]
    plain, gated = live_model("debug"), live_model("debug", dsa_gate=True)
    layers = _dsa_layers(gated)
    assert layers and all(float(b.mixer.gate_proj.weight.detach().abs().max()) == 0 for b in layers)
    theirs = dict(plain.named_parameters())
    for name, p in gated.named_parameters():
        assert ("gate_proj" in name) != (name in theirs)
        if name in theirs:
            assert torch.equal(p, theirs[name]), name
    assert torch.equal(log_probs(plain.eval(), x), log_probs(gated.eval(), x))


def test_a_gate_scales_each_heads_output(real_tokens):
    model = _gated(live_model("debug", dsa_gate=True)).eval()
    layer = _dsa_layers(model)[0].mixer
    x = torch.randn(1, 300, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    ids = real_tokens[:, :300]
    ctx = Context(tokens=ids)
    with torch.no_grad():
        y, _, _ = layer(x, ctx)
        gate_proj, layer.gate_proj = layer.gate_proj, None
        q, k, v, qi, ki, wi = layer.project(x, ids)
        o, _ = layer.attend(q, k, v, qi, ki, wi)
        layer.gate_proj = gate_proj
        g = 2 * torch.sigmoid(x @ gate_proj.weight.T)
        expected = (o * g[..., None]).reshape(1, 300, -1) @ layer.o_proj.weight.T
    assert g.min() < 0.5 and g.max() > 1.5  # the drawn gates close some heads and open others
    assert rel_rms(y, expected) <= 1e-6


@pytest.mark.parametrize("length,segment", [(2500, 1024), (2001, 700)])
def test_walked_gradients_with_gates_equal_the_full_backward(real_tokens, length, segment):
    x = real_tokens[:, : length + 1]
    grads = []
    for seg in (None, segment):
        model = _gated(live_model("debug", dsa_gate=True))
        ids, targets = x[:, :-1], x[:, 1:]
        mask = targets < 4
        out = (model(ids, targets, loss_mask=mask) if seg is None else
               walked_forward(model, ids, targets, loss_mask=mask, segment=seg))
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    full, walked = grads
    assert any("gate_proj" in n for n in full) and full.keys() == walked.keys()
    for name in full:
        assert rel_rms(walked[name], full[name]) <= 1e-5, name
    assert all(float(g.abs().max()) > 0 for n, g in full.items() if "gate_proj" in n)


def test_streaming_with_gates_equals_the_full_pass(real_tokens):
    model = _gated(live_model("debug", dsa_gate=True)).eval()
    x = real_tokens[:, :6_001]
    full = log_probs(model, x)
    streamed = log_probs(model, x, segment=[1, 2_999, 7, 1_993, 1_000])
    assert float((full - streamed).abs().max()) <= 1e-4


def test_a_checkpoint_without_gates_loads_with_them_open_and_a_gated_one_keeps_them(
        tmp_path, real_tokens):
    x = real_tokens[:, :1_200]
    plain = live_model("debug").eval()
    path = save_checkpoint(plain, tmp_path / "plain")
    opened = load_checkpoint(path, dsa_gate=True)
    assert opened.cfg.dsa_gate and torch.equal(log_probs(opened, x), log_probs(plain, x))
    gated = _gated(live_model("debug", dsa_gate=True)).eval()
    path = save_checkpoint(gated, tmp_path / "gated")
    assert torch.equal(log_probs(load_checkpoint(path), x), log_probs(gated, x))
    with pytest.raises(InputError, match="trained with dsa_gate; it cannot be switched off"):
        load_checkpoint(path, dsa_gate=False)


def test_init_from_may_switch_the_gate_on_but_not_change_the_model(tmp_path):
    import yaml

    from megabase.pipeline.config import load_config

    base = {"name": "x", "data": {"fasta": "g.fa"}, "train": {"init_from": "somewhere"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**base, "model": {"overrides": {"dsa_gate": True}}}))
    assert load_config(path).model.overrides == {"dsa_gate": True}
    path.write_text(yaml.safe_dump({**base, "model": {"overrides": {"topk": 8}}}))
    with pytest.raises(InputError, match="topk would change the model"):
        load_config(path)
