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


_SOURCE = str(Path(__file__).with_name("pointwise.c"))
_SIGNATURES = {
    "megabase_sigmoid_forward": [_F, _F, _I, ctypes.c_int],
    "megabase_sigmoid_backward": [_F, _F, _F, _I, ctypes.c_int],
    "megabase_swiglu_forward": [_F, _F, _I, _I, ctypes.c_int],
    "megabase_swiglu_backward": [_F, _F, _F, _I, _I, ctypes.c_int],
}
_bound: list = []  # the library once bound: a decoding step makes hundreds of these calls


def _lib():
    if not native.enabled():
        return None
    if not _bound:
        _bound.append(native.bind(_SOURCE, _SIGNATURES, extra=("-ffp-contract=off",)))
    return _bound[0]


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _lib().megabase_sigmoid_forward(x.data_ptr(), y.data_ptr(), x.numel(), torch.get_num_threads())
    return y


def _swiglu(ab: torch.Tensor) -> torch.Tensor:
    h = ab.shape[-1] // 2
    out = ab.new_empty(*ab.shape[:-1], h)
    rows = ab.numel() // (2 * h) if h else 0
    _lib().megabase_swiglu_forward(ab.data_ptr(), out.data_ptr(), rows, h, torch.get_num_threads())
    return out


def available() -> bool:
    """Whether the C kernel is built (or can be) and enabled."""
    return _lib() is not None


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _sigmoid(x)
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
        ctx.save_for_backward(ab)
        return _swiglu(ab)

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


def _tracked(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """:func:`megabase.kernels.pointwise.reference.sigmoid` in C: an fp32 CPU tensor."""
    x = x.contiguous()
    return _Sigmoid.apply(x) if _tracked(x) else _sigmoid(x)


def swiglu(ab: torch.Tensor) -> torch.Tensor:
    """:func:`megabase.kernels.pointwise.reference.swiglu` in C: an fp32 CPU tensor, even last dim."""
    ab = ab.contiguous()
    return _SwiGLU.apply(ab) if _tracked(ab) else _swiglu(ab)
