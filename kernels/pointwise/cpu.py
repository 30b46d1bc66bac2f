"""Sigmoid and SwiGLU on the CPU in C (``pointwise.c``): an output's bits depend on its input only.

PyTorch's CPU loops compute a vector width of values with a vectorised exp and the values left at
the end of each thread's range with a scalar one, which rounds differently; where a range ends moves
with the tensor's size and the thread count. A value then had other last bits in a streamed piece
than in the full pass, and DSA's top-k made some of those into other selections (0.05 nats on a
3,000-base tile at 7 threads with AVX2). The C kernel's exp is plain IEEE arithmetic, the same bits
in the vector body and the scalar tail. Same signatures as :mod:`megabase.kernels.pointwise.reference`.
Built on first use by :mod:`megabase.kernels.native` (without FMA contraction, which could fuse
the vector body's products and not the tail's); :func:`available` is False where it cannot be.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from megabase.kernels import native

_F, _I = ctypes.c_void_p, ctypes.c_int64


def _lib():
    return native.bind(str(Path(__file__).with_name("pointwise.c")), {
        "megabase_sigmoid_forward": [_F, _F, _I, ctypes.c_int],
        "megabase_sigmoid_backward": [_F, _F, _F, _I, ctypes.c_int],
        "megabase_swiglu_forward": [_F, _F, _I, _I, ctypes.c_int],
        "megabase_swiglu_backward": [_F, _F, _F, _I, _I, ctypes.c_int],
    }, extra=("-ffp-contract=off",))


def available() -> bool:
    """Whether the C kernel is built (or can be) and enabled."""
    return _lib() is not None


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x)
        _lib().megabase_sigmoid_forward(x.data_ptr(), y.data_ptr(), x.numel(), torch.get_num_threads())
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dy = dy.float().contiguous()
        dx = torch.empty_like(y)
        _lib().megabase_sigmoid_backward(y.data_ptr(), dy.data_ptr(), dx.data_ptr(), y.numel(),
                                         torch.get_num_threads())
        return dx


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ab):
        h = ab.shape[-1] // 2
        out = ab.new_empty(*ab.shape[:-1], h)
        rows = ab.numel() // (2 * h) if h else 0
        _lib().megabase_swiglu_forward(ab.data_ptr(), out.data_ptr(), rows, h, torch.get_num_threads())
        ctx.save_for_backward(ab)
        return out

    @staticmethod
    def backward(ctx, dout):
        (ab,) = ctx.saved_tensors
        h = ab.shape[-1] // 2
        dout = dout.float().contiguous()
        dab = torch.empty_like(ab)
        rows = ab.numel() // (2 * h) if h else 0
        _lib().megabase_swiglu_backward(ab.data_ptr(), dout.data_ptr(), dab.data_ptr(), rows, h,
                                        torch.get_num_threads())
        return dab


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """:func:`megabase.kernels.pointwise.reference.sigmoid` in C: an fp32 CPU tensor."""
    return _Sigmoid.apply(x.contiguous())


def swiglu(ab: torch.Tensor) -> torch.Tensor:
    """:func:`megabase.kernels.pointwise.reference.swiglu` in C: an fp32 CPU tensor, even last dim."""
    return _SwiGLU.apply(ab.contiguous())
