"""Exact k-mer embeddings of the bases before each position (the model's input, beside the token)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megabase.core.vocab import N_BASES, PAD


class KmerEmbedding(nn.Module):
    """``sum_{k=2..n} E_k[code_k(t)]``: for each ``k``, an embedding of the exact ``k`` bases ending
    at position ``t`` (one row per k-mer, ``4^k``, and one more for a k-mer that holds a token other
    than A/C/G/T). ``forward(ids [B, T], tail [B, n - 1] or None) -> [B, T, d]``; ``tail`` holds the
    tokens before ``ids`` (``<pad>`` where there are none), so a streamed sequence embeds as its
    full pass does. Rows start at zero: the model starts as the plain token embedding.
    """

    def __init__(self, n: int, d: int):
        super().__init__()
        self.n = n
        sizes = [N_BASES**k + 1 for k in range(2, n + 1)]
        # first row of each k's table (plain ints, not a buffer: nothing to move or to initialise
        # when a loader builds the module on the meta device, as transformers does)
        self.offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        self.table = nn.Parameter(torch.zeros(sum(sizes), d))

    def tail(self, ids: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        """The last ``n - 1`` tokens of ``tail`` + ``ids``: the ``tail`` of the next piece."""
        return self._extended(ids, tail)[:, ids.shape[1] :]

    def _extended(self, ids: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        if tail is None:
            tail = torch.full((ids.shape[0], self.n - 1), PAD, dtype=torch.long, device=ids.device)
        return torch.cat([tail.long(), ids.long()], dim=1)

    def rows(self, ids: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """Table rows ``[B, T, n - 1]`` of the k-mers ending at each position, k = 2..n."""
        T = ids.shape[1]
        ext = self._extended(ids, tail)  # ext[:, n - 1 + t] is ids[:, t]
        code = torch.zeros_like(ids, dtype=torch.long)
        valid = torch.ones_like(ids, dtype=torch.bool)
        out = []
        for k in range(1, self.n + 1):
            tok = ext[:, self.n - k : self.n - k + T]
            valid = valid & (tok < N_BASES)
            code = code + tok.clamp(max=N_BASES - 1) * N_BASES ** (k - 1)
            if k >= 2:
                out.append(self.offsets[k - 2] + torch.where(valid, code, N_BASES**k))
        return torch.stack(out, dim=-1)

    def forward(self, ids: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        B, T = ids.shape
        rows = self.rows(ids, tail).reshape(B * T, -1)
        return F.embedding_bag(rows, self.table, mode="sum").reshape(B, T, -1)
