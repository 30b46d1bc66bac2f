"""The DeepSeek Sparse Attention mixer (DESIGN.md, Model): lightning indexer, top-k, sparse softmax."""

from __future__ import annotations

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
from .layers import Linear, RMSNorm


class DSALayer(nn.Module):
    """``[B, T, d] -> [B, T, d]``: each token attends to ``topk`` earlier tokens chosen by an indexer.

    Main attention: ``dsa_heads`` query heads over ``dsa_kv_heads`` key/value heads (GQA) with
    QK-RMSNorm and no positional encoding. Indexer: ``index_heads`` queries of ``index_dim``, one
    shared index key per token, per-head weights; it reads a detached copy of the layer input, so it
    learns only from its KL loss (``indexer_mode``: ``dense`` warm-up against full causal attention,
    or ``sparse`` on the selected set), returned as the auxiliary loss while training.
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

    def forward(self, x: torch.Tensor, state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(y, aux_loss)``; with ``state`` it attends over cached keys and extends the cache."""
        B, T, _ = x.shape
        q, k, v, qi, ki, wi = self.project(x)
        offset = 0
        if state is not None and "k" in state:
            offset = state["k"].shape[1]
            k, v, ki = (torch.cat([state[n], t], dim=1) for n, t in (("k", k), ("v", v), ("ki", ki)))
        if state is not None:
            state["k"], state["v"], state["ki"] = k, v, ki
        if self.cfg.indexer_mode == "dense" and state is None:
            o, aux = self.attend_dense(q, k, v, qi, ki, wi)
        else:
            o, aux = self.attend(q, k, v, qi, ki, wi, offset)
        return self.o_proj(o.reshape(B, T, self.HQ * self.D)), aux

    def project(self, x: torch.Tensor):
        """``x [B, T, d]`` -> ``(q [B,T,HQ,D], k, v [B,T,H,D], q_idx [B,T,IH,ID], k_idx [B,T,ID],
        w_idx [B,T,IH])``; the indexer reads a detached ``x``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.HQ, self.D))
        k, v = self.kv_proj(x).reshape(B, T, 2, self.H, self.D).unbind(2)
        k = self.k_norm(k)
        xi = x.detach()
        qi = self.qi_proj(xi).reshape(B, T, cfg.index_heads, cfg.index_dim)
        ki = self.ki_norm(self.ki_proj(xi))
        wi = self.wi_proj(xi) * cfg.index_heads**-0.5
        return q, k, v, qi, ki, wi

    def _train_indexer(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def attend(self, q, k, v, qi, ki, wi, offset: int = 0):
        """Sparse attention of queries at positions ``offset..offset+Tq`` over keys ``0..Tk``:
        ``(o [B, Tq, HQ, D], indexer_loss_weight * KL averaged over the queries, or 0)``."""
        cfg = self.cfg
        backend = cfg.dsa_backend
        idx = dsa_indexer_op(qi, ki, wi, cfg.topk, cfg.keep_recent, cfg.dsa_block, offset, backend)
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
