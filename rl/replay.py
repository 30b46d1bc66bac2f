"""Routing replay (R3): the generator records the experts each token was sent to in every MoE layer,
the trainer's pass uses those experts and recomputes only the gate weights, so both sides run
the same experts and the router still gets its gradient through the gates.

Nothing is put on the model: the generator's sampler returns the experts of every call
(``LMOutput.routing``), and the trainer hands them back in its call's context
(``Context.replay``), following them or, to measure, routing freely. :func:`routing_flips`
compares the recording with the router's own choice (``LMOutput.router_choice``).
"""

from __future__ import annotations

import torch


def replay_context(model, routing: list[torch.Tensor], length: int, force: bool = True):
    """The context of a trainer's pass over ``length`` input tokens that replays ``routing``
    (per MoE layer ``[B, >= length, k]``), or with ``force`` False routes freely beside it."""
    return model.context(replay=[r[:, :length] for r in routing], follow_replay=force)


def routing_flips(recorded: list[torch.Tensor], own: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    """``(rate, differs [B, T])``: the share of (token, MoE layer) pairs whose recorded experts
    (as a set) differ from the router's own top k, and the tokens where some layer's do."""
    if not recorded:
        return 0.0, torch.zeros(0, 0, dtype=torch.bool)
    differ = torch.stack([(r.sort(-1).values != o.to(r.dtype).sort(-1).values).any(-1)
                          for r, o in zip(recorded, own)])  # [layers, B, T]
    return float(differ.double().mean()), differ.any(0)
