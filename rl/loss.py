"""The policy loss of asynchronous RL (prime-rl's recipe) and the trainer-vs-generator mismatch.

Per generated base ``t`` of sample ``i``: ``log r = log p_trainer - log p_behaviour`` (the
generator's log-prob when it sampled the base), ``A_i = reward_i - mean of its group``. Bases whose
ratio ``r`` leaves ``[1 - mask_ratio, 1 + mask_ratio]`` are masked out (trainer and generator
disagree too much to trust the importance weight). Over the kept bases::

    loss = mean( -stopgrad(r) * A_i * log p_trainer          policy gradient, importance-weighted
                 + log_ratio_weight * (log r)^2              a small pull towards the behaviour
                 + beta * k3(p_trainer, p_start) )           KL to the starting model

with ``k3 = exp(log p_start - log p) - (log p_start - log p) - 1`` (Schulman's unbiased, positive
estimator on the sampled base).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LN2 = math.log(2.0)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """``rewards [N]`` in groups of ``group`` consecutive samples -> reward minus its group mean."""
    r = rewards.reshape(-1, group)
    return (r - r.mean(1, keepdim=True)).reshape(-1)


@dataclass
class LossParts:
    loss: torch.Tensor
    kept: float  # share of bases kept by the ratio mask
    policy: float
    log_ratio: float
    kl_start: float  # mean k3 to the starting model over kept bases


def rl_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
            mask_ratio: float = 0.2, log_ratio_weight: float = 1e-3,
            beta: float = 0.0) -> LossParts:
    """``logp [N, L]`` (with gradient), ``behaviour [N, L]``, ``advantages [N]``, ``mask [N, L]``
    (bases that count; None: all), ``ref_logp [N, L]`` (the starting model's; needed when
    ``beta`` > 0) -> the mean loss over kept bases (0 with no base kept) and its parts."""
    if mask is None:
        mask = torch.ones_like(logp, dtype=torch.bool)
    log_ratio = logp - behaviour
    ratio = log_ratio.detach().exp()
    keep = mask & ((ratio - 1).abs() <= mask_ratio)
    n = keep.sum().clamp_min(1)
    policy = -(ratio * advantages[:, None] * logp)
    pull = log_ratio_weight * log_ratio.pow(2)
    total = policy + pull
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None:
        d = ref_logp - logp
        k3 = d.exp() - d - 1
        kl = (k3.detach() * keep).sum() / n
        if beta:
            total = total + beta * k3
    elif beta:
        raise ValueError("beta > 0 needs the starting model's log-probs (ref_logp)")
    loss = (total * keep).sum() / n
    return LossParts(loss, float(keep.sum() / mask.sum().clamp_min(1)),
                     float((policy.detach() * keep).sum() / n),
                     float((log_ratio.detach() * keep).sum() / n), float(kl))


def mismatch(trainer_logp: torch.Tensor, generator_logp: torch.Tensor,
             mask: torch.Tensor | None = None) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled bases are from the generator's, on bases
    both computed under the same weights (``mask``): k3 KL (generator as the sampling side),
    mean and max ``|delta log p|``, share with ``|delta| > ln 2`` (a factor of two)."""
    if mask is None:
        mask = torch.ones_like(trainer_logp, dtype=torch.bool)
    n = int(mask.sum())
    if not n:
        return {"k3": math.nan, "mean_abs": math.nan, "max_abs": math.nan, "over_ln2": math.nan,
                "bases": 0}
    d = (trainer_logp - generator_logp).detach()[mask].double()
    k3 = (d.exp() - d - 1).mean()  # E_gen[r - log r - 1], r = p_trainer / p_gen
    return {"k3": float(k3), "mean_abs": float(d.abs().mean()), "max_abs": float(d.abs().max()),
            "over_ln2": float((d.abs() > LN2).double().mean()), "bases": n}
