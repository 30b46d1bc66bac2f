"""The C backend of DSA: the indexer (exact and staged), its seeds, sparse attention and the sparse
indexer loss in C.

Same signatures and results as :mod:`megabase.kernels.dsa.reference` (the oracle), another
evaluation order; arguments that only size the reference's blocks (``block_q``, ``block_k``) are
accepted and ignored. ``indexer.c`` computes each query's index scores one block of keys at a time
and keeps its top-k in the reference's total order (score desc, position desc), never storing more
than a block of scores. ``attention.c`` is softmax attention over the selected keys with a
flash-style backward: it reads the selected keys where they are, where the PyTorch forms gather or
scatter ``[Tq, topk]`` rows through memory. ``seeds.c`` builds the seeds' table of earlier k-mers
in one pass, O(Tk). All are built on first use by :mod:`megabase.kernels.native`; where they
cannot be, or for tensors off the CPU, the reference runs instead. (A sparse-matrix form of the
attention and the loss, ``torch.sparse.sampled_addmm``, was the fallback until a measurement
showed it 1.04x the reference's speed for a whole training step: ``benchmarks/bench_model.py
--only nocompiler``.)
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from megabase.kernels import native
from megabase.kernels.precision import full_precision

from . import reference
from .stage import VW, Stage, with_stage

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _indexer_lib():
    return native.bind(str(Path(__file__).with_name("indexer.c")), {
        "megabase_dsa_indexer": [_P] * 3 + [_I] * 6 + [_F, _I, _I, _P, ctypes.c_int],
        "megabase_dsa_staged_indexer": [_P] * 5 + [_I] * 7 + [_F] + [_I] * 5
        + [ctypes.c_int, _P, ctypes.c_int],
        "megabase_dsa_block_summaries": [_P] + [_I] * 4 + [ctypes.c_int, _P]})


def _attention_lib():
    return native.bind(str(Path(__file__).with_name("attention.c")), {
        "megabase_dsa_attention_forward": [_P] * 4 + [_I] * 8 + [_F] + [_P] * 3 + [ctypes.c_int],
        "megabase_dsa_attention_backward": [_P] * 7 + [_I] * 9 + [_F] + [_P] * 3 + [ctypes.c_int],
        "megabase_dsa_indexer_kl": [_P] * 5 + [_I] * 6 + [_F] + [_P] * 2 + [ctypes.c_int],
        "megabase_dsa_indexer_kl_backward": [_P] * 5 + [_I] * 7 + [_F] * 2 + [_P] * 3
        + [ctypes.c_int],
    }, native.REASSOCIATE)


def _seeds_lib():
    return native.bind(str(Path(__file__).with_name("seeds.c")), {
        "megabase_dsa_seeds": [_P] + [_I] * 9 + [_P, _P, ctypes.c_int]})


def available() -> bool:
    """Whether both C kernels are built (or can be) and enabled."""
    return _indexer_lib() is not None and _attention_lib() is not None


@torch.no_grad()
def dsa_indexer(q_idx, k_idx, w_idx=None, topk: int = 2048, scale=None, keep_recent: int = 0,
                block_q: int = reference.BLOCK_Q, block_k: int = reference.BLOCK_K, offset: int = 0):
    """Top-k causal keys per query: ``indices [B, Tq, topk]``, ascending positions, -1 padded.

    As :func:`megabase.kernels.dsa.reference.dsa_indexer` (``block_q``/``block_k`` size only the
    fallback's blocks).
    """
    lib = _indexer_lib() if q_idx.device.type == "cpu" else None
    if lib is None:
        return reference.dsa_indexer(q_idx, k_idx, w_idx, topk, scale, keep_recent, block_q,
                                     block_k, offset)
    B, Tq, HI, DI = q_idx.shape
    Tk = k_idx.shape[1]
    scale = DI**-0.5 if scale is None else scale
    q = q_idx.float().contiguous()
    kb = _vectors(k_idx.float())  # [B, Tk / VW, DI, VW]
    w = None if w_idx is None else w_idx.float().contiguous()
    out = torch.empty(B, Tq, topk, dtype=torch.long)
    status = lib.megabase_dsa_indexer(
        q.data_ptr(), kb.data_ptr(), None if w is None else w.data_ptr(), B, Tq, Tk, HI, DI, topk,
        scale, keep_recent, offset, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"the native DSA indexer could not allocate its top-{topk} buffers")
    return out


def _vectors(x: torch.Tensor) -> torch.Tensor:
    """``[B, n, *rest]`` -> ``[B, ceil(n / VW), *rest, VW]``: VW rows at a time, each block
    transposed so that one channel of VW rows is one vector (zero-padded)."""
    B, n = x.shape[:2]
    x = x.reshape(B, n, -1)
    if n % VW:  # (a pad of nothing would still copy the whole prefix)
        x = torch.nn.functional.pad(x, (0, 0, 0, (-n) % VW))
    return x.reshape(B, -1, VW, x.shape[-1]).transpose(2, 3).contiguous()


def block_summaries(k_idx: torch.Tensor, stage: Stage) -> torch.Tensor:
    """``k_idx [B, Tk, DI]`` -> ``[B, Tk // block, R, DI]``, as
    :func:`megabase.kernels.dsa.reference.block_summaries` (the mean summed in key order, so a
    streamed sequence gets the bits of its full pass)."""
    lib = _indexer_lib() if k_idx.device.type == "cpu" else None
    if lib is None:
        return reference.block_summaries(k_idx, stage)
    B, Tk, DI = k_idx.shape
    k = k_idx.detach().float().contiguous()
    out = torch.empty(B, Tk // stage.block, stage.rows, DI)
    lib.megabase_dsa_block_summaries(k.data_ptr(), B, Tk, DI, stage.block, stage.rows,
                                     out.data_ptr())
    return out


@torch.no_grad()
def candidate_indexer(q_idx, k_idx, w_idx, topk: int, stage: Stage, scale: float,
                      keep_recent: int, offset: int, seeds, summaries, block_q=None):
    """As :func:`megabase.kernels.dsa.reference.candidate_indexer` (``block_q`` ignored); a
    query's candidate scores are bit for bit those of :func:`dsa_indexer`."""
    lib = _indexer_lib() if q_idx.device.type == "cpu" else None
    if lib is None:
        return reference.candidate_indexer(q_idx, k_idx, w_idx, topk, stage, scale, keep_recent,
                                           offset, seeds, summaries, block_q)
    B, Tq, HI, DI = q_idx.shape
    Tk = k_idx.shape[1]
    kb, sb = _vectors(k_idx.float()), _vectors(summaries.float())  # [B, n / VW, R * DI, VW]
    q = q_idx.float().contiguous()
    w = None if w_idx is None else w_idx.float().contiguous()
    s = None if seeds is None or not seeds.shape[-1] else seeds.int().contiguous()
    out = torch.empty(B, Tq, topk, dtype=torch.long)
    status = lib.megabase_dsa_staged_indexer(
        q.data_ptr(), kb.data_ptr(), sb.data_ptr(),
        None if w is None else w.data_ptr(), None if s is None else s.data_ptr(),
        0 if s is None else s.shape[-1], B, Tq, Tk, HI, DI, topk, scale, keep_recent,
        offset, stage.block, stage.blocks, stage.local, stage.rows, out.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise MemoryError("the native candidate stage could not allocate its buffers")
    return out


staged_indexer = with_stage(dsa_indexer, block_summaries, candidate_indexer)


def seed_keys(tokens: torch.Tensor, offset: int, stage: Stage) -> torch.Tensor:
    """``tokens [B, Tk]`` -> ``[B, Tk - offset, S]`` int32, as
    :func:`megabase.kernels.dsa.reference.seed_keys` (the reference where no C kernel builds)."""
    lib = _seeds_lib()
    if lib is None:
        return reference.seed_keys(tokens, offset, stage)
    B, Tk = tokens.shape
    Tq, smax = Tk - offset, stage.max_seeds
    if not stage.seed or Tq <= 0:
        return torch.full((B, max(Tq, 0), 0), -1, dtype=torch.int32)
    tok = tokens.detach().to("cpu", torch.int64).contiguous()
    out = torch.empty(B, Tq, smax, dtype=torch.int32)
    most = ctypes.c_int64()
    status = lib.megabase_dsa_seeds(tok.data_ptr(), B, Tk, offset, stage.seed, stage.seed_cap,
                                    stage.carry, stage.block, stage.local, smax, out.data_ptr(),
                                    ctypes.byref(most), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"the seed table of {Tk:,} positions could not be allocated")
    return out[..., : most.value].contiguous().to(tokens.device)


def _sink(buffer: torch.Tensor | None, like: torch.Tensor) -> bool:
    """Whether the C backward can add ``like``'s gradient into ``buffer`` where it is: fp32,
    contiguous, the batch and row shape of ``like`` and at least its rows."""
    return (buffer is not None and buffer.dtype == torch.float32 and buffer.is_contiguous()
            and buffer.shape[0] == like.shape[0] and buffer.shape[2:] == like.shape[2:]
            and buffer.shape[1] >= like.shape[1])


class _Attention(torch.autograd.Function):
    """``q [B, Tq, HQ, D]``, ``k [B, Tk, H, D]``, ``v [B, Tk, H, DV]`` (fp32, contiguous),
    ``indices [B, Tq, K]`` -> ``(o [B, Tq, HQ, DV], probs [B, Tq, K])``. ``key_grads``: None, or
    ``(dk, dv)`` buffers (``_sink``) into which the backward adds the gradients of ``k`` and ``v``,
    which then get none from here."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale, key_grads):
        B, Tq, HQ, D = q.shape
        Tk, H, DV, K = k.shape[1], k.shape[2], v.shape[-1], indices.shape[-1]
        o = q.new_empty(B, Tq, HQ, DV)
        lse = q.new_empty(B, Tq, HQ)
        probs = q.new_empty(B, Tq, K)
        status = _attention_lib().megabase_dsa_attention_forward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), indices.data_ptr(), B * Tq, Tq, Tk, HQ, H,
            D, DV, K, scale, o.data_ptr(), lse.data_ptr(), probs.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError("the native DSA attention could not allocate its score buffer")
        # the selections are kept as int32 (half the bytes; positions stay below 2**31)
        ctx.save_for_backward(q, k, v, indices.to(torch.int32), o, lse)
        ctx.scale, ctx.key_grads = scale, key_grads
        ctx.mark_non_differentiable(probs)
        return o, probs

    @staticmethod
    @full_precision
    def backward(ctx, do, _dprobs):
        q, k, v, indices, o, lse = ctx.saved_tensors
        indices = indices.long()
        B, Tq, HQ, D = q.shape
        Tk, H, DV, K = k.shape[1], k.shape[2], v.shape[-1], indices.shape[-1]
        dq = torch.empty_like(q)
        sunk = ctx.key_grads is not None
        dk, dv = ctx.key_grads if sunk else (torch.zeros_like(k), torch.zeros_like(v))
        do = do.float().contiguous()
        _attention_lib().megabase_dsa_attention_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), indices.data_ptr(), o.data_ptr(),
            lse.data_ptr(), do.data_ptr(), B * Tq, Tq, Tk, dk.shape[1], HQ, H, D, DV, K,
            ctx.scale, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), torch.get_num_threads())
        return dq, None if sunk else dk, None if sunk else dv, None, None, None


@full_precision
def sparse_attention(q, k, v, indices, scale=None, block_q: int = reference.BLOCK_Q,
                     return_probs: bool = False, key_grads=None):
    """Attention of each query over its selected keys: ``o [B, Tq, HQ, DV]`` (dtype of q).

    As :func:`megabase.kernels.dsa.reference.sparse_attention` (``k, v`` may hold more keys than
    there are queries); ``block_q`` sizes only the fallback's blocks. ``key_grads``: None, or
    buffers ``(dk, dv)`` of ``[B, >= Tk, ...]`` into which the backward adds the gradients of ``k``
    and ``v`` (rows ``0..Tk``), which then get none through autograd.
    """
    if q.device.type != "cpu" or _attention_lib() is None or q.shape[1] == 0 or not indices.shape[-1]:
        if key_grads is not None:
            k, v = reference.grads_into(key_grads, k, v)
        return reference.sparse_attention(q, k, v, indices, scale, block_q, return_probs)
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    k, v = k.float().contiguous(), v.float().contiguous()
    if key_grads is not None and not (_sink(key_grads[0], k) and _sink(key_grads[1], v)):
        k, v = reference.grads_into(key_grads, k, v)
        key_grads = None
    o, probs = _Attention.apply(q.float().contiguous(), k, v, indices.long().contiguous(), scale,
                                key_grads)
    o = o.to(q.dtype)
    return (o, probs) if return_probs else o


class _IndexerKL(torch.autograd.Function):
    """Summed sparse KL. ``q_idx [B, Tq, HI, DI]``, ``k_idx [B, Tk, DI]``, ``w_idx [B, Tq, HI]``
    or None (fp32, contiguous), ``indices``/``target [B, Tq, K]``; ``key_grad``: None or a buffer
    (``_sink``) into which the backward adds ``k_idx``'s gradient. The forward keeps ``dI [B, Tq,
    K]`` (the loss's gradient by each selected score); the backward recomputes the rest from it."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, indices, target, scale, key_grad):
        B, Tq, HI, DI = q_idx.shape
        di = q_idx.new_empty(B, Tq, indices.shape[-1])
        total = _kl_value(q_idx, k_idx, w_idx, indices, target, scale, di)
        ctx.save_for_backward(q_idx, k_idx, w_idx, indices.to(torch.int32), di)
        ctx.scale, ctx.key_grad = scale, key_grad
        return q_idx.new_tensor(total)

    @staticmethod
    @full_precision
    def backward(ctx, grad):
        q_idx, k_idx, w_idx, indices, di = ctx.saved_tensors
        indices = indices.long()
        B, Tq, HI, DI = q_idx.shape
        Tk, K = k_idx.shape[1], indices.shape[-1]
        sunk = ctx.key_grad is not None
        dk = ctx.key_grad if sunk else torch.zeros_like(k_idx)
        dq, dw = torch.empty_like(q_idx), q_idx.new_empty(B, Tq, HI)
        _attention_lib().megabase_dsa_indexer_kl_backward(
            q_idx.data_ptr(), k_idx.data_ptr(), None if w_idx is None else w_idx.data_ptr(),
            indices.data_ptr(), di.data_ptr(), B * Tq, Tq, Tk, dk.shape[1], HI, DI, K, ctx.scale,
            float(grad), dq.data_ptr(), dk.data_ptr(), dw.data_ptr(), torch.get_num_threads())
        return (dq, None if sunk else dk, None if w_idx is None else dw, None, None, None, None)


def _kl_value(q_idx, k_idx, w_idx, indices, target, scale, di=None) -> float:
    """The C forward of the sparse KL: its sum (and ``dI`` into ``di`` unless None)."""
    B, Tq, HI, DI = q_idx.shape
    total = ctypes.c_double()
    status = _attention_lib().megabase_dsa_indexer_kl(
        q_idx.data_ptr(), k_idx.data_ptr(), None if w_idx is None else w_idx.data_ptr(),
        indices.data_ptr(), target.data_ptr(), B * Tq, Tq, k_idx.shape[1], HI, DI,
        indices.shape[-1], scale, ctypes.byref(total), None if di is None else di.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise MemoryError("the native DSA indexer loss could not allocate its buffers")
    return total.value


@full_precision
def indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale=None,
                      block_q: int = reference.KL_BLOCK_Q, key_grads=None):
    """``KL(p || softmax(I))`` on each query's selected set, averaged over queries.

    As :func:`megabase.kernels.dsa.reference.indexer_kl_sparse` (``block_q`` sizes only the
    fallback's blocks). ``key_grads``: None, or ``(dk_idx,)``, a buffer ``[B, >= Tk, DI]`` into
    which the backward adds ``k_idx``'s gradient (as :func:`sparse_attention`'s). Without
    autograd only the loss is computed.
    """
    if q_idx.device.type != "cpu" or _attention_lib() is None or q_idx.shape[1] == 0 \
            or not indices.shape[-1]:
        if key_grads is not None:
            (k_idx,) = reference.grads_into(key_grads, k_idx)
        return reference.indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale, block_q)
    B, Tq, HI, DI = q_idx.shape
    scale = DI**-0.5 if scale is None else scale
    q, k = q_idx.float().contiguous(), k_idx.float().contiguous()
    w = None if w_idx is None else w_idx.float().contiguous()
    idx, p = indices.long().contiguous(), target.float().contiguous()
    if not torch.is_grad_enabled() or not any(
            x is not None and x.requires_grad for x in (q, k, w)):
        return q.new_tensor(_kl_value(q, k, w, idx, p, scale)) / max(B * Tq, 1)
    key_grad = None if key_grads is None else key_grads[0]
    if key_grad is not None and not _sink(key_grad, k):
        (k,) = reference.grads_into(key_grads, k)
        key_grad = None
    total = _IndexerKL.apply(q, k, w, idx, p, scale, key_grad)
    return total / max(B * Tq, 1)


__all__ = ["available", "block_summaries", "candidate_indexer", "dsa_indexer", "indexer_kl_sparse",
           "seed_keys", "sparse_attention", "staged_indexer"]
