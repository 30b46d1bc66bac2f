"""The trainer's side: score a batch of groups under the policy (replaying the generator's
routing), take one optimizer step, and measure how far it and the generator disagree."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from megabase.core.errors import TrainingError
from megabase.model import repeat_state
from megabase.model.walk_group import walked_group

from .config import RLConfig
from .loss import LN2, group_advantages, mismatch, rl_loss
from .replay import replay_context, routing_flips
from .rollout import Rollout


def sampled_log_probs(model, tokens: torch.Tensor, prompt_len: int, temperature: float,
                      routing: list[torch.Tensor] | None = None, force: bool = True,
                      group: int | None = None, segment: int | None = None):
    """Log-probs ``[N, L]`` of the sampled bases ``tokens[:, prompt_len:]`` given everything
    before them, the share of (token, MoE layer) pairs whose experts differ between ``routing``
    and the router (0 without ``routing``), and ``[N, L]``: the sampled bases predicted from a
    token whose experts differ in some layer.

    With ``group``, rows come in groups of ``group`` that share their prompt: each group's prompt
    is read once (one pass of ``prompt_len - 1`` tokens, with autograd), its state copied to the
    group's rows, and their sampled bases read from it (:func:`group_pass`); gradients reach the
    prompt's keys, values and states through the copies; with ``segment`` too, a prompt longer
    than it is walked in segments of it (:func:`~megabase.model.walk_group.walked_group`: one
    segment's activations at a time, the gradients the same). Without ``group``, one parallel
    pass over ``tokens[:, :-1]``, every row's prompt included."""
    inputs = tokens[:, :-1]
    L = tokens.shape[1] - prompt_len
    if group:
        logits, own = group_pass(model, tokens, prompt_len, group, routing, force, segment)
    else:
        ctx = None if routing is None else replay_context(model, routing, inputs.shape[1], force)
        out = model(inputs, ctx=ctx)
        logits, own = out.logits[:, prompt_len - 1 :], out.router_choice
    if routing is None:
        flips, routed = 0.0, torch.zeros(tokens.shape[0], L, dtype=torch.bool)
    else:
        recorded = [r[:, : inputs.shape[1]] for r in routing]
        flips, differs = routing_flips(recorded, own)
        routed = differs[:, prompt_len - 1 :]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, tokens[:, prompt_len:, None])[..., 0], flips, routed


def group_pass(model, tokens: torch.Tensor, prompt_len: int, group: int,
               routing: list[torch.Tensor] | None = None, force: bool = True,
               segment: int | None = None):
    """``tokens [N, S]`` in groups of ``group`` rows sharing ``tokens[:, :prompt_len]``: the
    logits ``[N, S - prompt_len, 4]`` that predict the sampled bases, and per MoE layer the
    router's own experts of every input ``[N, S - 1, k]``. One pass over each group's prompt
    (its first ``prompt_len - 1`` tokens; the last prompt token predicts the first sampled base,
    so it is read with the samples), then one over the group's sampled bases from a copy of the
    prompt's state per row; ``routing`` (per MoE layer ``[N, >= S - 1, k]``) is replayed on both.
    A prompt longer than ``segment`` is walked (:func:`~megabase.model.walk_group.walked_group`)."""
    N, S = tokens.shape
    if N % group:
        raise ValueError(f"{N} rows are not groups of {group}")
    head = prompt_len - 1
    logits, own = [], []
    for g in range(0, N, group):
        rows = tokens[g : g + group]
        first, rest = rows[:1, :head], rows[:, head:-1]
        replay = None if routing is None else [r[g : g + group] for r in routing]
        if segment is not None and head > segment:
            out, choice = walked_group(model, first, rest, segment,
                                       None if replay is None else [r[:, : S - 1] for r in replay],
                                       force)
            logits.append(out)
            own.append(choice)
            continue
        state = model.init_state()
        ctx = None if replay is None else replay_context(model, [r[:1, :head] for r in replay],
                                                         head, force)
        shared = model(first, state=state, ctx=ctx)
        state = repeat_state(state, group)
        ctx = None if replay is None else replay_context(
            model, [r[:, head : S - 1] for r in replay], S - 1 - head, force)
        out = model(rest, state=state, ctx=ctx)
        logits.append(out.logits)
        own.append([torch.cat([a.expand(group, -1, -1), b], 1)
                    for a, b in zip(shared.router_choice, out.router_choice)])
    return torch.cat(logits), [torch.cat(layer) for layer in zip(*own)]


def clean_bases(versions: torch.Tensor, version: int, recompute_state: bool) -> torch.Tensor:
    """Bases ``[N, L]`` the generator computed wholly with the weights of ``version``: sampled by
    it, and (unless the cache is recomputed on an update) in a sample whose every earlier base was
    too, since a kept cache carries the older weights' keys and states forward."""
    same = versions == version
    if recompute_state:
        return same
    return same & (versions[:, :1] == version)  # versions only grow along a sample


def merge(groups: list[Rollout]) -> dict:
    """Stack groups (same prompt and sample lengths) into one batch."""
    routing = None
    if all(g.routing is not None for g in groups):
        routing = [torch.cat(layer) for layer in zip(*(g.routing for g in groups))]
    return {"tokens": torch.cat([g.tokens for g in groups]),
            "behaviour": torch.cat([g.behaviour for g in groups]),
            "versions": torch.cat([g.versions for g in groups]),
            "rewards": torch.cat([g.rewards for g in groups]),
            "routing": routing, "prompt_len": groups[0].prompt_len}


class Diverged(TrainingError):
    """The loss, the gradient or the policy's weights became NaN or infinite at trainer step
    ``step`` (1-based); the job stops and the policy is never saved (exit 3)."""

    def __init__(self, what: str, step: int, lr: float):
        super().__init__(f"{what} at step {step}; stopped, the policy was not saved (lr is "
                         f"{lr:g}: a lower one may help)")
        self.step = step


def first_nonfinite(model) -> str | None:
    """``"name (k of n values)"`` of the first parameter of ``model`` holding a NaN or an
    infinity; None when all are finite."""
    params = [(name, p) for name, p in model.named_parameters()]
    finite = torch.stack([torch.isfinite(p).all() for _, p in params])  # one sync, not one each
    if bool(finite.all()):
        return None
    name, p = params[int((~finite).nonzero()[0])]
    return f"{name} ({int((~torch.isfinite(p)).sum()):,} of {p.numel():,} values)"


class Trainer:
    """The policy, a frozen copy of the starting model, AdamW, and the version counter."""

    def __init__(self, model, cfg: RLConfig):
        self.cfg = cfg
        self.policy = model.eval()  # the generator's path (no indexer training); gradients still flow
        self.start = copy.deepcopy(model).eval()
        for p in self.start.parameters():
            p.requires_grad_(False)
        for moe in self.policy.moe_layers():
            moe.bias.requires_grad_(False)  # selection biases stay as trained
        self.optimizer = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad],
                                           lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.version = 0

    def step(self, groups: list[Rollout], measure_both: bool = True) -> dict[str, float]:
        """One update on ``groups``; the metrics of the step (before the update's effect)."""
        cfg = self.cfg
        b = merge(groups)
        P, routing = b["prompt_len"], b["routing"]
        replay = cfg.routing_replay and routing is not None
        # each group's prompt read once, not once per sample; a long one walked in segments
        G, W = cfg.group_size, cfg.walk_segment
        logp, flips, routed = sampled_log_probs(self.policy, b["tokens"], P, cfg.temperature,
                                                routing, force=replay, group=G, segment=W)
        with torch.no_grad():
            ref, _, _ = sampled_log_probs(self.start, b["tokens"], P, cfg.temperature, group=G,
                                          segment=W)
        adv = group_advantages(b["rewards"], cfg.group_size)
        parts = rl_loss(logp, b["behaviour"], adv, ref_logp=ref, mask_ratio=cfg.mask_ratio,
                        log_ratio_weight=cfg.log_ratio_weight, beta=cfg.beta)
        same = clean_bases(b["versions"], self.version, cfg.recompute_state)
        m = mismatch(logp, b["behaviour"], same)
        metrics = {f"mismatch/{k}": v for k, v in m.items()}
        # every base, old caches and older weights included: what the importance ratio corrects
        inflight = mismatch(logp, b["behaviour"])
        metrics.update({f"mismatch_inflight/{k}": v for k, v in inflight.items()})
        metrics["mismatch/routing_differs"] = flips
        # where the mismatch comes from: bases after a token the two sides route differently
        metrics["mismatch/rerouted_bases"] = float(routed[same].double().mean()) if same.any() \
            else math.nan
        metrics.update({f"mismatch_rerouted/{k}": v
                        for k, v in mismatch(logp, b["behaviour"], same & routed).items()})
        if measure_both and routing is not None:
            # the other side of the comparison: the same pass with replay switched the other way
            with torch.no_grad():
                other, other_flips, other_routed = sampled_log_probs(
                    self.policy, b["tokens"], P, cfg.temperature, routing, force=not replay,
                    group=G, segment=W)
            tag = "without_replay" if replay else "with_replay"
            for k, v in mismatch(other, b["behaviour"], same).items():
                metrics[f"mismatch_{tag}/{k}"] = v
            for k, v in mismatch(other, b["behaviour"], same & routed).items():
                metrics[f"mismatch_rerouted_{tag}/{k}"] = v
            for k, v in mismatch(other, b["behaviour"]).items():
                metrics[f"mismatch_inflight_{tag}/{k}"] = v
            metrics[f"mismatch_{tag}/routing_differs"] = other_flips
        # a NaN or infinity anywhere stops the job: an update with it spreads to every weight,
        # and a policy of NaN must never reach the generator or the checkpoint
        step = self.version + 1
        if not torch.isfinite(parts.loss):
            raise Diverged(f"the loss became {float(parts.loss)}", step, cfg.lr)
        self.optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
        if not torch.isfinite(norm):
            raise Diverged(f"the gradient's norm became {float(norm)}", step, cfg.lr)
        self.optimizer.step()
        broken = first_nonfinite(self.policy)
        if broken is not None:
            raise Diverged(f"the policy's weights became non-finite in {broken}", step, cfg.lr)
        self.version += 1
        rewards = b["rewards"].double()
        metrics.update({
            "reward": float(rewards.mean()), "reward_max": float(rewards.max()),
            "loss": float(parts.loss.detach()), "policy_loss": parts.policy,
            "log_ratio": parts.log_ratio, "kept": parts.kept, "grad_norm": float(norm),
            "kl_start": parts.kl_start,
            "start_bits_per_base": float(-ref.mean() / LN2),
            "policy_bits_per_base": float(-logp.detach().mean() / LN2),
            "lag_mean": float(np.mean([self.version - 1 - int(g.versions.min()) for g in groups])),
        })
        return {k: (v if math.isfinite(v) else math.nan) for k, v in metrics.items()}
