"""The experts' SwiGLU in plain PyTorch: one product per expert over its rows (the test oracle)."""

from __future__ import annotations

import torch

from megabase.kernels.pointwise import swiglu


def expert_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """``x [m, d]`` grouped by expert (``rows [E]`` rows each, in expert order) -> ``[m, d]``:
    ``swiglu(x_e @ w13[e]) @ w2[e]`` for each expert ``e``; ``w13 [E, d, 2h]``, ``w2 [E, h, d]``."""
    ys, r0 = [], 0
    for e, count in enumerate(rows.tolist()):
        if count:
            ys.append(swiglu(x[r0 : r0 + count] @ w13[e]) @ w2[e])
            r0 += count
    return torch.cat(ys) if ys else x.new_zeros(0, w2.shape[-1])
