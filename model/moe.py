"""Mixture-of-Experts FFN (DESIGN.md, Model): sigmoid router, balancing bias, shared expert, chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .layers import ROW_TILE, Linear, SwiGLU, tiled_matmul

EXPERT_TILE = 64  # an expert sees ~ROW_TILE * k / E rows of a group: small tiles waste less padding


class MoE(nn.Module):
    """``[B, T, d] -> ([B, T, d], aux_loss, load [E])``.

    Router: ``s = sigmoid(x W_r)`` (fp32); each token takes the ``experts_per_token`` experts with
    the highest ``s + bias``; gates are the selected ``s`` normalised to sum 1, times
    ``routed_scale``. ``bias`` only steers selection and is moved by :meth:`update_bias`
    (aux-loss-free balancing); ``seq_aux_weight`` adds DeepSeek-V3's sequence-wise balance loss.
    One shared SwiGLU expert sees every token. Tokens run through in chunks of ``moe_chunk``
    (checkpointed under autograd), so expert activations never exist for the whole sequence.
    ``load`` counts routed tokens per expert over the whole input (no gradient).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, E, h = cfg.d_model, cfg.n_experts, cfg.expert_dim
        self.cfg = cfg
        self.router = Linear(d, E)
        self.register_buffer("bias", torch.zeros(E))
        self.w13 = nn.Parameter(torch.randn(E, d, 2 * h) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, h, d) * h**-0.5)
        self.shared = SwiGLU(d, cfg.shared_expert_dim) if cfg.shared_expert_dim else None

    def _route(self, x: torch.Tensor):
        """``x [n, d]`` -> (scores [n, E] fp32, selected experts [n, k], gates [n, k])."""
        scores = torch.sigmoid(self.router(x).float())
        sel = (scores.detach() + self.bias).topk(self.cfg.experts_per_token, dim=-1).indices
        gates = scores.gather(-1, sel)
        gates = gates / gates.sum(-1, keepdim=True) * self.cfg.routed_scale
        return scores, sel, gates

    def _chunk(self, x: torch.Tensor):
        """One chunk ``[n, d]`` -> (out [n, d], load [E], normalised score sum [E])."""
        E = self.cfg.n_experts
        scores, sel, gates = self._route(x)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        # Dispatch per aligned group of ROW_TILE tokens: a token's place in its expert's batch then
        # depends only on the tokens before it in its group (see layers.py: canonical shapes).
        parts = []
        for g in range(0, x.shape[0], ROW_TILE):
            xg, sg, gg, yg = (t[g : g + ROW_TILE] for t in (x, sel, gates, out))
            for e in range(E):
                rows, slot = (sg == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                a, b = tiled_matmul(xg.index_select(0, rows), self.w13[e].t(), EXPERT_TILE).chunk(
                    2, dim=-1)
                y = tiled_matmul(F.silu(a) * b, self.w2[e].t(), EXPERT_TILE)
                yg = yg.index_add(0, rows, (y * gg[rows, slot, None].to(y.dtype)).to(yg.dtype))
            parts.append(yg)
        load = torch.bincount(sel.flatten(), minlength=E).float()
        share = (scores / scores.sum(-1, keepdim=True)).sum(0)
        return torch.cat(parts) if parts else out, load, share

    def forward(self, x: torch.Tensor):
        B, T, d = x.shape
        E, k, chunk = self.cfg.n_experts, self.cfg.experts_per_token, self.cfg.moe_chunk
        outs, aux = [], x.new_zeros((), dtype=torch.float)
        load = torch.zeros(E, device=x.device)
        for b in range(B):
            seq_load = torch.zeros(E, device=x.device)
            seq_share = torch.zeros(E, device=x.device)
            for s in range(0, T, chunk):
                xc = x[b, s : s + chunk]
                if torch.is_grad_enabled() and T > chunk:
                    y, cnt, share = checkpoint(self._chunk, xc, use_reentrant=False)
                else:
                    y, cnt, share = self._chunk(xc)
                outs.append(y)
                seq_load, seq_share = seq_load + cnt, seq_share + share
            load = load + seq_load
            if self.cfg.seq_aux_weight > 0 and T > 0:
                f = seq_load * E / (k * T)
                aux = aux + self.cfg.seq_aux_weight * (f * seq_share / T).sum() / B
        y = torch.cat(outs, dim=0).reshape(B, T, d) if outs else torch.zeros_like(x)
        return y, aux, load.detach()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float | None = None) -> None:
        """Aux-loss-free balancing: ``bias_i += rate * sign(mean(load) - load_i)``."""
        rate = self.cfg.bias_update_rate if rate is None else rate
        self.bias += rate * torch.sign(load.mean() - load).to(self.bias)
