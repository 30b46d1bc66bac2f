"""Kimi Delta Attention: plain-PyTorch reference (recurrent + chunkwise), the C kernel, the dispatch.

``kda_chunk`` is the fast KDA op wherever it runs: ``fla.ops.kda.chunk_kda`` on CUDA tensors (when
``flash-linear-attention`` is installed); on CPU tensors the recurrence in C
(:mod:`megabase.kernels.kda.cpu`, built on first use), else the vectorised PyTorch chunk form.
``backend``: ``"auto"``, ``"reference"`` (the PyTorch chunk form), ``"cpu"`` (the C kernel) or
``"fla"``; ``"torch"`` is an alias of ``"reference"`` (its old name, which configs saved before
the rename still hold). Shapes and math: :mod:`megabase.kernels.kda.reference`.
"""

from __future__ import annotations

from . import cpu
from .reference import kda_chunk as kda_chunk_torch
from .reference import kda_recurrent

BACKENDS = ("auto", "reference", "cpu", "fla")
ALIASES = {"torch": "reference"}


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              backend: str = "auto"):
    """Chunkwise KDA: ``(q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV]) -> (o, state)``."""
    if _use_fla(backend, q):
        from fla.ops.kda import chunk_kda

        o, state = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)
        return o, state
    if _use_cpu(backend, q):
        return cpu.kda_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state)
    return kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state)


def kda_final_state(q, k, v, g, beta, scale=None, initial_state=None, backend: str = "auto"):
    """The final state ``[B, HV, K, V]`` alone (fp32; fp64 from the C kernel), as :func:`kda_chunk`
    would return it; the PyTorch path skips the outputs (fla and the C kernel compute and drop
    them)."""
    if _use_fla(backend, q) or _use_cpu(backend, q):
        return kda_chunk(q, k, v, g, beta, scale, initial_state, True, backend)[1]
    return kda_chunk_torch(q, k, v, g, beta, scale, initial_state, True, output=False)[1]


def _use_fla(backend: str, q) -> bool:
    """Whether ``backend`` runs on fla's kernels for tensors like ``q`` (a clear error if unknown)."""
    if backend not in BACKENDS and backend not in ALIASES:
        raise ValueError(f"unknown KDA backend {backend!r}; choose {', '.join(BACKENDS)}")
    return backend == "fla" or (backend == "auto" and q.is_cuda and _fla_available())


def _use_cpu(backend: str, q) -> bool:
    """Whether ``backend`` runs on the C kernel for tensors like ``q`` (a clear error if it was
    asked for and cannot)."""
    if backend == "cpu" and (q.device.type != "cpu" or not cpu.available()):
        raise ValueError("the cpu KDA backend needs CPU tensors and a built C kernel "
                         "(a C compiler on PATH, MEGABASE_NATIVE not 0)")
    return backend in ("auto", "cpu") and q.device.type == "cpu" and cpu.available()


def _fla_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("fla.ops.kda") is not None and importlib.util.find_spec(
            "triton") is not None
    except ModuleNotFoundError:
        return False


__all__ = ["ALIASES", "BACKENDS", "kda_chunk", "kda_chunk_torch", "kda_final_state", "kda_recurrent"]
