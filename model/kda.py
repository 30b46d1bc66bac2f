"""The Kimi Delta Attention mixer (DESIGN.md, Model): projections, short conv, gates, the KDA op."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megabase.kernels.pointwise import sigmoid

from .config import ModelConfig
from .context import DEFAULT, Context
from .layers import Linear, RMSNorm, ShortConv

MEMORY_RANGE = (2.0, 16384.0)  # initial per-channel memory lengths (tokens), log-uniform


class KDALayer(nn.Module):
    """``[B, T, d] -> [B, T, d]``; channel-wise decaying delta-rule memory of ``[K, K]`` per head.

    q, k, v: projections -> causal depthwise conv (width ``kda_conv``) + SiLU; q, k L2-normalised
    per head. ``beta = sigmoid(W_b x)``; log-decay ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))``
    with ``f`` a rank-``kda_gate_rank`` projection and ``lb = kda_lower_bound``; output
    ``o_proj(RMSNorm_head(o) * sigmoid(low-rank gate(x)))``. ``A_log`` starts at 0 and ``dt_bias``
    so that the channels' memories ``1 / |g|`` are log-uniform over ``MEMORY_RANGE`` (2 to 16,384
    bases): recent k-mers and long context both have channels from the first step.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H, K, r = cfg.d_model, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_gate_rank
        self.cfg, self.H, self.K = cfg, H, K
        self.qkv = Linear(d, 3 * H * K)
        self.conv = ShortConv(3 * H * K, cfg.kda_conv)
        self.b_proj = Linear(d, H)
        self.f_proj = nn.Sequential(Linear(d, r), Linear(r, H * K))
        self.g_proj = nn.Sequential(Linear(d, r), Linear(r, H * K))
        # Decays start log-uniform over memories of MEMORY_RANGE tokens (|g| = 1 / memory): with
        # fla's softplus-form init (exp(A_log) in [1, 16], dt in [1e-3, 0.1]) this bounded sigmoid
        # form gives |g| ~ 1e-15 on most channels, a memory that never forgets anything.
        self.A_log = nn.Parameter(torch.zeros(H))
        lo, hi = (math.log(m) for m in MEMORY_RANGE)
        memory = torch.empty(H * K).uniform_(lo, hi).exp()
        self.dt_bias = nn.Parameter(torch.logit(1.0 / (memory * -cfg.kda_lower_bound)))
        self.o_norm = RMSNorm(K, cfg.norm_eps)
        self.o_proj = Linear(H * K, d)

    def forward(self, x: torch.Tensor, ctx: Context = DEFAULT):
        """Returns ``(y, aux_loss, None)``; with ``ctx.state`` (a dict) it continues from and
        updates it."""
        seq, state, u = ctx.sequence, ctx.state, ctx.untiled
        qkv = self.qkv(x, u)
        if state is None:
            tail = seq.before(qkv, self.cfg.kda_conv - 1)  # the conv's inputs across a shard border
        else:
            seq.check_streaming()
            tail = state.get("conv")
        q, k, v, g, beta, tail = self.features(qkv, x, tail, u)
        o, final = seq.kda(q, k, v, g, beta, initial_state=None if state is None else state.get("S"),
                           output_final_state=state is not None, backend=self.cfg.kda_backend)
        if state is not None:
            state["conv"], state["S"] = tail, final
        return self.output(o, x, u), x.new_zeros((), dtype=torch.float), None

    def features(self, qkv: torch.Tensor, x: torch.Tensor, tail: torch.Tensor | None = None,
                 untiled: bool = False):
        """Pre-conv projections ``qkv [B, T, 3HK]`` of ``x [B, T, d]`` (and the last ``kda_conv - 1``
        rows before them, ``tail``) -> ``(q, k, v [B, T, H, K], g [B, T, H, K], beta [B, T, H],
        new_tail)``: the inputs of the KDA op."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        qkv, tail = self.conv(qkv, tail, self.cfg.kda_backend)
        q, k, v = (t.reshape(B, T, H, K) for t in qkv.split(H * K, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        backend = self.cfg.kda_backend
        beta = sigmoid(self.b_proj(x, untiled).float(), backend)
        f = _low_rank(self.f_proj, x, untiled).float().reshape(B, T, H, K) + self.dt_bias.float().reshape(H, K)
        g = self.cfg.kda_lower_bound * sigmoid(self.A_log.float().exp()[:, None] * f, backend)
        return q, k, v, g, beta, tail

    def output(self, o: torch.Tensor, x: torch.Tensor, untiled: bool = False) -> torch.Tensor:
        """KDA op output ``o [B, T, H, K]`` -> ``[B, T, d]`` (gated head norm, output projection)."""
        B, T, _ = x.shape
        gate = sigmoid(_low_rank(self.g_proj, x, untiled), self.cfg.kda_backend)
        gate = gate.reshape(B, T, self.H, self.K)
        return self.o_proj((self.o_norm(o.to(x.dtype)) * gate).reshape(B, T, self.H * self.K),
                           untiled)


def _low_rank(pair: nn.Sequential, x: torch.Tensor, untiled: bool) -> torch.Tensor:
    """The two products of a rank-``r`` projection (an ``nn.Sequential`` of two :class:`Linear`,
    the layout checkpoints store)."""
    return pair[1](pair[0](x, untiled), untiled)
