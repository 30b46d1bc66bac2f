"""What travels from the generator to the trainer, the prompts it starts from, and the staleness
bookkeeping that bounds how off-policy a group may be."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from megabase.data import InputError, TokenStore
from megabase.core.vocab import N, N_BASES

from .config import RLConfig


@dataclass
class Rollout:
    """One group: ``G`` samples of one prompt.

    ``tokens [G, S]`` int64: ``<sep>``, the prompt, the ``L`` sampled bases (``S = P + L``, ``P``
    = ``prompt_len`` including ``<sep>``); ``behaviour [G, L]``: the generator's log-prob of each
    sampled base; ``versions [G, L]``: the policy version that sampled it; ``routing``: per MoE
    layer ``[G, S, k]`` uint8, the experts each input position went to (None without replay);
    ``rewards [G]``; ``heldout``: the held-out check's per-sample figures."""

    batch: int
    prompt_id: int
    tokens: torch.Tensor
    prompt_len: int
    behaviour: torch.Tensor
    versions: torch.Tensor
    routing: list[torch.Tensor] | None
    rewards: torch.Tensor
    heldout: dict[str, np.ndarray] = field(default_factory=dict)
    reward_parts: dict[str, np.ndarray] = field(default_factory=dict)
    updates: int = 0  # weight updates taken while this group was being sampled
    seconds: float = 0.0
    state_bytes: int = 0  # the generator's state for the whole batch this group was sampled in

    @property
    def policies(self) -> int:
        """Policy versions that contributed bases to this group."""
        return int(torch.unique(self.versions).numel())


class Staleness:
    """Decides, at the trainer, whether a group is fresh enough and counts what it saw.

    A group's lag is the trainer's version minus the oldest version among its bases; past
    ``max_off_policy_steps`` it is dropped (prime-rl's rule)."""

    def __init__(self, max_off_policy_steps: int):
        self.max = max_off_policy_steps
        self.lags: Counter[int] = Counter()
        self.policies: Counter[int] = Counter()
        self.dropped = 0
        self.kept = 0

    def admit(self, rollout: Rollout, trainer_version: int) -> bool:
        lag = trainer_version - int(rollout.versions.min())
        if lag < 0:
            raise ValueError(f"a group sampled by version {int(rollout.versions.min())} reached "
                             f"the trainer at version {trainer_version}")
        self.lags[lag] += 1
        self.policies[rollout.policies] += 1
        if lag > self.max:
            self.dropped += 1
            return False
        self.kept += 1
        return True

    def summary(self) -> dict:
        return {"lag_histogram": dict(sorted(self.lags.items())),
                "policies_histogram": dict(sorted(self.policies.items())),
                "dropped": self.dropped, "kept": self.kept}


def usable(prompt: np.ndarray, max_n_frac: float) -> bool:
    """A prompt ``[length]`` (token ids) of bases and N only, at most ``max_n_frac`` of it N."""
    return bool((prompt >= N_BASES).mean() <= max_n_frac and not (prompt > N).any())


class Prompts:
    """Prompt windows of ``length`` bases: drawn uniformly from store regions (at most
    ``max_n_frac`` N), or the records of a FASTA in turn (their first ``length`` bases)."""

    def __init__(self, cfg: RLConfig):
        p = cfg.prompt
        self.length = p.length
        self.fixed: list[np.ndarray] = []
        self.spans: list[tuple[np.ndarray, int, int]] = []
        if p.fasta is not None:
            from megabase.data.fasta import read_fasta

            path = cfg.path(p.fasta)
            for record in read_fasta(str(path)):
                tokens = np.asarray(record.token_array()[: p.length])
                if len(tokens) < p.length:
                    raise InputError(f"record holds {len(tokens):,} bases, fewer than "
                                     f"prompt.length ({p.length:,})", path, record.name)
                # the rule store windows are drawn by (a prompt of 76 N was used): a record is
                # not drawn again, so one over the limit is refused
                if not usable(tokens, p.max_n_frac):
                    n = int((tokens >= N_BASES).sum())
                    raise InputError(f"the prompt (its first {p.length:,} bases) holds {n:,} N "
                                     f"({n / p.length:.0%}), more than prompt.max_n_frac "
                                     f"({p.max_n_frac:.0%}) allows", path, record.name)
                self.fixed.append(tokens)
            if not self.fixed:
                raise InputError("holds no records", path)
        else:
            from megabase.infer.common import resolve_regions

            store = TokenStore(cfg.path(p.data))
            for iv in resolve_regions(store, p.regions):
                if iv.length < p.length:
                    raise InputError(f"region {iv.spec!r} holds {iv.length:,} bases, fewer than "
                                     f"prompt.length ({p.length:,})", store.path)
                self.spans.append((store.tokens(iv.chrom), iv.start, iv.end))
        self.max_n = p.max_n_frac

    def draw(self, rng: np.random.Generator, index: int) -> np.ndarray:
        """The ``index``-th prompt ``[length]`` uint8 (A/C/G/T/N ids)."""
        if self.fixed:
            return self.fixed[index % len(self.fixed)]
        sizes = np.array([e - s - self.length + 1 for _, s, e in self.spans], dtype=np.float64)
        for _ in range(1000):
            which = int(rng.choice(len(self.spans), p=sizes / sizes.sum()))
            tokens, start, end = self.spans[which]
            at = int(rng.integers(start, end - self.length + 1))
            window = np.asarray(tokens[at : at + self.length])
            if usable(window, self.max_n):
                return window
        raise InputError(f"no prompt window of {self.length:,} bases with at most "
                         f"{self.max_n:.0%} N in 1,000 draws; raise prompt.max_n_frac or choose "
                         "other prompt.regions")
