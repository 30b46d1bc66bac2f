"""Routing replay (R3): the generator records the experts each token was sent to in every MoE layer,
the trainer's pass uses those experts and recomputes only the gate weights, so both sides run
the same experts and the router still gets its gradient through the gates.

A :class:`RoutingTape` is put on the model's MoE layers (``moe.tape``) for one sequence of calls:
recording, each call appends its ``[B, T, k]`` choices per layer along T; replaying, each call takes
its next ``T`` positions. Either way it counts the tokens whose recorded experts differ from the
router's own top k.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class RoutingTape:
    """Per MoE layer: recorded experts ``[B, T, k]`` (uint8), a replay cursor, routing flips."""

    def __init__(self, routing: list[torch.Tensor] | None = None, force: bool = True):
        self.replaying = routing is not None
        self.force = force  # False: route freely, only count where the recording differs
        self.pending: dict[int, torch.Tensor] = {}
        self.layers: list[list[torch.Tensor]] = [[r] for r in routing] if routing is not None else []
        self.cursor: list[int] = [0] * len(self.layers)
        self.index: dict[int, int] = {}
        self.tokens = 0  # token-layer pairs seen
        self.flips = 0  # of them, those whose experts (as a set) differ from the router's choice
        self.differs: torch.Tensor | None = None  # replaying: [B, T], any layer differs at the token

    def _layer(self, moe) -> int:
        key = id(moe)
        if key not in self.index:
            self.index[key] = len(self.index)
            if not self.replaying:
                self.layers.append([])
                self.cursor.append(0)
        return self.index[key]

    def take(self, moe, B: int, T: int) -> torch.Tensor | None:
        """The recorded experts of this layer's next ``T`` positions (``[B, T, k]``), replaying."""
        i = self._layer(moe)
        if not self.replaying:
            return None
        if i >= len(self.layers):
            raise ValueError(f"routing replay: the tape holds {len(self.layers)} MoE layers, the "
                             f"model has more")
        (rec,) = self.layers[i]
        c = self.cursor[i]
        if rec.shape[0] != B or c + T > rec.shape[1]:
            raise ValueError(f"routing replay: layer {i} recorded [{rec.shape[0]}, {rec.shape[1]}] "
                             f"positions, asked for [{B}, {c}:{c + T}]")
        self.cursor[i] = c + T
        if not self.force:
            self.pending[i] = rec[:, c : c + T]
            return None
        return rec[:, c : c + T]

    def put(self, moe, used: torch.Tensor, own: torch.Tensor) -> None:
        """A call's experts ``used [B, T, k]`` and the router's own choice ``own``."""
        i = self._layer(moe)
        if i == 0:
            self.tokens += used.shape[0] * used.shape[1]
        other = self.pending.pop(i).to(own) if self.replaying and not self.force else own
        differ = (used.sort(-1).values != other.sort(-1).values).any(-1)
        self.flips += int(differ.sum())
        if self.replaying:  # one call per layer over the whole batch (the trainer's pass)
            self.differs = differ if self.differs is None else self.differs | differ
        else:
            self.layers[i].append(used.detach().to(torch.uint8))

    def routing(self) -> list[torch.Tensor]:
        """The recorded experts per layer, ``[B, T_total, k]`` uint8."""
        return [torch.cat(parts, 1) for parts in self.layers]

    @property
    def flip_rate(self) -> float:
        """Share of (token, layer) pairs whose experts differ between the recording and the router
        (replaying) or between the router and the recording (comparing)."""
        n = self.tokens * max(len(self.layers), 1)
        return self.flips / n if n else 0.0


@contextmanager
def taped(model, routing: list[torch.Tensor] | None = None,
          force: bool = True) -> Iterator[RoutingTape]:
    """Record (``routing`` None) or replay ``routing`` on every MoE layer of ``model`` (with
    ``force`` False: route as the router does and count where it differs from ``routing``)."""
    tape = RoutingTape(routing, force)
    layers = model.moe_layers()
    for moe in layers:
        moe.tape = tape
    try:
        yield tape
    finally:
        for moe in layers:
            moe.tape = None


def restart(tape: RoutingTape) -> None:
    """Forget what a recording tape holds (the generator recomputes its cache under new weights)."""
    tape.layers = [[] for _ in tape.layers]
    tape.tokens = tape.flips = 0
