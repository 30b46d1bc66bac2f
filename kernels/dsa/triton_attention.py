"""Sparse attention and the sparse indexer loss in Triton (the Triton backend's half that reads a
selection; :mod:`megabase.kernels.dsa.triton_kernels` makes it, and is the backend the dispatch
uses). Same conventions and results as :mod:`megabase.kernels.dsa.reference`.

- Sparse attention: one program per query gathers its selected keys/values (GQA: all query heads of
  a key/value head at once), saves the log-sum-exp, and in backward recomputes the probabilities,
  writes dq and adds dk, dv to the selected rows with atomics.
- Indexer KL: one program per query computes ``KL(p || softmax(I))`` on the selected set and, for
  the gradient, ``softmax(I) * sum(p) - p`` pushed through the weighted ReLU to q_idx, w_idx and
  (atomically) k_idx: the indexer trains without a dense pass.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import BLOCK_Q, KL_BLOCK_Q


def pow2(n: int, floor: int = 16) -> int:
    """``n`` rounded up to a power of two, at least ``floor``: a Triton tile's extent."""
    return max(floor, triton.next_power_of_2(int(n)))


@triton.jit
def _selection(IDX, b, t, sib, sit, sik, TOPK: tl.constexpr, TOPK_P: tl.constexpr):
    """A query's selected keys: ``(valid, safe)``, the -1 slots pointed at row 0 (masked)."""
    rk = tl.arange(0, TOPK_P)
    idx = tl.load(IDX + b * sib + t * sit + rk * sik, mask=rk < TOPK, other=-1)
    valid = idx >= 0
    return valid, tl.where(valid, idx, 0)


@triton.jit
def _head_tiles(Q, K, V, b, t, h, valid, safe, sqb, sqt, sqh, sqd, skb, skt, skh, skd,
                svb, svt, svh, svd, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
                D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr):
    """The query heads of key/value head ``h`` ``[G_P, D_P]`` and its selected keys
    ``[TOPK_P, D_P]`` and values ``[TOPK_P, DV_P]`` (zeros where masked)."""
    rg, rd, rv = tl.arange(0, G_P), tl.arange(0, D_P), tl.arange(0, DV_P)
    q = tl.load(Q + b * sqb + t * sqt + (h * G + rg)[:, None] * sqh + rd[None, :] * sqd,
                mask=(rg < G)[:, None] & (rd[None, :] < D), other=0.0)
    k = tl.load(K + b * skb + safe[:, None] * skt + h * skh + rd[None, :] * skd,
                mask=valid[:, None] & (rd[None, :] < D), other=0.0)
    v = tl.load(V + b * svb + safe[:, None] * svt + h * svh + rv[None, :] * svd,
                mask=valid[:, None] & (rv[None, :] < DV), other=0.0)
    return q, k, v


@triton.jit
def _sparse_fwd_kernel(Q, K, V, IDX, O, LSE, P, scale,
                       sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                       sib, sit, sik, sob, sot, soh, sod, slb, slt, slh, spb, spt, spk,
                       H: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
                       D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
                       TOPK: tl.constexpr, TOPK_P: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    rk = tl.arange(0, TOPK_P)
    valid, safe = _selection(IDX, b, t, sib, sit, sik, TOPK, TOPK_P)
    rg, rv = tl.arange(0, G_P), tl.arange(0, DV_P)
    gmask = rg < G
    ph = tl.zeros([TOPK_P], dtype=tl.float32)
    for h in tl.static_range(H):
        q, k, v = _head_tiles(Q, K, V, b, t, h, valid, safe, sqb, sqt, sqh, sqd, skb, skt, skh,
                              skd, svb, svt, svh, svd, G, G_P, D, D_P, DV, DV_P)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp(s - m[:, None])
        l = tl.maximum(tl.sum(p, axis=1), 1e-30)
        o = tl.sum(p[:, :, None] * v[None, :, :], axis=1) / l[:, None]
        tl.store(O + b * sob + t * sot + (h * G + rg)[:, None] * soh + rv[None, :] * sod, o,
                 mask=gmask[:, None] & (rv[None, :] < DV))
        tl.store(LSE + b * slb + t * slt + (h * G + rg) * slh, m + tl.log(l), mask=gmask)
        ph += tl.sum(tl.where(gmask[:, None], p / l[:, None], 0.0), axis=0)
    ph = ph / tl.maximum(tl.sum(ph, axis=0), 1e-30)
    tl.store(P + b * spb + t * spt + rk * spk, ph, mask=rk < TOPK)


@triton.jit
def _sparse_bwd_kernel(Q, K, V, IDX, O, LSE, DO, DQ, DK, DV_, scale,
                       sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                       sib, sit, sik, sob, sot, soh, sod, slb, slt, slh,
                       H: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
                       D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
                       TOPK: tl.constexpr, TOPK_P: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    valid, safe = _selection(IDX, b, t, sib, sit, sik, TOPK, TOPK_P)
    rg, rd, rv = tl.arange(0, G_P), tl.arange(0, D_P), tl.arange(0, DV_P)
    gmask = rg < G
    qm, om = gmask[:, None] & (rd[None, :] < D), gmask[:, None] & (rv[None, :] < DV)
    km, vm = valid[:, None] & (rd[None, :] < D), valid[:, None] & (rv[None, :] < DV)
    for h in tl.static_range(H):
        rows = h * G + rg
        q, k, v = _head_tiles(Q, K, V, b, t, h, valid, safe, sqb, sqt, sqh, sqd, skb, skt, skh,
                              skd, svb, svt, svh, svd, G, G_P, D, D_P, DV, DV_P)
        o = tl.load(O + b * sob + t * sot + rows[:, None] * soh + rv[None, :] * sod, mask=om,
                    other=0.0)
        do = tl.load(DO + b * sob + t * sot + rows[:, None] * soh + rv[None, :] * sod, mask=om,
                     other=0.0)
        lse = tl.load(LSE + b * slb + t * slt + rows * slh, mask=gmask, other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        p = tl.where(valid[None, :] & gmask[:, None], tl.exp(s - lse[:, None]), 0.0)
        dp = tl.sum(do[:, None, :] * v[None, :, :], axis=2)
        delta = tl.sum(do * o, axis=1)
        ds = p * (dp - delta[:, None]) * scale
        dq = tl.sum(ds[:, :, None] * k[None, :, :], axis=1)
        tl.store(DQ + b * sqb + t * sqt + rows[:, None] * sqh + rd[None, :] * sqd, dq, mask=qm)
        dk = tl.sum(ds[:, :, None] * q[:, None, :], axis=0)
        dv = tl.sum(p[:, :, None] * do[:, None, :], axis=0)
        tl.atomic_add(DK + b * skb + safe[:, None] * skt + h * skh + rd[None, :] * skd, dk, mask=km)
        tl.atomic_add(DV_ + b * svb + safe[:, None] * svt + h * svh + rv[None, :] * svd, dv,
                      mask=vm)


def _attn_meta(q, k, v, topk):
    HQ, H = q.shape[2], k.shape[2]
    G = HQ // H
    return dict(H=H, G=G, G_P=pow2(G, 1), D=q.shape[3], D_P=pow2(q.shape[3], 1), DV=v.shape[3],
                DV_P=pow2(v.shape[3], 1), TOPK=topk, TOPK_P=pow2(topk, 1))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx, scale):
        B, Tq, HQ, _ = q.shape
        o = q.new_empty(B, Tq, HQ, v.shape[-1])
        lse = q.new_empty(B, Tq, HQ)
        probs = q.new_empty(B, Tq, idx.shape[-1])
        meta = _attn_meta(q, k, v, idx.shape[-1])
        if Tq:
            _sparse_fwd_kernel[(Tq, B)](q, k, v, idx, o, lse, probs, float(scale), *q.stride(),
                                        *k.stride(), *v.stride(), *idx.stride(), *o.stride(),
                                        *lse.stride(), *probs.stride(), **meta)
        ctx.save_for_backward(q, k, v, idx, o, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(probs)
        return o, probs

    @staticmethod
    def backward(ctx, do, _dprobs):
        q, k, v, idx, o, lse = ctx.saved_tensors
        B, Tq = q.shape[:2]
        do = do.contiguous()
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        if Tq:
            _sparse_bwd_kernel[(Tq, B)](q, k, v, idx, o, lse, do, dq, dk, dv, float(ctx.scale),
                                        *q.stride(), *k.stride(), *v.stride(), *idx.stride(),
                                        *o.stride(), *lse.stride(),
                                        **_attn_meta(q, k, v, idx.shape[-1]))
        return dq, dk, dv, None, None


def sparse_attention(q, k, v, indices, scale=None, block_q: int = BLOCK_Q,
                     return_probs: bool = False):
    """Triton twin of :func:`megabase.kernels.dsa.reference.sparse_attention`: ``o [B, Tq, HQ,
    DV]`` (and ``probs [B, Tq, topk]``); ``block_q`` is accepted and ignored (one program per
    query)."""
    HQ, H = q.shape[2], k.shape[2]
    if HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({H})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, probs = _SparseAttention.apply(q.float().contiguous(), k.float().contiguous(),
                                      v.float().contiguous(), indices.contiguous(), scale)
    o = o.to(q.dtype)
    return (o, probs) if return_probs else o


@triton.jit
def _kl_kernel(QI, KI, WI, IDX, P, LOSS, DQ, DK, DW, scale, gscale,
               sqb, sqt, sqh, sqd, skb, skt, skd, swb, swt, swh, sib, sit, sik, spb, spt, spk,
               HI: tl.constexpr, DI: tl.constexpr, DI_P: tl.constexpr, TOPK: tl.constexpr,
               TOPK_P: tl.constexpr, HAS_W: tl.constexpr, GRAD: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    Tq = tl.num_programs(0)
    rk = tl.arange(0, TOPK_P)
    valid, safe = _selection(IDX, b, t, sib, sit, sik, TOPK, TOPK_P)
    rd = tl.arange(0, DI_P)
    dmask = rd < DI
    kk = tl.load(KI + b * skb + safe[:, None] * skt + rd[None, :] * skd,
                 mask=valid[:, None] & dmask[None, :], other=0.0)
    score = tl.zeros([TOPK_P], dtype=tl.float32)
    for h in tl.static_range(HI):
        qh = tl.load(QI + b * sqb + t * sqt + h * sqh + rd * sqd, mask=dmask, other=0.0)
        sh = tl.sum(qh[None, :] * kk, axis=1) * scale
        if HAS_W:
            score += tl.load(WI + b * swb + t * swt + h * swh) * tl.maximum(sh, 0.0)
        else:
            score += tl.maximum(sh, 0.0)
    score = tl.where(valid, score, float("-inf"))
    m = tl.max(score, axis=0)
    e = tl.where(valid, tl.exp(score - m), 0.0)
    z = tl.sum(e, axis=0)
    logq = tl.where(valid, score - m - tl.log(z), 0.0)
    p = tl.load(P + b * spb + t * spt + rk * spk, mask=(rk < TOPK) & valid, other=0.0)
    kl = tl.sum(tl.where(p > 0, p * (tl.log(tl.maximum(p, 1e-30)) - logq), 0.0), axis=0)
    tl.store(LOSS + b * Tq + t, kl)
    if GRAD:
        g = tl.where(valid, (e / z) * tl.sum(p, axis=0) - p, 0.0) * gscale
        dk = tl.zeros([TOPK_P, DI_P], dtype=tl.float32)
        for h in tl.static_range(HI):
            qh = tl.load(QI + b * sqb + t * sqt + h * sqh + rd * sqd, mask=dmask, other=0.0)
            sh = tl.sum(qh[None, :] * kk, axis=1) * scale
            if HAS_W:
                wh = tl.load(WI + b * swb + t * swt + h * swh)
                tl.store(DW + b * swb + t * swt + h * swh, tl.sum(g * tl.maximum(sh, 0.0), axis=0))
                gs = tl.where(sh > 0, g * wh * scale, 0.0)
            else:
                gs = tl.where(sh > 0, g * scale, 0.0)
            tl.store(DQ + b * sqb + t * sqt + h * sqh + rd * sqd,
                     tl.sum(gs[:, None] * kk, axis=0), mask=dmask)
            dk += gs[:, None] * qh[None, :]
        tl.atomic_add(DK + b * skb + safe[:, None] * skt + rd[None, :] * skd, dk,
                      mask=valid[:, None] & dmask[None, :])


class _IndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, indices, target, scale):
        B, Tq, HI, DI = q_idx.shape
        has_w = w_idx is not None
        w = w_idx if has_w else q_idx.new_ones(B, Tq, HI)
        loss = q_idx.new_zeros(B, Tq)
        args = (q_idx, k_idx, w, indices, target)
        ctx.save_for_backward(*args)
        ctx.scale, ctx.has_w = scale, has_w
        if Tq:
            _kl_launch(*args, loss, None, None, None, scale, 0.0, has_w, grad=False)
        return loss.sum() / max(B * Tq, 1)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, w, indices, target = ctx.saved_tensors
        B, Tq = q_idx.shape[:2]
        dq, dk, dw = torch.zeros_like(q_idx), torch.zeros_like(k_idx), torch.zeros_like(w)
        if Tq:
            _kl_launch(q_idx, k_idx, w, indices, target, q_idx.new_zeros(B, Tq), dq, dk, dw,
                       ctx.scale, float(grad) / max(B * Tq, 1), ctx.has_w, grad=True)
        return dq, dk, dw if ctx.has_w else None, None, None, None


def _kl_launch(q, k, w, idx, p, loss, dq, dk, dw, scale, gscale, has_w, grad):
    B, Tq, HI, DI = q.shape
    dq, dk, dw = (x if x is not None else q for x in (dq, dk, dw))
    _kl_kernel[(Tq, B)](q, k, w, idx, p, loss, dq, dk, dw, float(scale), float(gscale),
                        *q.stride(), *k.stride(), *w.stride(), *idx.stride(), *p.stride(),
                        HI=HI, DI=DI, DI_P=pow2(DI, 1), TOPK=idx.shape[-1],
                        TOPK_P=pow2(idx.shape[-1], 1), HAS_W=has_w, GRAD=grad)


def indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale=None,
                      block_q: int = KL_BLOCK_Q):
    """Triton twin of :func:`megabase.kernels.dsa.reference.indexer_kl_sparse` (a scalar);
    ``block_q`` is accepted and ignored (one program per query)."""
    scale = q_idx.shape[-1] ** -0.5 if scale is None else scale
    return _IndexerKL.apply(q_idx.float().contiguous(), k_idx.float().contiguous(),
                            None if w_idx is None else w_idx.float().contiguous(),
                            indices.contiguous(), target.float().contiguous(), scale)
