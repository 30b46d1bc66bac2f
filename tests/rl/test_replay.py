"""Routing replay: the generator's recorded experts, replayed in the trainer's parallel pass, give
the generator's log-probs; replay imposes the experts and keeps the router's gradient; sequences
packed in one batch do not see each other."""

import torch

from megabase.rl.replay import replay_context
from megabase.rl.trainer import merge, sampled_log_probs


def test_replayed_choices_give_the_generators_log_probs(policy, human_prompts, sample):
    groups = sample(policy, human_prompts)
    b = merge(groups)
    assert [r.shape for r in b["routing"]] == [(6, 1 + 96 + 48 - 1, 2)] * len(policy.moe_layers())
    with torch.no_grad():
        logp, flips, _ = sampled_log_probs(policy, b["tokens"], b["prompt_len"], 1.0, b["routing"])
    assert (logp - b["behaviour"]).abs().max() < 1e-5
    assert flips < 0.01  # fp32 incremental decoding against the parallel pass: rare flips


def test_replay_beats_free_routing_against_a_bf16_generator(policy, human_prompts, sample):
    groups = sample(policy, human_prompts, dtype="bf16", group=4, length=64)
    b = merge(groups)
    with torch.no_grad():
        replay, _, routed = sampled_log_probs(policy, b["tokens"], b["prompt_len"], 1.0,
                                              b["routing"], force=True)
        free, flips_free, routed_free = sampled_log_probs(policy, b["tokens"], b["prompt_len"],
                                                          1.0, b["routing"], force=False)
    d_replay, d_free = (replay - b["behaviour"]).abs(), (free - b["behaviour"]).abs()
    assert flips_free > 0  # bf16 routes some tokens elsewhere
    assert d_replay.mean() < d_free.mean() / 2
    # the bases predicted from a rerouted token carry the difference replay removes
    assert routed.any() and (routed == routed_free).float().mean() > 0.9
    assert d_replay[routed].mean() < d_free[routed].mean() / 2


def test_replay_imposes_the_experts_and_keeps_the_router_gradient(policy, human_prompts, sample):
    groups = sample(policy, human_prompts[:1], group=2, length=16)
    b = merge(groups)
    P = b["prompt_len"]
    shifted = [(r.long() + 1) % policy.cfg.n_experts for r in b["routing"]]  # other experts
    with torch.no_grad():
        own, _, _ = sampled_log_probs(policy, b["tokens"], P, 1.0, b["routing"])
        moved, flips, _ = sampled_log_probs(policy, b["tokens"], P, 1.0, shifted)
    assert flips > 0.5 and (own - moved).abs().max() > 1e-4
    policy.zero_grad(set_to_none=True)
    logp, _, _ = sampled_log_probs(policy, b["tokens"], P, 1.0, shifted)
    logp.sum().backward()
    routers = [moe.router.weight.grad for moe in policy.moe_layers()]
    assert all(g is not None and g.abs().sum() > 0 for g in routers)
    policy.zero_grad(set_to_none=True)


def test_replay_lives_in_one_call_and_leaves_nothing_on_the_model(policy, human_prompts, sample):
    """Replay is a call's context, not a tape put on the layers: the call after it routes as the
    router does, and no layer's attributes changed."""
    groups = sample(policy, human_prompts[:1], group=2, length=16)
    b = merge(groups)
    inputs = b["tokens"][:, :-1]
    shifted = [(r.long() + 1) % policy.cfg.n_experts for r in b["routing"]]
    before = [dict(vars(m)) for m in policy.modules()]
    with torch.no_grad():
        replayed = policy(inputs, ctx=replay_context(policy, shifted, inputs.shape[1]))
        after = policy(inputs)
    assert all(torch.equal(u, s.to(u.dtype)) for u, s in zip(replayed.routing, shifted))
    assert all(torch.equal(u, o) for u, o in zip(after.routing, after.router_choice))
    assert [dict(vars(m)) for m in policy.modules()] == before


def test_no_state_leaks_between_sequences_of_a_batch(policy, human_prompts, sample):
    groups = sample(policy, human_prompts, group=2, length=32, seed=3)
    b = merge(groups)  # 4 rows: two prompts, two samples each, decoded as one batch
    with torch.no_grad():
        for row in range(4):
            alone, _, _ = sampled_log_probs(policy, b["tokens"][row : row + 1], b["prompt_len"], 1.0,
                                         [r[row : row + 1] for r in b["routing"]])
            assert (alone[0] - b["behaviour"][row]).abs().max() < 1e-5
