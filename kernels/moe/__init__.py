"""The routed experts' SwiGLU over rows grouped by expert.

``expert_swiglu(x [m, d], w13 [E, d, 2h], w2 [E, h, d], rows [E], backend) -> [m, d]``: the plain
PyTorch reference (:mod:`megabase.kernels.moe.reference`, one product per expert) or torch's
grouped GEMM (``torch._grouped_mm``: one launch per projection for all experts). ``backend``:
``"auto"`` takes the grouped GEMM where torch has one for these tensors (any dtype on CPU; on CUDA
its sm90+ kernels take bf16 only), ``"reference"`` the loop. Both give the same rows; this is the
one place that knows which devices the grouped kernels run on.
"""

from __future__ import annotations

import torch

from megabase.kernels.pointwise import swiglu

from . import reference

BACKENDS = ("auto", "grouped", "reference")


def _grouped(x: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def expert_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor,
                  backend: str = "auto") -> torch.Tensor:
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose {', '.join(BACKENDS)}")
    if backend == "grouped" and not _grouped(x):
        raise ValueError(f"torch has no grouped GEMM for {x.dtype} on {x.device.type}")
    if backend == "reference" or not _grouped(x):
        return reference.expert_swiglu(x, w13, w2, rows)
    offs = torch.cumsum(rows, 0).to(torch.int32)
    return torch._grouped_mm(swiglu(torch._grouped_mm(x, w13, offs=offs)), w2, offs=offs)


__all__ = ["BACKENDS", "expert_swiglu"]
