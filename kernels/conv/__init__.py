"""The short causal convolution (depthwise, width ``W``, then SiLU) of the KDA layer's q, k, v.

``short_conv(x [B, T, C], weight [C, W], tail [B, W - 1, C] or None, backend) -> (y, new_tail)``:
the plain-PyTorch reference (:mod:`megabase.kernels.conv.reference`) or, for fp32 CPU tensors, the
C kernel (:mod:`megabase.kernels.conv.cpu`). ``backend`` follows the KDA op's (``kda_backend``):
``"auto"`` and ``"cpu"`` run the C kernel where it applies, ``"reference"`` (or its old name
``"torch"``) and ``"fla"`` the reference (on CUDA tensors the few element-wise passes are cheap
beside the rest of the layer).
"""

from __future__ import annotations

import torch

from . import cpu, reference


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
               backend: str = "auto"):
    W = weight.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or (
            tail is not None and tuple(tail.shape) != (x.shape[0], W - 1, x.shape[-1])):
        raise ValueError(f"short conv inputs do not match: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}, tail {None if tail is None else tuple(tail.shape)}")
    if (backend in ("auto", "cpu") and x.device.type == "cpu" and x.dtype == torch.float32
            and cpu.available()):
        return cpu.short_conv(x, weight, tail)
    return reference.short_conv(x, weight, tail)


__all__ = ["short_conv"]
