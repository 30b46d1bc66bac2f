"""Full causal softmax attention: the mixer of the dense baseline (``mixer="attention"``).

A plain Transformer layer to measure the hybrid against at equal active parameters: every token
attends to every earlier token (PyTorch SDPA, O(T^2) compute), GQA heads of ``dsa_heads`` /
``dsa_kv_heads`` x ``dsa_head_dim``, QK-RMSNorm and rotary position embeddings (``rope_base``).
Streaming carries the keys and values (rotated at their absolute positions), so a piece attends to
the whole prefix and the log-probs equal the full pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import extend
from .config import ModelConfig
from .layers import Linear, RMSNorm


def rotate(x: torch.Tensor, offset: int, base: float) -> torch.Tensor:
    """Rotary embedding of ``x [B, T, H, D]`` at positions ``offset .. offset + T`` (fp32 angles)."""
    B, T, H, D = x.shape
    inv = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float64) / D)
    pos = torch.arange(offset, offset + T, device=x.device, dtype=torch.float64)
    angle = (pos[:, None] * inv[None]).float()
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class AttentionLayer(nn.Module):
    """``[B, T, d] -> [B, T, d]``: causal attention over all earlier tokens; ``(y, aux_loss = 0)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.HQ, self.H, self.D = cfg.dsa_heads, cfg.dsa_kv_heads, cfg.dsa_head_dim
        self.q_proj = Linear(d, self.HQ * self.D)
        self.kv_proj = Linear(d, 2 * self.H * self.D)
        self.q_norm, self.k_norm = RMSNorm(self.D, cfg.norm_eps), RMSNorm(self.D, cfg.norm_eps)
        self.o_proj = Linear(self.HQ * self.D, d)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        offset = state["k"].shape[1] if state is not None and "k" in state else 0
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.HQ, self.D))
        k, v = self.kv_proj(x).reshape(B, T, 2, self.H, self.D).unbind(2)
        q = rotate(q, offset, self.cfg.rope_base)
        k = rotate(self.k_norm(k), offset, self.cfg.rope_base)
        if state is not None:
            k, v = extend(state, "k", k), extend(state, "v", v)
        rep = self.HQ // self.H
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2),
                                                 v.repeat_interleave(rep, 2)))
        if offset:  # queries are the last T of the keys: causal from the bottom-right corner
            allowed = torch.ones(T, offset + T, dtype=torch.bool, device=x.device).tril(offset)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, self.HQ * self.D))
        return y, x.new_zeros((), dtype=torch.float)
