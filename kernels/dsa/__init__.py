"""DeepSeek Sparse Attention: lightning indexer with running top-k, sparse attention, indexer losses.

Three backends, modules with one set of functions and signatures (``dsa_indexer``,
``staged_indexer``, ``candidate_indexer``, ``block_summaries``, ``sparse_attention``,
``indexer_kl_sparse``): the plain-PyTorch reference (:mod:`megabase.kernels.dsa.reference`, the
definition and test oracle), the C kernels (:mod:`megabase.kernels.dsa.cpu`, the CPU default; the
reference where no C compiler is found) and Triton kernels
(:mod:`megabase.kernels.dsa.triton_kernels`, the CUDA default). ``backend`` is ``"auto"``,
``"reference"``, ``"cpu"`` or ``"triton"``; Triton on CPU tensors runs under
``TRITON_INTERPRET=1`` only (slow: for tests at tiny shapes). The candidate stage's configuration
is :class:`~megabase.kernels.dsa.stage.Stage`; which queries it applies to is decided in one
place for every backend (:func:`~megabase.kernels.dsa.stage.with_stage`). Shapes follow
``fla.ops.dsa.naive_dsa``; they are checked here, once, before any backend runs.
"""

from __future__ import annotations

import os

import torch

from . import cpu, reference
from .cpu import seed_keys
from .reference import BLOCK_K, BLOCK_Q, indexer_kl_dense
from .stage import Stage

BACKENDS = ("auto", "reference", "cpu", "triton")


def resolve_backend(backend: str, like: torch.Tensor) -> str:
    """``"reference"``, ``"cpu"`` or ``"triton"`` for tensors like ``like``; a clear error if
    impossible."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown DSA backend {backend!r}; choose {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if like.is_cuda and _triton_available() else "cpu"
    if backend == "triton" and not like.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton DSA kernels need CUDA tensors, or TRITON_INTERPRET=1 (set "
                         "before triton is imported) to run on the CPU")
    return backend


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _impl(backend: str, like: torch.Tensor):
    chosen = resolve_backend(backend, like)
    if chosen == "triton":
        from . import triton_kernels

        return triton_kernels
    return cpu if chosen == "cpu" else reference


def dsa_indexer(q_idx, k_idx, w_idx=None, topk: int = 2048, scale=None, keep_recent: int = 0,
                block_q: int = BLOCK_Q, block_k: int = BLOCK_K, offset: int = 0,
                backend: str = "auto", stage: Stage | None = None, seeds=None, summaries=None):
    """Top-k causal keys per query: ``[B, Tq, topk]`` ascending positions, -1 padded.
    ``block_q``/``block_k`` size the reference's blocks; the C and Triton kernels pick their own.

    With ``stage`` (:class:`~megabase.kernels.dsa.stage.Stage`) queries from
    ``stage.first_staged()`` on score only their candidates: the local window, the best blocks by
    their ``summaries [B, Tk // block, R, DI]`` (computed when None) and ``seeds [B, Tq, S]``
    (:func:`seed_keys`; None: no seeds). Each backend runs the stage in its own kernels."""
    impl = _impl(backend, q_idx)
    _check_indexer(q_idx, k_idx, w_idx, offset)
    if stage is not None:
        return impl.staged_indexer(q_idx, k_idx, w_idx, topk, stage, scale, keep_recent, offset,
                                   seeds, summaries)
    return impl.dsa_indexer(q_idx, k_idx, w_idx, topk, scale, keep_recent, block_q, block_k,
                            offset)


def sparse_attention(q, k, v, indices, scale=None, block_q: int = BLOCK_Q,
                     return_probs: bool = False, backend: str = "auto", key_grads=None):
    """Softmax attention of each query over its selected keys: ``o [B, Tq, HQ, DV]``
    (and the head-summed, normalised probabilities ``[B, Tq, topk]`` with ``return_probs``).

    ``key_grads``: None, or buffers ``(dk, dv)`` of ``[B, >= Tk, ...]`` into which the backward
    adds the gradients of ``k`` and ``v`` (rows ``0..Tk``) instead of returning them (a walked
    window's gradient buffers, :mod:`megabase.model.walk`): the C kernel adds where the rows are,
    with no full-length tensor made per call; the other backends add through autograd."""
    impl = _impl(backend, q)
    _check_attention(q, k, v, indices)
    if key_grads is None:
        return impl.sparse_attention(q, k, v, indices, scale, block_q, return_probs)
    _check_key_grads(key_grads, k, v)
    if impl is cpu:
        return cpu.sparse_attention(q, k, v, indices, scale, block_q, return_probs, key_grads)
    k, v = reference.grads_into(key_grads, k, v)
    return impl.sparse_attention(q, k, v, indices, scale, block_q, return_probs)


def indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale=None, backend: str = "auto",
                      key_grads=None):
    """``KL(p || softmax(I))`` on each query's selected set, averaged over queries.
    ``key_grads``: None, or ``(dk_idx,)``, as :func:`sparse_attention`'s."""
    impl = _impl(backend, q_idx)
    _check_selection(indices, q_idx, k_idx)
    B, Tq, HI, DI = q_idx.shape
    if target.shape != indices.shape or k_idx.shape[-1] != DI or (
            w_idx is not None and tuple(w_idx.shape) != (B, Tq, HI)):
        raise ValueError(f"indexer loss inputs do not match: q_idx {tuple(q_idx.shape)}, k_idx "
                         f"{tuple(k_idx.shape)}, indices {tuple(indices.shape)}, target "
                         f"{tuple(target.shape)}")
    if key_grads is None:
        return impl.indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale)
    _check_key_grads(key_grads, k_idx)
    if impl is cpu:
        return cpu.indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale,
                                     key_grads=key_grads)
    (k_idx,) = reference.grads_into(key_grads, k_idx)
    return impl.indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale)


def _check_key_grads(buffers, *keys: torch.Tensor) -> None:
    """One gradient buffer per key tensor, of its batch and row shape and at least its rows."""
    if len(buffers) != len(keys) or any(
            b.shape[0] != x.shape[0] or b.shape[2:] != x.shape[2:] or b.shape[1] < x.shape[1]
            for b, x in zip(buffers, keys)):
        raise ValueError(f"key gradient buffers {[tuple(b.shape) for b in buffers]} do not fit "
                         f"keys {[tuple(x.shape) for x in keys]}")


def _check_indexer(q_idx, k_idx, w_idx, offset: int) -> None:
    B, Tq, HI, DI = q_idx.shape
    if k_idx.dim() != 3 or k_idx.shape[0] != B or k_idx.shape[-1] != DI or (
            w_idx is not None and tuple(w_idx.shape) != (B, Tq, HI)) or offset + Tq > k_idx.shape[1]:
        raise ValueError(f"indexer inputs do not match: q_idx {tuple(q_idx.shape)}, k_idx "
                         f"{tuple(k_idx.shape)}, offset {offset}")


def _check_attention(q, k, v, indices) -> None:
    HQ, D, H = q.shape[2], q.shape[3], k.shape[2]
    if HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({H})")
    if k.shape[-1] != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match")
    _check_selection(indices, q, k, v)


def _check_selection(indices, queries: torch.Tensor, *keys: torch.Tensor) -> None:
    """``indices [B, Tq, K]`` for ``queries [B, Tq, ...]`` over ``keys [B, Tk, ...]``, and within
    ``Tk`` (the C kernels read key rows at the indices unchecked; on a GPU the range check would
    cost a device sync per call, and the Triton kernels mask by position)."""
    rows, Tk = tuple(queries.shape[:2]), keys[0].shape[1]
    if tuple(indices.shape[:2]) != rows or any(x.shape[:2] != keys[0].shape[:2] for x in keys):
        raise ValueError(f"indices {tuple(indices.shape)} do not match {rows[0]} sequences of "
                         f"{rows[1]} queries over keys {tuple(keys[0].shape)}")
    if indices.device.type == "cpu" and indices.numel() and int(indices.max()) >= Tk:
        raise ValueError(f"indices reach key {int(indices.max())}, but there are only {Tk} keys")


def dsa_attention(q, k, v, q_idx=None, k_idx=None, w_idx=None, topk: int = 2048, scale=None,
                  indices=None, return_indices: bool = False, keep_recent: int = 0,
                  block_q: int = BLOCK_Q, backend: str = "auto"):
    """DSA: the indexer picks ``topk`` keys per query (unless ``indices`` are given), then sparse
    softmax attention over them. Returns ``o`` or ``(o, indices)``."""
    if indices is None:
        if q_idx is None or k_idx is None:
            raise ValueError("dsa_attention needs q_idx and k_idx, or precomputed indices")
        indices = dsa_indexer(q_idx, k_idx, w_idx, topk, keep_recent=keep_recent,
                              block_q=block_q, backend=backend)
    o = sparse_attention(q, k, v, indices, scale, block_q, backend=backend)
    return (o, indices) if return_indices else o


@torch.library.custom_op("megabase::dsa_indexer", mutates_args=())
def dsa_indexer_op(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor | None,
                   topk: int, keep_recent: int, block_q: int, offset: int,
                   backend: str = "auto", stage: list[int] | None = None,
                   seeds: torch.Tensor | None = None,
                   summaries: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dsa_indexer` as one registered op, so activation recompute can keep its output
    (``megabase.pipeline.memory``): the selection then runs once per step, not twice.
    ``stage``: :meth:`Stage.encode` (the op schema takes integers, not dataclasses)."""
    return dsa_indexer(q_idx, k_idx, w_idx, topk, keep_recent=keep_recent, block_q=block_q,
                       offset=offset, backend=backend,
                       stage=None if stage is None else Stage.decode(stage), seeds=seeds,
                       summaries=summaries)


@dsa_indexer_op.register_fake
def _(q_idx, k_idx, w_idx, topk, keep_recent, block_q, offset, backend="auto", stage=None,
      seeds=None, summaries=None):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], topk), dtype=torch.long)


def block_summaries(k_idx: torch.Tensor, stage: Stage) -> torch.Tensor:
    """``k_idx [B, Tk, DI]`` -> the candidate stage's block summaries ``[B, Tk // block, R, DI]``
    (the C kernel on CPU: its sums have a fixed order, so a streamed sequence gets the bits of
    its full pass)."""
    return cpu.block_summaries(k_idx, stage)


__all__ = ["BACKENDS", "Stage", "block_summaries", "dsa_attention", "dsa_indexer",
           "dsa_indexer_op", "indexer_kl_dense", "indexer_kl_sparse", "resolve_backend",
           "seed_keys", "sparse_attention"]
