"""Every memory knob changes memory, never the loss or the gradients beyond fp32 round-off."""

import pytest
import torch

from megabase.model import build_model
from megabase.pipeline.memory import (Offloaded, Recomputed, apply_heap_trim, apply_offload,
                                      apply_recompute)
from tests.kernels.tolerances import assert_close, rel_rms
from tests.model.conftest import live_model


def loss_and_grads(real_tokens, knobs=None, **overrides):
    model = live_model("debug", **overrides)  # a gradient reaches every layer
    for apply in knobs or []:
        apply(model)
    x = real_tokens[:, :2_501]
    out = model(x[:, :-1], x[:, 1:])
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def baseline(real_tokens):
    return loss_and_grads(real_tokens)


@pytest.mark.parametrize("name,knobs,overrides", [
    ("recompute=layer", [lambda m: apply_recompute(m, "layer")], {}),
    ("recompute=selective", [lambda m: apply_recompute(m, "selective")], {}),
    ("offload", [apply_offload], {}),
    ("recompute+offload", [lambda m: apply_recompute(m, "layer"), apply_offload], {}),
    ("trim_heap", [apply_heap_trim], {}),
    ("moe_chunk", [], {"moe_chunk": 1024}),
    ("loss_chunk", [], {"loss_chunk": 1024}),
    ("dsa_block", [], {"dsa_block": 32}),
])
def test_knob_keeps_loss_and_gradients(real_tokens, baseline, name, knobs, overrides):
    loss0, grads0 = baseline
    loss, grads = loss_and_grads(real_tokens, knobs, **overrides)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0)), name
    assert grads.keys() == grads0.keys()
    flat = torch.cat([grads[p].flatten() for p in grads0])
    assert_close(flat, torch.cat([g.flatten() for g in grads0.values()]), f"{name}: all gradients")
    for param in grads0:  # a small parameter's gradient sums ~1e4 terms: allow their round-off
        assert rel_rms(grads[param], grads0[param]) <= 1e-4, f"{name}: grad of {param}"


@pytest.mark.parametrize("mode", ["layer", "selective"])
def test_recompute_keeps_loss_and_gradients_with_the_candidate_stage(real_tokens, mode):
    from tests.kernels.test_dsa_candidates import STAGED_MODEL

    loss0, grads0 = loss_and_grads(real_tokens, None, **STAGED_MODEL)
    loss, grads = loss_and_grads(real_tokens, [lambda m: apply_recompute(m, mode)], **STAGED_MODEL)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    flat = torch.cat([grads[p].flatten() for p in grads0])
    assert_close(flat, torch.cat([g.flatten() for g in grads0.values()]), f"{mode}: all gradients")


def test_recompute_is_idempotent_and_keeps_parameter_names():
    model = build_model("debug")
    names = [n for n, _ in model.named_parameters()]
    apply_recompute(apply_recompute(model, "layer"), "layer")
    apply_offload(apply_offload(model))
    assert [n for n, _ in model.named_parameters()] == names
    assert all(type(b).__mro__.count(Recomputed) == 1 for b in model.blocks)
    assert isinstance(model, Offloaded) and "forward" not in vars(model)  # no rebound forward
    build_model("debug").load_state_dict(model.state_dict())  # the same checkpoint either way
    with pytest.raises(ValueError, match="unknown recompute mode"):
        apply_recompute(model, "sometimes")


def test_recompute_keeps_the_dsa_selection_instead_of_recomputing_it(real_tokens, monkeypatch):
    import megabase.kernels.dsa as dsa

    calls = []
    real = dsa.dsa_indexer
    monkeypatch.setattr(dsa, "dsa_indexer", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = apply_recompute(build_model("debug"), "layer")
    x = real_tokens[:, :1_501]
    model(x[:, :-1], x[:, 1:]).loss.backward()
    assert len(calls) == 1  # one DSA layer, one selection pass for forward and backward


@pytest.mark.parametrize("mode", ["layer", "selective"])
def test_recompute_reruns_the_wrapped_forward_in_backward_and_never_when_streaming(real_tokens,
                                                                                  mode):
    model = apply_recompute(build_model("debug"), mode)
    runs = {"mixer": 0, "ffn": 0}
    for block in model.blocks:
        # a module inside the mixer: a recompute calls the wrapped forward itself, not the module
        block.mixer.o_proj.register_forward_pre_hook(
            lambda *a: runs.__setitem__("mixer", runs["mixer"] + 1))
        block.ffn.register_forward_pre_hook(lambda *a: runs.__setitem__("ffn", runs["ffn"] + 1))
    x = real_tokens[:, :1_001]
    out = model(x[:, :-1], x[:, 1:])
    assert runs == {"mixer": 4, "ffn": 4}
    out.loss.backward()
    # the backward reran what recompute wraps: every block (layer) or only the mixers (selective)
    assert runs == {"mixer": 8, "ffn": 8 if mode == "layer" else 4}
    with torch.no_grad():
        model(x[:, :500], state=model.init_state())
    assert runs["mixer"] == 12
    model(x[:, :500], state=model.init_state()).logits.sum().backward()  # streaming: not wrapped
    assert runs["mixer"] == 16


def test_heap_trim_hooks_every_block_once():
    model = build_model("debug")
    apply_heap_trim(apply_heap_trim(model))
    assert all(len(b._forward_hooks) == 1 and len(b._backward_hooks) == 1 for b in model.blocks)

