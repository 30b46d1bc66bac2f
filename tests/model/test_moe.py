"""The MoE balancing machinery: routing margins and the bias updates that read them."""

import pytest
import torch

from megabase.model import build_model
from megabase.model.moe import MARGIN_EDGES, N_MARGIN_BINS, margin_quantile_shift


def _moe(E=8, k=2, rule="quantile", rate=0.5):
    torch.manual_seed(0)
    return build_model("debug", n_experts=E, experts_per_token=k, bias_update=rule,
                       bias_update_rate=rate).moe_layers()[0]


def _route(moe, scores):
    sel = (scores + moe.bias).topk(moe.cfg.experts_per_token, -1).indices
    return torch.bincount(sel.flatten(), minlength=moe.cfg.n_experts).float(), sel


def test_margins_count_every_token_and_the_sign_says_selected():
    moe = _moe()
    scores = torch.rand(1000, 8)
    load, sel = _route(moe, scores)
    hist = moe.margins(scores, sel)
    assert hist.shape == (8, N_MARGIN_BINS) and torch.equal(hist.sum(1), torch.full((8,), 1000.0))
    positive = int((MARGIN_EDGES <= 0).sum())  # bins from here on hold margins > 0 only
    assert torch.equal(hist[:, positive + 1 :].sum(1) + hist[:, positive], load)


def test_raising_a_bias_by_the_margin_adds_exactly_those_tokens():
    moe = _moe()
    scores = torch.rand(5000, 8)
    load, sel = _route(moe, scores)
    target = float(load.mean())
    shift = margin_quantile_shift(moe.margins(scores, sel), target)
    for e in range(8):  # each expert moved alone gets the target load, to the histogram's resolution
        moved = moe.bias.clone()
        moved[e] += shift[e]
        new = torch.bincount((scores + moved).topk(2, -1).indices.flatten(), minlength=8)[e]
        assert abs(float(new) - target) <= 0.02 * target


@pytest.mark.parametrize("E,k", [(4, 2), (8, 2), (64, 4)])
def test_quantile_update_balances_scores_that_barely_vary(E, k):
    """Expert means far apart, token-to-token spread 0.02 (what deep MoE layers of cpu-small show
    after 40 steps): every token starts on the same k experts. The quantile update balances in a
    few steps; DeepSeek-V3's sign update at its rate does not move in the same steps."""
    torch.manual_seed(1)
    base = torch.rand(E)
    ratios = {}
    for rule, rate in (("quantile", 0.5), ("sign", 1e-3)):
        moe = _moe(E, k, rule, rate)
        for _ in range(30):
            scores = (base + 0.02 * torch.randn(8192, E)).clamp(0, 1)
            load, sel = _route(moe, scores)
            moe.update_bias(load, moe.margins(scores, sel))
        ratios[rule] = float(load.max() / load.mean())
    assert ratios["quantile"] < 1.15 < E / k * 0.9 < ratios["sign"]


def test_model_output_carries_margins(real_tokens):
    torch.manual_seed(0)
    model = build_model("debug")
    out = model(real_tokens[:, :300], real_tokens[:, 1:301])
    n_moe = len(model.moe_layers())
    assert out.expert_margins.shape == (n_moe, 4, N_MARGIN_BINS)
    assert torch.equal(out.expert_margins.sum(-1), torch.full((n_moe, 4), 300.0))
    before = [m.bias.clone() for m in model.moe_layers()]
    model.update_moe_bias(out.expert_load, out.expert_margins)
    assert any(not torch.equal(b, m.bias) for b, m in zip(before, model.moe_layers()))


def test_a_decoding_step_routes_the_batch_as_one_chunk_with_each_rows_numbers():
    """In an untiled call (incremental decoding) the batch's new tokens go through the experts
    together: each row gets what it gets alone (to fp32 round-off), the same experts, and the
    load counts of all rows."""
    from megabase.model import Context

    torch.manual_seed(0)
    moe = build_model("debug").moe_layers()[0].eval()
    x = torch.randn(16, 1, moe.cfg.d_model)
    with torch.no_grad():
        alone = [moe(x[i : i + 1]) for i in range(16)]
        y, _, stats, (used, _) = moe(x, Context(untiled=True))
    for i, (yi, _, _, (used_i, _)) in enumerate(alone):
        assert torch.allclose(y[i], yi[0], atol=1e-6), i
        assert torch.equal(used[i], used_i[0]), i
    assert torch.equal(stats[:, 0], sum(s[:, 0] for _, _, s, _ in alone))
