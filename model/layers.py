"""Small building blocks shared by the mixers and FFNs: norms, the causal short conv, SwiGLU.

Shape-canonical computation: every matrix product in the model runs on fixed-size row tiles
(``ROW_TILE`` rows, zero-padded), aligned to absolute positions. A BLAS kernel's rounding can depend
on the matrix shape (a one-row product takes another code path than a 1024-row one), and DSA's top-k
turns a last-bit difference into a different selection; with canonical tiles a token's activations
are bit-for-bit the same however the sequence was cut into segments, so the streaming scorer equals
the full pass exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megabase.kernels.conv import short_conv
from megabase.kernels.pointwise import swiglu


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim (computed in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


ROW_TILE = 1024


def tiled_matmul(x: torch.Tensor, weight: torch.Tensor, untiled: bool = False,
                 tile: int = ROW_TILE) -> torch.Tensor:
    """``x [..., K] @ weight.T`` (``weight [N, K]``) on zero-padded tiles of ``tile`` rows; with
    ``untiled`` on the rows as given: a decoding step's one new token then costs one row, not
    ``ROW_TILE``, and its numbers move by fp32 round-off (``Context.untiled``)."""
    if untiled:
        return torch.matmul(x, weight.t().to(x.dtype))
    rows = x.reshape(-1, x.shape[-1])
    M = rows.shape[0]
    pad = (-M) % tile
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    tiles = rows.reshape(-1, tile, rows.shape[-1])
    out = torch.matmul(tiles, weight.t().to(x.dtype)).reshape(-1, weight.shape[0])
    return out[:M].reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose product runs on canonical row tiles (see module docs)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, untiled: bool = False) -> torch.Tensor:
        return tiled_matmul(x, self.weight, untiled)


class ShortConv(nn.Module):
    """Causal depthwise conv of width ``w`` over ``[B, T, C]``, then SiLU
    (:func:`megabase.kernels.conv.short_conv`).

    For streaming, ``forward(x, tail)`` takes the last ``w-1`` inputs of the previous segment
    (``[B, w-1, C]``, zeros at the start) and returns ``(y, new_tail)``.
    """

    def __init__(self, channels: int, width: int = 4):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.randn(channels, 1, width) / width**0.5)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None, backend: str = "auto"):
        """``backend``: as :func:`megabase.kernels.conv.short_conv`'s (the KDA layer passes its own)."""
        return short_conv(x, self.weight[:, 0, :], tail, backend)


class SwiGLU(nn.Module):
    """``W2 (silu(W1 x) * W3 x)``: the dense FFN and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = Linear(dim, 2 * hidden)
        self.w2 = Linear(hidden, dim)

    def forward(self, x: torch.Tensor, untiled: bool = False) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x, untiled)), untiled)


class HeadProjections(nn.Module):
    """The projections of softmax attention heads, shared by the dense and the sparse mixer:
    ``q_proj`` to ``dsa_heads`` queries and ``kv_proj`` to ``dsa_kv_heads`` keys and values of
    ``dsa_head_dim`` (GQA), their QK-RMSNorms, and ``o_proj`` back to ``d_model``, made by
    :meth:`output_projection` after the subclass's own projections (the order in which a seed
    draws every layer's initial weights)."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.HQ, self.H, self.D = cfg.dsa_heads, cfg.dsa_kv_heads, cfg.dsa_head_dim
        self.q_proj = Linear(d, self.HQ * self.D)
        self.kv_proj = Linear(d, 2 * self.H * self.D)
        self.q_norm, self.k_norm = RMSNorm(self.D, cfg.norm_eps), RMSNorm(self.D, cfg.norm_eps)

    def output_projection(self) -> None:
        self.o_proj = Linear(self.HQ * self.D, self.cfg.d_model)
