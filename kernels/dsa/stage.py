"""The indexer's candidate stage as a configuration (:class:`Stage`), and the split of a query range
that every backend shares (:func:`with_stage`).

The exact indexer scores every earlier key, O(T) per query. From ``Stage.first_staged()`` on a
query at position ``t`` scores only its candidates, O(T / block + blocks * block + local) keys:
the local window, the best ``blocks`` blocks by their summaries and the seeds
(:mod:`megabase.kernels.dsa.reference` defines them). Before that position the candidates are
every key, so the exact indexer runs there: short sequences are unchanged. Everything is a
function of a query's position, the keys and the tokens, never of how a sequence is cut into
pieces: streaming, decoding and context parallelism select what the full pass selects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUMMARIES = ("mean", "max")
VW = 16  # the C kernel scores keys in vectors of VW: a block is a whole number of them


@dataclass(frozen=True)
class Stage:
    """Where the candidate stage applies and what it keeps (the defaults live in one place,
    ``ModelConfig``'s ``dsa_stage*`` fields: ``ModelConfig().stage()``).

    ``summary``: ``mean`` (HISA: the mean key) or ``max`` (Quest: per-channel max and min, which
    bound every key's index score in a block); ``start``: the first query position it may apply
    to; ``block``: keys per block (a multiple of 16); ``blocks``: blocks kept per query;
    ``local``: the least number of latest keys always kept; ``seed``: seed length in bases (0: no
    seeds), ``seed_cap``: earlier occurrences followed per seed and strand (the most recent),
    ``carry``: positions a diagonal is followed after its last seed hit.
    """

    summary: str
    start: int
    block: int
    blocks: int
    local: int
    seed: int
    seed_cap: int
    carry: int

    def __post_init__(self) -> None:
        if self.summary not in SUMMARIES:
            raise ValueError(f"candidate summary must be one of {', '.join(SUMMARIES)}, got "
                             f"{self.summary!r}")
        if self.block < VW or self.block % VW:
            raise ValueError(f"candidate block must be a positive multiple of {VW}, got {self.block}")
        for name in ("blocks", "local"):
            if getattr(self, name) < 1:
                raise ValueError(f"candidate {name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.seed <= 16 or self.seed in (1, 2, 3):
            raise ValueError(f"seed length must be 0 (none) or 4..16 bases, got {self.seed}")
        for name in ("start", "seed_cap", "carry"):
            if getattr(self, name) < 0:
                raise ValueError(f"candidate {name} must be >= 0, got {getattr(self, name)}")

    def encode(self) -> list[int]:
        """The stage as integers (a registered op's argument); :meth:`decode` inverts it."""
        return [SUMMARIES.index(self.summary), self.start, self.block, self.blocks, self.local,
                self.seed, self.seed_cap, self.carry]

    @classmethod
    def decode(cls, values: list[int]) -> "Stage":
        summary, *rest = values
        return cls(SUMMARIES[summary], *rest)

    @property
    def rows(self) -> int:
        """Summary vectors per block (``R``)."""
        return 2 if self.summary == "max" else 1

    @property
    def max_seeds(self) -> int:
        """Seed candidates kept per query, at most."""
        return 2 * self.seed_cap if self.seed else 0

    def first_staged(self) -> int:
        """The first query position whose candidates are not every key: from there the blocks
        before the local window outnumber ``blocks`` (and the position is past ``start``)."""
        return max(self.start, (self.blocks + 1) * self.block + self.local - 1)

    def local_start(self, t: torch.Tensor) -> torch.Tensor:
        """``L(t)``: the first key of the local window of queries at positions ``t``."""
        return ((t + 1 - self.local).clamp(min=0) // self.block) * self.block


def with_stage(exact, summarise, candidates):
    """A backend's indexer with the candidate stage, built from its three parts (so the split of
    the queries is written once, here):

    * ``exact(q_idx, k_idx, w_idx, topk, scale, keep_recent, offset=...)``: its exact indexer, for
      the queries before ``stage.first_staged()`` (at its default blocks);
    * ``summarise(k_idx [B, Tk, DI], stage) -> [B, Tk // block, R, DI]``: its block summaries;
    * ``candidates(q_idx, k_idx, w_idx, topk, stage, scale, keep_recent, offset, seeds,
      summaries, block_q)``: the staged queries' top-k among their candidates (every query at
      or past ``stage.first_staged()``, ``scale`` a number, ``summaries`` given).
    """

    @torch.no_grad()
    def staged_indexer(q_idx, k_idx, w_idx, topk: int, stage: Stage, scale=None,
                       keep_recent: int = 0, offset: int = 0, seeds=None, summaries=None,
                       block_q: int | None = None) -> torch.Tensor:
        """Top-k keys per query with the candidate stage: ``indices [B, Tq, topk]``, ascending,
        -1 padded, for ``q_idx [B, Tq, HI, DI]`` at positions ``offset .. offset + Tq`` of
        ``k_idx [B, Tk, DI]``, ``w_idx [B, Tq, HI]`` or None. ``seeds [B, Tq, S]`` (None: no
        seeds), ``summaries [B, Tk // block, R, DI]`` (computed when None); ``block_q``: the
        candidate stage's query tile (None: the backend's default)."""
        if keep_recent > stage.local:
            raise ValueError(f"keep_recent ({keep_recent}) must not exceed the candidate stage's "
                             f"local window ({stage.local})")
        if seeds is not None and tuple(seeds.shape[:2]) != tuple(q_idx.shape[:2]):
            raise ValueError(f"seeds {tuple(seeds.shape)} do not match the queries "
                             f"{tuple(q_idx.shape)}")
        B, Tq, _, DI = q_idx.shape
        scale = DI**-0.5 if scale is None else scale
        split = min(Tq, max(0, stage.first_staged() - offset))
        out = torch.full((B, Tq, topk), -1, dtype=torch.long, device=q_idx.device)
        if split:
            # the exact indexer's own blocks: block_q here is the candidate stage's tile
            out[:, :split] = exact(q_idx[:, :split], k_idx, None if w_idx is None else
                                   w_idx[:, :split], topk, scale, keep_recent, offset=offset)
        if split == Tq:
            return out
        summaries = summarise(k_idx, stage) if summaries is None else summaries
        out[:, split:] = candidates(
            q_idx[:, split:], k_idx, None if w_idx is None else w_idx[:, split:], topk, stage,
            scale, keep_recent, offset + split, None if seeds is None else seeds[:, split:],
            summaries, block_q)
        return out

    return staged_indexer
