"""Element-wise nonlinearities of the model: ``sigmoid(x)`` and ``swiglu(ab) = silu(a) * b``.

``sigmoid(x [...], backend) -> [...]``, ``swiglu(ab [..., 2h], backend) -> [..., h]``: the plain
PyTorch reference (:mod:`megabase.kernels.pointwise.reference`) or, for fp32 CPU tensors, the C
kernel (:mod:`megabase.kernels.pointwise.cpu`), whose outputs depend on their inputs only, not on
the tensor's length or the thread count, so the streaming scorer gives the full pass's bits on any
machine. ``backend``: ``"auto"`` and ``"cpu"`` run the C kernel where it applies, anything else
(``"reference"``, its old name ``"torch"``, ``"fla"``) the reference; on CUDA every value takes
the same path, so the reference is exact there.
"""

from __future__ import annotations

import torch

from . import cpu, reference


def _native(x: torch.Tensor, backend: str) -> bool:
    return (backend in ("auto", "cpu") and x.device.type == "cpu" and x.dtype == torch.float32
            and cpu.available())


def sigmoid(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    return cpu.sigmoid(x) if _native(x, backend) else reference.sigmoid(x)


def swiglu(ab: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if ab.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim ([a | b]), got {tuple(ab.shape)}")
    return cpu.swiglu(ab) if _native(ab, backend) else reference.swiglu(ab)


__all__ = ["sigmoid", "swiglu"]
