"""Sparse attention and the sparse indexer loss as sparse-matrix products (plain PyTorch).

Same signatures and results as :mod:`megabase.kernels.dsa.reference` (the oracle), another
evaluation order; the CPU path where the C kernels cannot be built. A selection
``indices [B, Tq, topk]`` is the pattern of a CSR matrix with exactly ``topk`` slots per query row
(-1 slots point at a valid key and carry 0 or ``-inf``). Scores over the selected keys are a sampled dense-dense product
(``torch.sparse.sampled_addmm``), the weighted sums of values and the gradients of queries are
sparse x dense products, and the gradients of keys and values use the transposed pattern, built
by one stable sort of the column indices in the backward. No gathered ``[Tq, topk, H, D]``
tensor is formed, which is what the reference's cost on a CPU is: at 32,768 tokens and
``topk = 256`` its gathers move ~2 GB per layer and step.

Rows are processed ``ENTRIES // topk`` at a time, so temporaries stay ``O(ENTRIES)`` whatever
the length; under autograd only the inputs, the output and the log-sum-exp are kept.
"""

from __future__ import annotations

import warnings

import torch

from megabase.kernels.precision import full_precision

ENTRIES = 1 << 22  # selected (query, key) pairs per row block: 16 MiB per fp32 temporary


class Pattern:
    """The CSR pattern of rows ``r0 .. r1`` of a selection ``indices [B, Tq, K]`` over ``Tk`` keys.

    Batches are laid side by side: row ``b * Tq + t``, column ``b * Tk + s``. ``valid [R, K]``
    marks real slots; the others point at column ``b * Tk`` and must be given zero weight.
    """

    def __init__(self, indices: torch.Tensor, Tk: int, r0: int, r1: int):
        B, Tq, K = indices.shape
        rows = indices.reshape(B * Tq, K)[r0:r1]
        base = (torch.arange(r0, r1, device=indices.device) // Tq * Tk)[:, None]
        self.valid = rows >= 0
        # int32 indices: what MKL's sparse BLAS takes, so no conversion per product
        self.col = (rows.clamp(min=0) + base).reshape(-1).to(torch.int32)
        self.R, self.K, self.C = r1 - r0, K, B * Tk
        self.crow = torch.arange(0, self.R * K + 1, K, device=indices.device, dtype=torch.int32)
        self._empty = torch.zeros(self.R * K, device=indices.device)
        self._t = None

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        """``values [R, K]`` on this pattern: a sparse ``[R, C]`` CSR matrix."""
        with warnings.catch_warnings():  # "sparse CSR support is in beta": once, at the first use
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(self.crow, self.col, values.reshape(-1),
                                           size=(self.R, self.C), check_invariants=False)

    def sampled(self, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``alpha * a[r] . b[col]`` on every slot: ``a [R, D]``, ``b [C, D]`` -> ``[R, K]``."""
        out = torch.sparse.sampled_addmm(self.matrix(self._empty), a.contiguous(),
                                         b.contiguous().t(), beta=0.0, alpha=alpha)
        return out.values().reshape(self.R, self.K)

    def mm(self, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``sum_slots values[r, j] * x[col]``: ``[R, K] x [C, D] -> [R, D]``."""
        return self.matrix(values) @ x.contiguous()

    def mm_t(self, values: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The transposed product ``[R, K] x [R, D] -> [C, D]`` (scatter of rows onto keys)."""
        if self._t is None:
            perm = torch.sort(self.col, stable=True).indices
            counts = torch.bincount(self.col, minlength=self.C)
            crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
            self._t = perm, crow, (perm // self.K).to(torch.int32)
        perm, crow, rows = self._t
        values = torch.take(values, perm)
        return torch.sparse_csr_tensor(crow, rows, values, size=(self.C, self.R),
                                       check_invariants=False) @ y.contiguous()


def _blocks(indices: torch.Tensor, Tk: int):
    B, Tq, K = indices.shape
    step = max(1, ENTRIES // max(K, 1))
    for r0 in range(0, B * Tq, step):
        r1 = min(r0 + step, B * Tq)
        yield slice(r0, r1), Pattern(indices, Tk, r0, r1)


class _SparseAttention(torch.autograd.Function):
    """Softmax attention over the selected keys with a flash-style backward (scores recomputed).

    ``q [R, HQ, D]``, ``k [C, H, D]``, ``v [C, H, DV]`` fp32 (batches flattened), ``indices``
    ``[B, Tq, K]`` -> ``(o [R, HQ, DV], probs [R, K])``.
    """

    @staticmethod
    def forward(ctx, q, k, v, indices, scale):
        R, HQ, _ = q.shape
        C, H = k.shape[:2]
        G = HQ // H
        qh, kh, vh = _heads(q), _heads(k), _heads(v)
        o = q.new_empty(HQ, R, v.shape[-1])
        lse = q.new_empty(HQ, R)
        probs = q.new_empty(R, indices.shape[-1])
        for rows, pat in _blocks(indices, C // indices.shape[0]):
            ph = 0
            for hq in range(HQ):
                s = pat.sampled(qh[hq, rows], kh[hq // G], scale).masked_fill_(~pat.valid, -torch.inf)
                m = s.logsumexp(-1)
                m = m.masked_fill(~torch.isfinite(m), 0.0)
                p = s.sub_(m[:, None]).exp_()
                o[hq, rows] = pat.mm(p, vh[hq // G])
                lse[hq, rows] = m
                ph = ph + p
            probs[rows] = ph / ph.sum(-1, keepdim=True).clamp_min(1e-30)
        o = o.transpose(0, 1)
        ctx.save_for_backward(q, k, v, indices, o, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(probs)
        return o, probs

    @staticmethod
    @full_precision
    def backward(ctx, do, _dprobs):
        q, k, v, indices, o, lse = ctx.saved_tensors
        scale = ctx.scale
        HQ, H = q.shape[1], k.shape[1]
        G = HQ // H
        qh, kh, vh, doh = _heads(q), _heads(k), _heads(v), _heads(do)
        dq, dk, dv = torch.empty_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        delta = (do * o).sum(-1).t()  # [HQ, R]
        for rows, pat in _blocks(indices, k.shape[0] // indices.shape[0]):
            for hq in range(HQ):
                h = hq // G
                s = pat.sampled(qh[hq, rows], kh[h], scale).masked_fill_(~pat.valid, -torch.inf)
                p = s.sub_(lse[hq, rows, None]).exp_()
                ds = pat.sampled(doh[hq, rows], vh[h]).sub_(delta[hq, rows, None]).mul_(p)
                ds.mul_(scale)
                dq[hq, rows] = pat.mm(ds, kh[h])
                dk[h] += pat.mm_t(ds, qh[hq, rows])
                dv[h] += pat.mm_t(p, doh[hq, rows])
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1), None, None


def _heads(x: torch.Tensor) -> torch.Tensor:
    """``[N, H, D] -> [H, N, D]`` contiguous: each head's rows are one dense matrix."""
    return x.transpose(0, 1).contiguous()


@full_precision
def sparse_attention(q, k, v, indices, scale=None, block_q: int = 0, return_probs: bool = False):
    """Attention of each query over its selected keys: ``o [B, Tq, HQ, DV]`` (dtype of q).

    As :func:`megabase.kernels.dsa.reference.sparse_attention` (``k, v`` may hold more keys than
    there are queries); ``block_q`` is accepted for the shared signature, rows are blocked by
    :data:`ENTRIES`.
    """
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    K = indices.shape[-1]
    o, probs = _SparseAttention.apply(q.float().reshape(B * Tq, HQ, D),
                                      k.float().reshape(B * Tk, H, D),
                                      v.float().reshape(B * Tk, H, v.shape[-1]),
                                      _within_keys(indices, Tk), scale)
    o = o.reshape(B, Tq, HQ, v.shape[-1]).to(q.dtype)
    if not return_probs:
        return o
    return o, torch.nn.functional.pad(probs.reshape(B, Tq, probs.shape[-1]), (0, K - probs.shape[-1]))


def _within_keys(indices: torch.Tensor, Tk: int) -> torch.Tensor:
    """The first ``Tk`` slots when ``topk > Tk``: a query sees at most ``Tk`` distinct keys, the
    rest are -1, and a CSR row may not hold more slots than there are columns."""
    return indices[..., :Tk] if indices.shape[-1] > Tk else indices


class _SparseKL(torch.autograd.Function):
    """Summed ``KL(p || softmax(I))`` over the selected sets, gradients by hand.

    ``q_idx [R, HI, DI]``, ``k_idx [C, DI]``, ``w_idx [R, HI]``, ``target [R, K]`` -> scalar.
    """

    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, indices, target, scale):
        total = q_idx.new_zeros(())
        for rows, pat in _blocks(indices, k_idx.shape[0] // indices.shape[0]):
            _, logq = _index_scores(pat, q_idx[rows], k_idx, w_idx[rows], scale)
            p = target[rows].masked_fill(~pat.valid, 0.0)
            total += torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), 0.0).sum()
        ctx.save_for_backward(q_idx, k_idx, w_idx, indices, target)
        ctx.scale = scale
        return total

    @staticmethod
    @full_precision
    def backward(ctx, grad):
        q_idx, k_idx, w_idx, indices, target = ctx.saved_tensors
        scale = ctx.scale
        dq, dk, dw = torch.empty_like(q_idx), torch.zeros_like(k_idx), torch.empty_like(w_idx)
        for rows, pat in _blocks(indices, k_idx.shape[0] // indices.shape[0]):
            heads, logq = _index_scores(pat, q_idx[rows], k_idx, w_idx[rows], scale)
            p = target[rows].masked_fill(~pat.valid, 0.0)
            # d/dI of -sum p log softmax(I) = softmax(I) * sum(p) - p; slots off the set have q = 0
            soft = logq.exp().masked_fill(~pat.valid, 0.0)
            di = (soft * p.sum(-1, keepdim=True) - p) * grad
            for j, a in enumerate(heads):
                dw[rows, j] = (di * a.clamp(min=0)).sum(-1)
                da = di * w_idx[rows, j, None] * (a > 0) * scale
                dq[rows, j] = pat.mm(da, k_idx)
                dk += pat.mm_t(da, q_idx[rows, j])
        return dq, dk, dw, None, None, None


def _index_scores(pat: Pattern, q_idx, k_idx, w_idx, scale):
    """Per-head pre-activations ``[R, K]`` and ``log softmax`` of the weighted index scores over
    each row's selected set (``-inf`` off the set)."""
    heads = [pat.sampled(q_idx[:, j], k_idx, scale) for j in range(q_idx.shape[1])]
    score = sum(a.clamp(min=0) * w_idx[:, j, None] for j, a in enumerate(heads))
    return heads, score.masked_fill(~pat.valid, -torch.inf).log_softmax(-1)


@full_precision
def indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale=None, block_q: int = 0):
    """``KL(p || softmax(I))`` on each query's selected set, averaged over queries.

    As :func:`megabase.kernels.dsa.reference.indexer_kl_sparse`; ``w_idx=None`` weighs every
    index head 1.
    """
    B, Tq, HI, DI = q_idx.shape
    Tk = k_idx.shape[1]
    scale = DI**-0.5 if scale is None else scale
    w = q_idx.new_ones(B, Tq, HI) if w_idx is None else w_idx
    indices = _within_keys(indices, Tk)
    target = target[..., : indices.shape[-1]]
    total = _SparseKL.apply(q_idx.float().reshape(B * Tq, HI, DI), k_idx.float().reshape(B * Tk, DI),
                            w.float().reshape(B * Tq, HI), indices, target.float().reshape(B * Tq, -1),
                            scale)
    return total / max(B * Tq, 1)
