"""The indexer's candidate stage in plain PyTorch: the reference of the C kernel (``indexer.c``).

The exact indexer scores every earlier key, O(T) per query. From position ``Stage.start`` on, a
query at position ``t`` scores only its candidates, O(T / block + blocks * block + local) keys:

* the local window: keys ``L(t) .. t``, ``L(t) = block * floor((t + 1 - local) / block)``, so
  between ``local`` and ``local + block - 1`` of the latest keys, always;
* the best ``blocks`` blocks: the keys before ``L(t)`` fall into whole blocks of ``block`` keys
  (aligned to position 0), each with a summary of its index keys that the query scores first.
  ``mean`` (HISA): the mean key, scored as a key is. ``max`` (Quest): per-channel max and min,
  which bound ``q . k`` over the block from above (and below), so with the ReLU and the sign of
  each head's weight they bound every key's index score in it: a lone spike is not averaged
  away;
* the seeds (:mod:`.seeds`): keys that follow an earlier occurrence of the query's last
  ``seed`` bases, forward or reverse complement, carried along the diagonal.

The exact index scores of the candidates then give the top-k in the exact indexer's order (score
desc, position desc). Where the blocks before ``L(t)`` are at most ``blocks`` (and before
``start``) every key is a candidate: the stage *is* the exact indexer there, so short sequences
are unchanged. Everything is a function of the query's position, the keys and the tokens, never
of how a sequence is cut into pieces: streaming, decoding and context parallelism select what the
full pass selects.

Shapes: ``summaries [B, Tk // block, R, DI]`` (``R`` = 1 for ``mean``, 2 for ``max``: max then
min), ``seeds [B, Tq, S]`` key positions (-1 padded), others as the exact indexer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megabase.kernels.precision import full_precision

from .reference import _MIN_KEY, _NEG_INF_KEY, _composite, dsa_indexer

SUMMARIES = ("mean", "max")
VW = 16  # the C kernel scores keys in vectors of VW: a block is a whole number of them


@dataclass(frozen=True)
class Stage:
    """Where the candidate stage applies and what it keeps (the defaults live in one place,
    ``ModelConfig``'s ``dsa_stage*`` fields: ``ModelConfig().stage()``).

    ``summary``: ``mean`` or ``max`` (see module docs); ``start``: the first query position it
    may apply to; ``block``: keys per block (a multiple of 16); ``blocks``: blocks kept per
    query; ``local``: the least number of latest keys always kept; ``seed``: seed length in
    bases (0: no seeds), ``seed_cap``: earlier occurrences followed per seed and strand (the most
    recent), ``carry``: positions a diagonal is followed after its last seed hit.
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


@torch.no_grad()
@full_precision
def block_summaries(k_idx: torch.Tensor, stage: Stage) -> torch.Tensor:
    """``k_idx [B, Tk, DI]`` -> ``[B, Tk // block, R, DI]``: the summary of every whole block."""
    B, Tk, DI = k_idx.shape
    n = Tk // stage.block
    blocks = k_idx[:, : n * stage.block].float().reshape(B, n, stage.block, DI)
    if stage.summary == "mean":
        return blocks.mean(2, keepdim=True)
    return torch.stack([blocks.amax(2), blocks.amin(2)], dim=2)


def summary_scores(qs: torch.Tensor, w: torch.Tensor | None, summaries: torch.Tensor,
                   summary: str) -> torch.Tensor:
    """``qs [B, bq, HI, DI]`` (scaled queries), ``w [B, bq, HI]``, ``summaries [B, n, R, DI]``
    -> ``[B, bq, n]``: each block's score (``mean``) or upper bound of its keys' scores (``max``)."""
    w = torch.ones(qs.shape[:3], dtype=qs.dtype, device=qs.device) if w is None else w
    if summary == "mean":
        s = torch.einsum("bqhd,bnd->bqhn", qs, summaries[:, :, 0])
        return (s.clamp(min=0) * w[..., None]).sum(2)
    top, bottom = summaries[:, :, 0], summaries[:, :, 1]
    pos, neg = qs.clamp(min=0), qs.clamp(max=0)
    hi = torch.einsum("bqhd,bnd->bqhn", pos, top) + torch.einsum("bqhd,bnd->bqhn", neg, bottom)
    lo = torch.einsum("bqhd,bnd->bqhn", pos, bottom) + torch.einsum("bqhd,bnd->bqhn", neg, top)
    w = w[..., None]
    return torch.where(w >= 0, w * hi.clamp(min=0), w * lo.clamp(min=0)).sum(2)


@torch.no_grad()
@full_precision
def staged_indexer(q_idx, k_idx, w_idx, topk: int, stage: Stage, scale=None,
                   keep_recent: int = 0, offset: int = 0, seeds: torch.Tensor | None = None,
                   summaries: torch.Tensor | None = None, block_q: int = 32) -> torch.Tensor:
    """Top-k keys per query with the candidate stage: ``indices [B, Tq, topk]``, ascending, -1
    padded. Queries before ``stage.first_staged()`` take the exact indexer (they are the same
    there); ``seeds`` and ``summaries`` as in the module docs (``summaries`` computed when None).
    ``block_q`` queries at a time: memory ``block_q * (blocks * block + local + Tk / block)``."""
    B, Tq, HI, DI = q_idx.shape
    scale = DI**-0.5 if scale is None else scale
    split = min(Tq, max(0, stage.first_staged() - offset))
    out = torch.full((B, Tq, topk), -1, dtype=torch.long, device=q_idx.device)
    if split:
        out[:, :split] = dsa_indexer(q_idx[:, :split], k_idx, None if w_idx is None else
                                     w_idx[:, :split], topk, scale, keep_recent, offset=offset)
    if split == Tq:
        return out
    if summaries is None:
        summaries = block_summaries(k_idx, stage)
    keys = k_idx.float()
    for q0 in range(split, Tq, block_q):
        rows = slice(q0, min(q0 + block_q, Tq))
        w = None if w_idx is None else w_idx[:, rows].float()
        pos = torch.arange(rows.start, rows.stop, device=q_idx.device) + offset
        cand = _candidates(q_idx[:, rows].float() * scale, w, summaries, pos, stage,
                           None if seeds is None else seeds[:, rows])
        out[:, rows] = _top(q_idx[:, rows].float() * scale, w, keys, cand, pos, topk, keep_recent)
    return out


def _candidates(qs, w, summaries, pos, stage: Stage, seeds):
    """``[B, bq, C]`` candidate key positions of the queries at ``pos`` (-1: none), no repeats."""
    B, bq = qs.shape[:2]
    local0 = stage.local_start(pos)  # [bq]
    eligible = local0 // stage.block
    scores = summary_scores(qs, w, summaries, stage.summary)
    n = scores.shape[-1]
    blk = torch.arange(n, device=qs.device)
    key = _composite(scores, blk).masked_fill(blk >= eligible[:, None], _MIN_KEY)
    chosen = key.topk(min(stage.blocks, n), dim=-1).values & 0xFFFFFFFF  # [B, bq, blocks]
    spread = torch.arange(stage.block, device=qs.device)
    from_blocks = (chosen[..., None] * stage.block + spread).flatten(2)
    width = stage.local + stage.block
    local = local0[:, None] + torch.arange(width, device=qs.device)
    local = local.masked_fill(local > pos[:, None], -1).expand(B, bq, width)
    parts = [from_blocks, local]
    if seeds is not None and seeds.shape[-1]:
        s = seeds.long()
        covered = (s[..., None] // stage.block == chosen[..., None, :]).any(-1)
        covered |= s >= local0[:, None]
        parts.append(s.masked_fill(covered | (s < 0), -1))
    return torch.cat(parts, dim=-1)


def _top(qs, w, keys, cand, pos, topk: int, keep_recent: int):
    """The top ``topk`` of the candidates by exact index score, as the exact indexer orders them."""
    B, bq, C = cand.shape
    valid = cand >= 0
    flat = (cand.clamp(min=0) + torch.arange(B, device=cand.device)[:, None, None] * keys.shape[1])
    k = keys.reshape(-1, keys.shape[-1]).index_select(0, flat.reshape(-1)).reshape(B, bq, C, -1)
    s = torch.einsum("bqhd,bqcd->bqhc", qs, k).clamp(min=0)
    s = s.sum(2) if w is None else (s * w[..., None]).sum(2)
    if keep_recent:
        s = s.masked_fill(cand > pos[:, None] - keep_recent, float("inf"))
    s = s.masked_fill(~valid, float("-inf"))
    best = _composite(s, cand.clamp(min=0)).masked_fill(~valid, _MIN_KEY)
    best = best.topk(min(topk, C), dim=-1).values
    idx = (best & 0xFFFFFFFF).masked_fill((best >> 32) <= _NEG_INF_KEY, -1)
    idx = torch.where(idx < 0, torch.full_like(idx, 1 << 40), idx).sort(-1).values
    idx = idx.masked_fill(idx == 1 << 40, -1)
    out = torch.full((B, bq, topk), -1, dtype=torch.long, device=cand.device)
    out[..., : idx.shape[-1]] = idx
    return out
