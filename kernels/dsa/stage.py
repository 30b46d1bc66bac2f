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

from dataclasses import astuple, dataclass, fields

import torch

SUMMARIES = ("mean", "max")
MODES = ("exact",) + SUMMARIES  # exact: no candidate stage, every earlier key is scored
VW = 16  # the C kernel scores keys in vectors of VW: a block is a whole number of them


@dataclass(frozen=True)
class Stage:
    """The DSA indexer's candidate stage: ``ModelConfig.dsa_stage``, saved with a model (a loader
    may choose another), and the argument of every backend's staged indexer.

    ``summary``: ``max`` (Quest: per-channel max and min, which bound every key's index score in a
    block, the default), ``mean`` (HISA: the mean key) or ``exact`` (no stage: every earlier key,
    the reference; a model's ``cfg.stage()`` is then None and the other fields are unused);
    ``start``: the first query position it may apply to (65,536); ``block``: keys per block, a
    multiple of 16 (128); ``blocks``: blocks kept per query (64); ``local``: the least number of
    latest keys always kept (1,024); ``seed``: seed length in bases, 0 for no seeds (16);
    ``seed_cap``: earlier occurrences followed per seed and strand, the most recent (16);
    ``carry``: positions a diagonal is followed after its last seed hit (32).
    """

    summary: str = "max"
    start: int = 65536
    block: int = 128
    blocks: int = 64
    local: int = 1024
    seed: int = 16
    seed_cap: int = 16
    carry: int = 32

    def __post_init__(self) -> None:
        if self.summary not in MODES:
            raise ValueError(f"summary must be one of {', '.join(MODES)}, got {self.summary!r}")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
        if self.block < VW or self.block % VW:
            raise ValueError(f"block must be a positive multiple of {VW}, got {self.block}")
        for name in ("blocks", "local"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.seed <= 16 or self.seed in (1, 2, 3):
            raise ValueError(f"seed must be a seed length of 0 (none) or 4..16 bases, got "
                             f"{self.seed}")
        for name in ("start", "seed_cap", "carry"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def exact(self) -> bool:
        return self.summary == "exact"

    def encode(self) -> list[int]:
        """The stage as integers (a registered op's argument); :meth:`decode` inverts it."""
        return [MODES.index(self.summary), *astuple(self)[1:]]

    @classmethod
    def decode(cls, values: list[int]) -> "Stage":
        summary, *rest = values
        return cls(MODES[summary], *rest)

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
      the queries before ``stage.first_staged()`` (at its default blocks), and for every query of
      a stage whose summary is ``exact``;
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
        # summary "exact" is no stage: every query takes the exact indexer
        split = Tq if stage.exact else min(Tq, max(0, stage.first_staged() - offset))
        if split:
            # the exact indexer's own blocks: block_q here is the candidate stage's tile
            head = exact(q_idx[:, :split], k_idx, None if w_idx is None else w_idx[:, :split],
                         topk, scale, keep_recent, offset=offset)
            if split == Tq:
                return head
        summaries = summarise(k_idx, stage) if summaries is None else summaries
        tail = candidates(
            q_idx[:, split:], k_idx, None if w_idx is None else w_idx[:, split:], topk, stage,
            scale, keep_recent, offset + split, None if seeds is None else seeds[:, split:],
            summaries, block_q)
        return torch.cat([head, tail], dim=1) if split else tail

    return staged_indexer
