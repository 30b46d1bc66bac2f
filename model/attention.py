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

from .cache import extend
from .config import ModelConfig
from .context import DEFAULT, Context
from .layers import HeadProjections


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


class AttentionLayer(HeadProjections):
    """``[B, T, d] -> [B, T, d]``: causal attention over all earlier tokens; ``(y, aux_loss = 0,
    None)``. Streaming (``ctx.state``) carries the rotated keys and values."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.output_projection()

    def forward(self, x: torch.Tensor, ctx: Context = DEFAULT):
        B, T, _ = x.shape
        state, u = ctx.state, ctx.untiled
        offset = state["k"].shape[1] if state is not None and "k" in state else 0
        q = self.q_norm(self.q_proj(x, u).reshape(B, T, self.HQ, self.D))
        k, v = self.kv_proj(x, u).reshape(B, T, 2, self.H, self.D).unbind(2)
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
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, self.HQ * self.D), u)
        return y, x.new_zeros((), dtype=torch.float), None
