"""Kimi Delta Attention: plain-PyTorch reference (recurrent + chunkwise) and the CUDA dispatch.

``kda_chunk`` runs ``fla.ops.kda.chunk_kda`` on CUDA tensors (when ``flash-linear-attention`` is
installed) and the vectorised PyTorch chunk form everywhere else; ``backend="torch"`` forces the
reference. Shapes and math: :mod:`megabase.kernels.kda.reference`.
"""

from __future__ import annotations

from .reference import kda_chunk as kda_chunk_torch
from .reference import kda_recurrent


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              backend: str = "auto"):
    """Chunkwise KDA: ``(q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV]) -> (o, state)``."""
    if _use_fla(backend, q):
        from fla.ops.kda import chunk_kda

        o, state = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)
        return o, state
    return kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state)


def kda_final_state(q, k, v, g, beta, scale=None, initial_state=None, backend: str = "auto"):
    """The final state ``[B, HV, K, V]`` (fp32) alone, as :func:`kda_chunk` would return it; the
    PyTorch path skips the outputs (fla computes and drops them)."""
    if _use_fla(backend, q):
        return kda_chunk(q, k, v, g, beta, scale, initial_state, True, backend)[1]
    return kda_chunk_torch(q, k, v, g, beta, scale, initial_state, True, output=False)[1]


def _use_fla(backend: str, q) -> bool:
    """Whether ``backend`` runs on fla's kernels for tensors like ``q`` (a clear error if unknown)."""
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"unknown KDA backend {backend!r}; choose auto, torch or fla")
    return backend == "fla" or (backend == "auto" and q.is_cuda and _fla_available())


def _fla_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("fla.ops.kda") is not None and importlib.util.find_spec(
            "triton") is not None
    except ModuleNotFoundError:
        return False


__all__ = ["kda_chunk", "kda_chunk_torch", "kda_final_state", "kda_recurrent"]
