"""Small building blocks shared by the mixers and FFNs: norms, the causal short conv, SwiGLU.

Shape-canonical computation: every matrix product in the model runs on fixed-size row tiles
(``ROW_TILE`` rows, zero-padded), aligned to absolute positions. A BLAS kernel's rounding can depend
on the matrix shape (a one-row product takes another code path than a 1024-row one), and DSA's top-k
turns a last-bit difference into a different selection; with canonical tiles a token's activations
are bit-for-bit the same however the sequence was cut into segments, so the streaming scorer equals
the full pass exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

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
_untiled = threading.local()


@contextmanager
def untiled() -> Iterator[None]:
    """Products on the rows given instead of whole canonical tiles, in this thread, for incremental
    decoding: one new token then costs one row, not ``ROW_TILE``. Its numbers move by fp32
    round-off, so a piece no longer gives the full pass's exact bits."""
    before = getattr(_untiled, "on", False)
    _untiled.on = True
    try:
        yield
    finally:
        _untiled.on = before


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops (and the C kernels, which take torch's thread count) on one thread: a step
    of a few tokens is hundreds of tiny ops, which threads only slow down (20x on 2 busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def is_untiled() -> bool:
    """Whether this thread runs inside :func:`untiled` (incremental decoding)."""
    return getattr(_untiled, "on", False)


def tiled_matmul(x: torch.Tensor, weight: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """``x [..., K] @ weight.T`` (``weight [N, K]``) on zero-padded tiles of ``tile`` rows (on the
    rows as given inside :func:`untiled`)."""
    if is_untiled():
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_matmul(x, self.weight)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))
