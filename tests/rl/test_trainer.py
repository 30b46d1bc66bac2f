"""The trainer's log-probs of sampled bases with each group's prompt read once: the numbers and
gradients of one pass over every row's prompt and samples, routing replayed on both parts."""

import copy

import numpy as np
import pytest
import torch

from megabase.rl.trainer import merge, sampled_log_probs


@pytest.fixture(scope="module")
def long_groups(policy, hsap_store, sample):
    """Two groups of three 40-base samples after 3,000 real bases of human chr22 each."""
    tokens = np.asarray(hsap_store.tokens(hsap_store.names[0]))
    starts = [s for s in range(0, len(tokens) - 3_000, 99_991) if (tokens[s : s + 3_000] < 4).all()]
    prompts = [tokens[s : s + 3_000].copy() for s in starts[:2]]
    return sample(policy, prompts, group=3, length=40, seed=4)


@pytest.mark.parametrize("replay, segment", [(False, None), (True, None), (False, 700),
                                             (True, 1_000)])
def test_group_log_probs_and_gradients_equal_a_full_pass(policy, long_groups, replay, segment):
    """Each group's prompt read once, whole or walked in segments (700: five, the last ragged;
    1,000: three), against one pass over every row."""
    model = copy.deepcopy(policy)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)  # every layer's gradient non-zero
    b = merge(long_groups)
    routing = b["routing"] if replay else None
    out = {}
    for group in (None, 3):
        model.zero_grad(set_to_none=True)
        logp, flips, routed = sampled_log_probs(model, b["tokens"], b["prompt_len"], 1.0, routing,
                                                group=group, segment=segment)
        (logp * torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[group] = logp.detach(), flips, routed, grads
    (full, f_flips, f_routed, f_grads), (grouped, g_flips, g_routed, g_grads) = out[None], out[3]
    assert full.shape == (6, 40)
    assert (full - grouped).abs().max() <= 1e-5
    assert f_flips == g_flips and torch.equal(f_routed, g_routed)
    assert f_grads.keys() <= g_grads.keys() and len(f_grads) > 20
    for name in g_grads.keys() - f_grads.keys():  # the walk's index keys: zero, not trained here
        assert not g_grads[name].any(), name
    for name, g in f_grads.items():
        err = (g - g_grads[name]).norm() / g.norm().clamp_min(1e-12)
        assert err <= 1e-4, name
    reached = [n for n in f_grads if "blocks.0." in n and f_grads[n].norm() > 0]
    assert reached  # the first layer's weights learn through the prompt's states and keys
