"""The short causal convolution on the CPU: convolution and SiLU in one C pass (``conv.c``).

Same signature as :func:`megabase.kernels.conv.reference.short_conv`. The PyTorch composition
makes ``W`` shifted products, ``W - 1`` sums and a SiLU forward, and as many again backward, each a
pass over ``[B, T, C]`` plus zero-filled buffers for every shifted slice's gradient; here the forward
is one pass and the backward two (the pre-activation is recomputed, not kept). Built on first use by
:mod:`megabase.kernels.native`; :func:`available` is False where it cannot be.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from megabase.kernels import native

_F, _I = ctypes.c_void_p, ctypes.c_int64


def _lib():
    return native.bind(str(Path(__file__).with_name("conv.c")), {
        "megabase_conv_forward": [_F] * 3 + [_I] * 4 + [_F, ctypes.c_int],
        "megabase_conv_backward": [_F] * 4 + [_I] * 4 + [_F] * 4 + [ctypes.c_int],
    })


def available() -> bool:
    """Whether the C kernel is built (or can be) and enabled."""
    return _lib() is not None


class _ShortConv(torch.autograd.Function):
    """``x [B, T, C]``, ``tail [B, W - 1, C]``, ``wt [W, C]`` (fp32, contiguous) -> ``y [B, T, C]``."""

    @staticmethod
    def forward(ctx, x, tail, wt):
        B, T, C = x.shape
        y = torch.empty_like(x)
        _lib().megabase_conv_forward(x.data_ptr(), tail.data_ptr(), wt.data_ptr(), B, T, C,
                                     wt.shape[0], y.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(x, tail, wt)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, tail, wt = ctx.saved_tensors
        B, T, C = x.shape
        dy = dy.float().contiguous()
        dpre, dx = torch.empty_like(x), torch.empty_like(x)
        dtail, dwt = torch.empty_like(tail), torch.empty_like(wt)
        status = _lib().megabase_conv_backward(
            x.data_ptr(), tail.data_ptr(), wt.data_ptr(), dy.data_ptr(), B, T, C, wt.shape[0],
            dpre.data_ptr(), dx.data_ptr(), dtail.data_ptr(), dwt.data_ptr(),
            torch.get_num_threads())
        if status:
            raise MemoryError("the native short-convolution kernel could not allocate its buffers")
        return dx, dtail, dwt


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None):
    """:func:`megabase.kernels.conv.reference.short_conv` in C: fp32 CPU tensors."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, W - 1, C)
    y = _ShortConv.apply(x.contiguous(), tail.to(x.dtype).contiguous(), weight.t().contiguous())
    if T >= W - 1:
        return y, x[:, T - (W - 1) :]
    return y, torch.cat([tail.to(x.dtype), x], dim=1)[:, T:]
