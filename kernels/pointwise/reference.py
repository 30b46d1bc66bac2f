"""Sigmoid and SwiGLU in plain PyTorch: the test oracle and the path off the CPU kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))``, any shape."""
    return torch.sigmoid(x)


def swiglu(ab: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for ``ab [..., 2h] = [a | b]`` -> ``[..., h]``."""
    a, b = ab.chunk(2, dim=-1)
    return F.silu(a) * b
