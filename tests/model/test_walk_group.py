"""A prompt walked in segments and continued as a group of rows, against one full pass over every
row's prompt and continuation, on real DNA: logits, routing and every parameter's gradient."""

import pytest
import torch

from megabase.model.walk_group import walked_group
from tests.kernels.tolerances import assert_close, rel_rms
from tests.model.conftest import live_model
from tests.model.test_walk import STAGE


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _full(model, prompt, rows, replay=None, follow=True):
    """``[G, n, 4]`` logits of the rows from one pass over ``prompt + rows`` each (prompt copied)."""
    x = torch.cat([prompt.expand(rows.shape[0], -1), rows], 1)
    ctx = None if replay is None else model.context(replay=replay, follow_replay=follow)
    out = model(x, ctx=ctx)
    return out.logits[:, prompt.shape[1]:], out.router_choice


def _weights(logits):
    """A fixed, sign-changing weighting of the logits: every row and position sends a gradient."""
    return torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)


@pytest.mark.parametrize("P, n, G, segment, overrides", [
    (2000, 37, 3, 700, {}),  # odd lengths: three segments, the last ragged
    (1500, 64, 2, 1500, {}),  # one segment, then the group
    (2500, 41, 4, 1024, STAGE),  # the DSA candidate stage's seeds read across every border
])
def test_walked_group_equals_a_full_pass_per_row(real_tokens, P, n, G, segment, overrides):
    prompt = real_tokens[:, :P]
    rows = torch.stack([real_tokens[0, 5000 + 997 * g : 5000 + 997 * g + n] for g in range(G)])
    model = live_model("debug", **overrides)
    logits0, own0 = _full(model, prompt, rows)
    (logits0 * _weights(logits0)).sum().backward()
    grads0 = _grads(model)
    model.zero_grad(set_to_none=True)
    logits, own = walked_group(model, prompt, rows, segment)
    (logits * _weights(logits)).sum().backward()
    grads = _grads(model)
    assert logits.shape == (G, n, 4)
    assert_close(logits, logits0, f"P={P} segment={segment}: logits")
    for a, b in zip(own, own0):
        assert torch.equal(a.long(), b.long())
    assert grads0.keys() <= grads.keys() and len(grads0) > 20
    for name, g in grads.items():
        g0 = grads0.get(name, torch.zeros_like(g))  # the index keys: untrained in eval, zero here
        assert rel_rms(g, g0) <= 1e-5 if g0.any() else not g.any(), name
    assert any(g.norm() > 0 for k, g in grads.items() if k.startswith("blocks.0."))


@pytest.mark.parametrize("follow", [True, False])
def test_walked_group_replays_routing_on_prompt_and_rows(real_tokens, follow):
    """Recorded experts (here: the router's choice shifted by one expert) are followed on the
    prompt and the rows alike, or only compared against."""
    P, n, G = 1800, 30, 3
    prompt = real_tokens[:, 100 : 100 + P]
    rows = torch.stack([real_tokens[0, 9000 + 501 * g : 9000 + 501 * g + n] for g in range(G)])
    model = live_model("debug").eval()
    _, own = _full(model, prompt, rows)
    E = model.cfg.n_experts
    replay = [((r.long() + 1) % E).to(r.dtype) for r in own]
    logits0, own0 = _full(model, prompt, rows, replay, follow)
    (logits0 * _weights(logits0)).sum().backward()
    grads0 = _grads(model)
    model.zero_grad(set_to_none=True)
    logits, choice = walked_group(model, prompt, rows, 512, replay, follow)
    (logits * _weights(logits)).sum().backward()
    assert_close(logits, logits0, f"replay follow={follow}: logits")
    for a, b in zip(choice, own0):
        assert torch.equal(a.long(), b.long())
    for name, g in _grads(model).items():
        g0 = grads0.get(name, torch.zeros_like(g))
        assert rel_rms(g, g0) <= 1e-5 if g0.any() else not g.any(), name


def test_without_autograd_nothing_is_kept_for_a_backward(real_tokens):
    model = live_model("debug").eval()
    prompt, rows = real_tokens[:, :900], real_tokens[:, 2000:2040].expand(2, -1)
    with torch.no_grad():
        logits, _ = walked_group(model, prompt, rows, 256)
        logits0, _ = _full(model, prompt, rows)
    assert not logits.requires_grad
    assert_close(logits, logits0, "no grad")


def test_one_prompt_row_per_group(real_tokens):
    with pytest.raises(ValueError, match="one prompt row"):
        walked_group(live_model("debug"), real_tokens[:, :200].expand(2, -1),
                     real_tokens[:, 300:310], 64)
