"""The RL loss against a hand-computed example; advantages; the mismatch statistics."""

import math

import pytest
import torch

from megabase.rl.loss import group_advantages, mismatch, rl_loss


def test_group_advantages_are_reward_minus_the_group_mean():
    adv = group_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 4.0]), 3)
    assert torch.allclose(adv, torch.tensor([-1 / 3, 5 / 3, -4 / 3, -2.0, 0.0, 2.0]))


def test_loss_by_hand():
    # two samples of two bases; sample 0 has advantage +1, sample 1 -1
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, -2.0], [-0.5, -1.0]])  # base (1, 1): ratio e^-0.5, masked
    ref = torch.tensor([[-1.0, -1.8], [-0.7, -1.5]])
    adv = torch.tensor([1.0, -1.0])
    parts = rl_loss(logp, behaviour, adv, ref_logp=ref, mask_ratio=0.2, log_ratio_weight=0.5,
                    beta=2.0)
    r00 = math.exp(0.1)
    k3 = [0.0, math.exp(0.2) - 0.2 - 1, math.exp(-0.2) + 0.2 - 1]  # kept bases (0,0) (0,1) (1,0)
    by_hand = ((-r00 * 1 * -1.0 + 0.5 * 0.01 + 2 * k3[0])
               + (-1 * 1 * -2.0 + 0 + 2 * k3[1])
               + (-1 * -1 * -0.5 + 0 + 2 * k3[2])) / 3
    assert parts.loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert parts.kept == pytest.approx(0.75)
    assert parts.kl_start == pytest.approx(sum(k3) / 3, rel=1e-6)
    parts.loss.backward()
    # d/dlogp: -r A + 2 w log r + beta (1 - exp(ref - logp)), over 3 kept bases
    grad = torch.tensor([[(-r00 + 2 * 0.5 * 0.1 + 2 * (1 - 1)) / 3, (-1 + 2 * (1 - math.exp(0.2))) / 3],
                         [(1 + 2 * (1 - math.exp(-0.2))) / 3, 0.0]])
    assert torch.allclose(logp.grad, grad, atol=1e-6)


def test_no_base_kept_gives_a_zero_loss_not_nan():
    logp = torch.zeros(1, 3, requires_grad=True)
    parts = rl_loss(logp, torch.full((1, 3), -5.0), torch.ones(1))
    assert parts.loss.item() == 0.0 and parts.kept == 0.0


def test_beta_needs_the_starting_model():
    with pytest.raises(ValueError, match="ref_logp"):
        rl_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), beta=0.1)


def test_mismatch_statistics():
    gen = torch.log(torch.tensor([[0.5, 0.3, 0.1]], dtype=torch.float64))
    tr = torch.log(torch.tensor([[0.5, 0.5, 0.3]], dtype=torch.float64))
    m = mismatch(tr, gen)
    d = torch.tensor([0.0, math.log(5 / 3), math.log(3)], dtype=torch.float64)
    assert m["k3"] == pytest.approx(float((d.exp() - d - 1).mean()))
    assert m["max_abs"] == pytest.approx(math.log(3)) and m["over_ln2"] == pytest.approx(1 / 3)
    assert math.isnan(mismatch(tr, gen, torch.zeros(1, 3, dtype=torch.bool))["k3"])
