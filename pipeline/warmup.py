"""The sequence-length warm-up: short windows first, doubling up to ``data.window_length``.

Lengths ``seq_warmup_start * 2**k`` for ``k = 0 .. n-1`` (those below the window length), then the
window length. Each shorter length lasts ``train.seq_warmup_steps`` optimizer steps, and ends
sooner where the run could not otherwise reach its window length:

- in steps, when the ``n`` shorter lengths' steps would fill all of ``train.steps`` (a 1,048,576
  window from 2,048 is nine lengths: 150 steps each is 1,350, more than the human protocol's 800):
  length ``k`` then ends by step ``(k + 1) * steps / (2n)``, the warm-up in the first half;
- in time, under ``train.max_minutes``: length ``k`` ends by minute ``(k + 1) * max_minutes /
  (2n)`` of training. A step's cost grows with its length (about 21 minutes at 1,048,576 on 2
  cores), so 150 steps a length would spend an hour's cap on the short ones.

A shorter step trains on a crop of each window (:func:`crop`): its first tokens, or where those are
mostly ``N`` (a window may hold ``data.max_n_frac`` of them, a 2,048-token head all of them: a step
with no loss at all) the stretch with the most bases.

With no cap the schedule is a function of the step alone. Under a cap it depends on the machine's
speed, so the step at which each length began is kept (:meth:`state_dict`, in the training
checkpoint) and a resumed run goes on from it; with several processes rank 0's clock decides.
"""

from __future__ import annotations

import torch

from .config import RunConfig


class LengthWarmup:
    """The training length per optimizer step; :meth:`advance` after each step moves it on.

    ``lengths``: the warm-up's lengths, the window length last; ``starts[k]``: the step at which
    ``lengths[k]`` began (as far as reached)."""

    def __init__(self, cfg: RunConfig):
        t, full = cfg.train, cfg.data.window_length
        self.lengths = [full]
        if t.seq_warmup:
            self.lengths = []
            length = t.seq_warmup_start
            while length < full:
                self.lengths.append(length)
                length *= 2
            self.lengths.append(full)
        self.per_length, self.steps, self.minutes = t.seq_warmup_steps, t.steps, t.max_minutes
        self.starts = [0]

    @property
    def n(self) -> int:
        """How many lengths are shorter than the window."""
        return len(self.lengths) - 1

    @property
    def length(self) -> int:
        """The length of the next step."""
        return self.lengths[len(self.starts) - 1]

    def _step_bound(self, k: int) -> float:
        if self.n * self.per_length < self.steps:
            return float("inf")
        return (k + 1) * self.steps / (2 * self.n)

    def _ends(self, k: int, step: int, minutes: float | None) -> bool:
        if step - self.starts[k] >= self.per_length or step >= self._step_bound(k):
            return True
        return self.minutes is not None and minutes is not None and \
            minutes >= (k + 1) * self.minutes / (2 * self.n)

    def advance(self, step: int, minutes: float | None = None) -> int:
        """After ``step`` optimizer steps, ``minutes`` of training: the length of the next step
        (one or more shorter lengths are passed over where their bounds are already behind)."""
        while len(self.starts) <= self.n and self._ends(len(self.starts) - 1, step, minutes):
            self.starts.append(step)
        return self.length

    def at(self, step: int) -> int:
        """The length at ``step`` as far as the schedule has gone."""
        k = max(i for i, s in enumerate(self.starts) if s <= step)
        return self.lengths[k]

    def tokens_left(self, step: int, steps: int) -> int:
        """Tokens a window of steps ``step .. steps - 1`` (``step`` done so far), as the schedule
        stands and by its step bounds ahead: a time bound ends a length sooner, never later, so
        this is at most what is left."""
        plan = LengthWarmup.__new__(LengthWarmup)
        plan.__dict__.update(self.__dict__, starts=list(self.starts), minutes=None)
        total = 0
        for s in range(step, steps):
            total += plan.length
            plan.advance(s + 1)
        return total

    def state_dict(self) -> dict:
        return {"lengths": list(self.lengths), "starts": list(self.starts)}

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """The schedule of a checkpoint written at ``step``; one from before the schedule was saved
        (or of other lengths: a run resumed with a new window) is replayed by steps alone."""
        if state and state.get("lengths") == self.lengths:
            self.starts = list(state["starts"])
            return
        self.starts = [0]
        for s in range(step + 1):
            self.advance(s)


def window_length_at(step: int, cfg: RunConfig) -> int:
    """Training length at optimizer step ``step`` with the schedule's step bounds alone (no
    ``max_minutes``): what a run without a time cap trains at."""
    warm = LengthWarmup(cfg)
    for s in range(step + 1):
        warm.advance(s)
    return warm.at(step)


def crop(ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, length: int,
         max_n_frac: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``length`` tokens of each window: ``ids``, ``targets``, ``mask`` (``loss_mask``) ``[B, L]``
    -> ``[B, length]``. A row's first ``length`` tokens, unless more than ``max_n_frac`` of their
    targets are not bases (the windows' own rule, ``data.max_n_frac``): then its ``length``
    tokens with the most bases, the earliest of equals. A function of the batch alone, so a
    resumed run and every rank of a context group crop alike."""
    if length >= mask.shape[1]:
        return ids, targets, mask
    head = mask[:, :length].sum(1)
    poor = head < (1 - max_n_frac) * length
    if not bool(poor.any()):
        return ids[:, :length], targets[:, :length], mask[:, :length]
    sums = torch.nn.functional.pad(mask.long().cumsum(1), (1, 0))  # [B, L + 1]
    best = (sums[:, length:] - sums[:, :-length]).argmax(1)  # first of the maxima
    at = torch.where(poor, best, torch.zeros_like(best))[:, None] + torch.arange(length, device=mask.device)
    return ids.gather(1, at), targets.gather(1, at), mask.gather(1, at)
