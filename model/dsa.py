"""The DeepSeek Sparse Attention mixer (DESIGN.md, Model): lightning indexer, top-k, sparse softmax."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from megabase.kernels.dsa import (
    dsa_indexer_op,
    indexer_kl_dense,
    indexer_kl_sparse,
    sparse_attention,
)

from .config import ModelConfig
from .layers import Linear, RMSNorm, ShortConv


class DSALayer(nn.Module):
    """``[B, T, d] -> [B, T, d]``: each token attends to ``topk`` earlier tokens chosen by an indexer.

    Main attention: ``dsa_heads`` query heads over ``dsa_kv_heads`` key/value heads (GQA) with
    QK-RMSNorm and no positional encoding. Indexer: ``index_heads`` queries of ``index_dim``, one
    shared index key per token, per-head weights; it reads a detached copy of the layer input, so it
    learns only from its KL loss (``indexer_mode``: ``dense`` warm-up against full causal attention,
    or ``sparse`` on the selected set), returned as the auxiliary loss while training.

    With ``dsa_conv > 0`` the projections (q, k, v, index q, index k) pass through a causal
    depthwise conv of that width + SiLU, as KDA's do: a key can then carry the bases just before
    its token, which is what a copying (induction) head matches a query's recent bases against
    (short convs before attention are what lets small models learn associative recall fast:
    Arora et al. 2023, "Zoology"; Allen-Zhu 2025, "Canon layers").
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.HQ, self.H, self.D = cfg.dsa_heads, cfg.dsa_kv_heads, cfg.dsa_head_dim
        self.q_proj = Linear(d, self.HQ * self.D)
        self.kv_proj = Linear(d, 2 * self.H * self.D)
        self.q_norm, self.k_norm = RMSNorm(self.D, cfg.norm_eps), RMSNorm(self.D, cfg.norm_eps)
        self.qi_proj = Linear(d, cfg.index_heads * cfg.index_dim)
        self.ki_proj = Linear(d, cfg.index_dim)
        self.ki_norm = RMSNorm(cfg.index_dim, cfg.norm_eps)
        self.wi_proj = Linear(d, cfg.index_heads)
        self.o_proj = Linear(self.HQ * self.D, d)
        self.widths = [self.HQ * self.D, self.H * self.D, self.H * self.D,
                       cfg.index_heads * cfg.index_dim, cfg.index_dim]
        self.conv = ShortConv(sum(self.widths), cfg.dsa_conv) if cfg.dsa_conv else None
        self.dense_warmup = False  # set by the trainer: dense attention whatever indexer_mode says
        self.capture: SelectionCapture | None = None  # set by capture_selections (diagnostics)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(y, aux_loss)``; with ``state`` it attends over cached keys and extends the cache."""
        B, T, _ = x.shape
        q, k, v, qi, ki, wi, tail = self.features(self.projections(x), x,
                                                  None if state is None else state.get("conv"))
        if state is not None and tail is not None:
            state["conv"] = tail
        offset = 0
        if state is not None and "k" in state:
            offset = state["k"].shape[1]
            k, v, ki = (torch.cat([state[n], t], dim=1) for n, t in (("k", k), ("v", v), ("ki", ki)))
        if state is not None:
            state["k"], state["v"], state["ki"] = k, v, ki
        if (self.cfg.indexer_mode == "dense" or self.dense_warmup) and state is None:
            o, aux = self.attend_dense(q, k, v, qi, ki, wi)
        else:
            o, aux = self.attend(q, k, v, qi, ki, wi, offset)
        return self.o_proj(o.reshape(B, T, self.HQ * self.D)), aux

    def projections(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]`` -> the pre-conv projections ``[B, T, sum(widths)]`` (q, k, v, index q,
        index k); the indexer's read a detached ``x``."""
        xi = x.detach()
        return torch.cat([self.q_proj(x), self.kv_proj(x), self.qi_proj(xi), self.ki_proj(xi)], -1)

    def features(self, pre: torch.Tensor, x: torch.Tensor, tail: torch.Tensor | None = None):
        """Pre-conv projections ``pre`` of ``x [B, T, d]`` (and the last ``dsa_conv - 1`` rows
        before them, ``tail``) -> ``(q [B,T,HQ,D], k, v [B,T,H,D], q_idx [B,T,IH,ID],
        k_idx [B,T,ID], w_idx [B,T,IH], new_tail)``."""
        cfg = self.cfg
        B, T, _ = x.shape
        if self.conv is not None:
            pre, tail = self.conv(pre, tail)
        q, k, v, qi, ki = pre.split(self.widths, dim=-1)
        q = self.q_norm(q.reshape(B, T, self.HQ, self.D))
        k, v = self.k_norm(k.reshape(B, T, self.H, self.D)), v.reshape(B, T, self.H, self.D)
        qi = qi.reshape(B, T, cfg.index_heads, cfg.index_dim)
        ki = self.ki_norm(ki)
        wi = self.wi_proj(x.detach()) * cfg.index_heads**-0.5
        return q, k, v, qi, ki, wi, tail

    def _train_indexer(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def attend(self, q, k, v, qi, ki, wi, offset: int = 0):
        """Sparse attention of queries at positions ``offset..offset+Tq`` over keys ``0..Tk``:
        ``(o [B, Tq, HQ, D], indexer_loss_weight * KL averaged over the queries, or 0)``."""
        cfg = self.cfg
        backend = cfg.dsa_backend
        idx = dsa_indexer_op(qi, ki, wi, cfg.topk, cfg.keep_recent, cfg.dsa_block, offset, backend)
        if self.capture is not None:
            self.capture.add(idx, offset)
        if not self._train_indexer():
            o = sparse_attention(q, k, v, idx, block_q=cfg.dsa_block, backend=backend)
            return o, q.new_zeros((), dtype=torch.float)
        o, p = sparse_attention(q, k, v, idx, block_q=cfg.dsa_block, return_probs=True,
                                backend=backend)
        return o, cfg.indexer_loss_weight * indexer_kl_sparse(qi, ki, wi, idx, p, backend=backend)

    def attend_dense(self, q, k, v, qi, ki, wi):
        """The indexer warm-up: dense causal attention, the indexer trained toward its weights."""
        rep = self.HQ // self.H
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
            v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
        aux = q.new_zeros((), dtype=torch.float)
        if self._train_indexer():
            aux = self.cfg.indexer_loss_weight * indexer_kl_dense(q.detach(), k.detach(), qi, ki, wi,
                                                                  block_q=self.cfg.dsa_block)
        return o, aux


class SelectionCapture:
    """The top-k selections of one DSA layer for the queries at positions ``[lo, hi)`` of the first
    sequence of a batch: ``rows [hi - lo, topk]`` (key positions, -1 padded), filled as the layer
    runs, also when a sequence is streamed piece by piece."""

    def __init__(self, lo: int, hi: int, topk: int):
        self.lo, self.hi = lo, hi
        self.rows = np.full((hi - lo, topk), -1, dtype=np.int64)
        self.seen = np.zeros(hi - lo, dtype=bool)

    def add(self, idx: torch.Tensor, offset: int) -> None:
        a, b = max(self.lo, offset), min(self.hi, offset + idx.shape[1])
        if a < b:
            self.rows[a - self.lo : b - self.lo] = idx[0, a - offset : b - offset].cpu().numpy()
            self.seen[a - self.lo : b - self.lo] = True


@contextmanager
def capture_selections(model, lo: int, hi: int):
    """Record every DSA layer's top-k for query positions ``[lo, hi)`` while the block runs:
    yields one :class:`SelectionCapture` per DSA layer (in layer order)."""
    layers = [m for m in model.modules() if isinstance(m, DSALayer)]
    captures = [SelectionCapture(lo, hi, layer.cfg.topk) for layer in layers]
    for layer, cap in zip(layers, captures):
        layer.capture = cap
    try:
        yield captures
    finally:
        for layer in layers:
            layer.capture = None
