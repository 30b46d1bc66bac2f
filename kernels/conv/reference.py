"""The short causal convolution in plain PyTorch: the test oracle and the path off the CPU kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None):
    """``silu`` of a causal depthwise convolution: ``x [B, T, C]``, ``weight [C, W]``, ``tail
    [B, W - 1, C]`` (the inputs before ``x``; zeros when None) -> ``(y [B, T, C], new_tail
    [B, W - 1, C])``, ``new_tail`` the last ``W - 1`` inputs, to carry into the next piece.

    Shifted products summed in the order of the taps, element-wise: an output's bits depend only on
    its own ``W`` inputs, so a sequence cut in pieces gives the bits of one pass."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, W - 1, C)
    xx = torch.cat([tail.to(x.dtype), x], dim=1)
    w = weight.to(x.dtype)
    y = xx[:, :T] * w[:, 0]
    for j in range(1, W):
        y = y + xx[:, j : j + T] * w[:, j]
    return F.silu(y), xx[:, xx.shape[1] - (W - 1) :]
