"""The Triton backend of DSA: the indexer with a fused top-k, the candidate stage, and (from
:mod:`megabase.kernels.dsa.triton_attention`) sparse attention and the sparse indexer KL. Same
signatures and results as :mod:`megabase.kernels.dsa.reference`; arguments that size only the
reference's blocks (``block_q``, ``block_k``) are accepted and ignored, the kernels pick their own.

- Indexer: one program per ``ROWS`` queries walks the visible keys in blocks of ``TOPK_P``
  (topk rounded up to a power of two), scores them (weighted ReLU of index dot products) and keeps
  a running top-k of composite int64 keys ``order(score) << 32 | position`` in registers: the merge
  of the sorted best list with a sorted block is ``max(best_desc, block_asc)`` then a sort (the
  bitonic "upper half" step). The T x T score matrix is never written. Ties go to the most recent
  key, as in the reference.
- Candidate stage (twin of :func:`megabase.kernels.dsa.reference.candidate_indexer`): a first
  kernel scores the block summaries of ``BLOCK_Q`` queries with ``tl.dot`` (the ``max`` bound as
  the products of the positive and negative parts of the queries) and keeps each query's best
  ``blocks`` with the same composite keys and merge (ties to the newer block), written out as
  ``[B, Tq, blocks]`` block ids: the only intermediate in global memory. A second kernel (one
  query per program on a GPU) walks each query's candidates as one virtual list, the kept
  blocks' keys, then the local window, then the seeds outside both, in chunks of ``TOPK_P``,
  gathers and scores them (the weighted ReLU, lane by lane) and keeps the running top-k: no
  candidate list is materialised. Its merges are bitonic networks of max/min rounds, the merge
  of a sorted chunk into the best list one bitonic merge (``log2 TOPK_P`` rounds). The block
  summaries are the reference's (a few reductions over the keys).

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported): that is how the tests check them against the reference at tiny shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import BLOCK_K, BLOCK_Q, NEG_INF_KEY, block_summaries
from .stage import Stage, with_stage
from .triton_attention import indexer_kl_sparse, pow2, sparse_attention

ROWS = 16  # queries per program of the exact indexer (the least tile tl.dot takes)

@triton.jit
def _indexer_kernel(Q, K, W, OUT, Tq, Tk, offset, keep_recent, scale,
                    sqb, sqt, sqh, sqd, skb, skt, skd, swb, swt, swh, sob, sot, sok,
                    HI: tl.constexpr, DI: tl.constexpr, DI_P: tl.constexpr, TOPK: tl.constexpr,
                    TOPK_P: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_W: tl.constexpr,
                    NEG_INF_KEY: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    rq = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    pos = rq + offset
    rd = tl.arange(0, DI_P)
    qmask = rq < Tq
    dmask = rd < DI
    best = tl.full([BLOCK_Q, TOPK_P], -(2**63), tl.int64)
    end = tl.minimum(offset + pid * BLOCK_Q + BLOCK_Q, Tk)
    for k0 in range(0, end, TOPK_P):
        rk = k0 + tl.arange(0, TOPK_P)
        kmask = rk < Tk
        kk = tl.load(K + b * skb + rk[:, None] * skt + rd[None, :] * skd,
                     mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = tl.zeros([BLOCK_Q, TOPK_P], dtype=tl.float32)
        for h in tl.static_range(HI):
            qh = tl.load(Q + b * sqb + rq[:, None] * sqt + h * sqh + rd[None, :] * sqd,
                         mask=qmask[:, None] & dmask[None, :], other=0.0)
            r = tl.maximum(tl.dot(qh * scale, tl.trans(kk), input_precision="ieee"), 0.0)
            if HAS_W:
                wh = tl.load(W + b * swb + rq * swt + h * swh, mask=qmask, other=0.0)
                s += wh[:, None] * r
            else:
                s += r
        visible = (rk[None, :] <= pos[:, None]) & kmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        recent = (rk[None, :] > pos[:, None] - keep_recent) & visible
        s = tl.where(recent, float("inf"), s)
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 and +0.0 are one score
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        cand = (key << 32) | rk[None, :].to(tl.int64)
        cand = tl.where(kmask[None, :], cand, -(2**63))
        best = tl.sort(tl.maximum(best, tl.sort(cand, dim=1)), dim=1, descending=True)
    col = tl.arange(0, TOPK_P)
    valid = (col[None, :] < TOPK) & ((best >> 32) > NEG_INF_KEY)
    chosen = tl.where(valid, best - ((best >> 32) << 32), 2**62)
    chosen = tl.sort(chosen, dim=1)
    chosen = tl.where(chosen == 2**62, -1, chosen)
    tl.store(OUT + b * sob + rq[:, None] * sot + col[None, :] * sok, chosen,
             mask=qmask[:, None] & (col[None, :] < TOPK))


def dsa_indexer(q_idx, k_idx, w_idx=None, topk: int = 2048, scale=None, keep_recent: int = 0,
                block_q: int = BLOCK_Q, block_k: int = BLOCK_K, offset: int = 0):
    """Triton twin of :func:`megabase.kernels.dsa.reference.dsa_indexer`: ``indices [B, Tq,
    topk]`` (``block_q``, ``block_k`` ignored: ``ROWS`` queries per program)."""
    B, Tq, HI, DI = q_idx.shape
    Tk = k_idx.shape[1]
    scale = DI**-0.5 if scale is None else scale
    q = q_idx.float().contiguous()
    k = k_idx.float().contiguous()
    w = (w_idx if w_idx is not None else q.new_ones(B, Tq, HI)).float().contiguous()
    out = torch.full((B, Tq, topk), -1, dtype=torch.long, device=q.device)
    if Tq == 0 or topk == 0:
        return out
    grid = (triton.cdiv(Tq, ROWS), B)
    _indexer_kernel[grid](
        q, k, w, out, Tq, Tk, offset, keep_recent, float(scale), *q.stride(), *k.stride(),
        *w.stride(), *out.stride(), HI=HI, DI=DI, DI_P=pow2(DI), TOPK=topk, TOPK_P=pow2(topk),
        BLOCK_Q=ROWS, HAS_W=w_idx is not None, NEG_INF_KEY=NEG_INF_KEY)
    return out


@triton.jit
def _order(s):
    """fp32 scores -> int64 keys of the same order (``-0.0`` folded into ``+0.0``)."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _sort(x, LOG_N: tl.constexpr, N_DIMS: tl.constexpr, DESCENDING: tl.constexpr):
    """``x`` sorted along its last axis (``2^LOG_N`` long, ``2^N_DIMS`` elements in all;
    ``DESCENDING`` 0 or 1): ``tl.sort``'s bitonic network on the ``[2] * N_DIMS`` hypercube, each
    compare-and-swap as the max and min of its pair. ``tl.sort`` finds the partner with an xor
    reduction, which the interpreter runs element by element in Python (seconds per sort at test
    shapes); max and min it runs in numpy, and on a GPU they are the same one shuffle."""
    h = tl.reshape(x, [2] * N_DIMS)
    for stage in tl.static_range(1, LOG_N + 1):
        if stage < LOG_N:  # runs of 2^stage in alternating directions
            flip = tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - 1 - stage) + [2] + [1] * stage)
        else:
            flip = DESCENDING
        for i in tl.static_range(stage):
            h = _swap(h, flip, N_DIMS - stage + i, N_DIMS)
    return tl.reshape(h, x.shape)


@triton.jit
def _swap(h, flip, AXIS: tl.constexpr, N_DIMS: tl.constexpr):
    """One compare-and-swap round of a bitonic network along ``AXIS`` of the hypercube ``h``:
    the max goes where ``flip`` differs from the position along the axis, the min elsewhere."""
    right = tl.reshape(tl.arange(0, 2), [1] * AXIS + [2] + [1] * (N_DIMS - 1 - AXIS))
    hi = tl.max(h, axis=AXIS, keep_dims=True)
    lo = tl.min(h, axis=AXIS, keep_dims=True)
    return tl.where((flip ^ right).to(tl.int1), hi, lo)


@triton.jit
def _merge_top(best, cand, LOG_N: tl.constexpr, N_DIMS: tl.constexpr):
    """The ``2^LOG_N`` largest of ``best`` (descending) and ``cand`` along the last axis,
    descending: ``max(best, sorted cand)`` is bitonic, so one bitonic merge (``LOG_N`` rounds)
    sorts it, where a full sort takes ``LOG_N (LOG_N + 1) / 2``."""
    h = tl.reshape(tl.maximum(best, _sort(cand, LOG_N, N_DIMS, 0)), [2] * N_DIMS)
    for i in tl.static_range(LOG_N):
        h = _swap(h, 1, N_DIMS - LOG_N + i, N_DIMS)
    return tl.reshape(h, best.shape)


@triton.jit
def _block_kernel(Q, W, SUM, CH, Tq, offset, scale,
                  sqb, sqt, sqh, sqd, swb, swt, swh, ssb, ssn, ssr, ssd, scb, sct, sck,
                  HI: tl.constexpr, DI: tl.constexpr, DI_P: tl.constexpr, BLOCK: tl.constexpr,
                  LOCAL: tl.constexpr, NKEEP: tl.constexpr, NKEEP_P: tl.constexpr,
                  BLOCK_Q: tl.constexpr, HAS_W: tl.constexpr, MAX: tl.constexpr,
                  LOG_N: tl.constexpr, N_DIMS: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    rq = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qmask = rq < Tq
    eligible = tl.maximum(rq + offset + 1 - LOCAL, 0) // BLOCK  # L(t) / block
    # the last query of the tile has the most eligible blocks (L(t) grows with t)
    end = tl.maximum(tl.minimum(pid * BLOCK_Q + BLOCK_Q, Tq) + offset - LOCAL, 0) // BLOCK
    rd = tl.arange(0, DI_P)
    dmask = rd < DI
    best = tl.full([BLOCK_Q, NKEEP_P], -(2**63), tl.int64)
    for n0 in range(0, end, NKEEP_P):
        rn = n0 + tl.arange(0, NKEEP_P)
        smask = (rn < end)[:, None] & dmask[None, :]
        top = tl.load(SUM + b * ssb + rn[:, None] * ssn + rd[None, :] * ssd, mask=smask, other=0.0)
        if MAX:
            bottom = tl.load(SUM + b * ssb + rn[:, None] * ssn + ssr + rd[None, :] * ssd,
                             mask=smask, other=0.0)
        s = tl.zeros([BLOCK_Q, NKEEP_P], dtype=tl.float32)
        for h in tl.static_range(HI):
            qh = tl.load(Q + b * sqb + rq[:, None] * sqt + h * sqh + rd[None, :] * sqd,
                         mask=qmask[:, None] & dmask[None, :], other=0.0) * scale
            if MAX:  # over the block, q . k lies in [qp . min + qn . max, qp . max + qn . min]
                qp, qn = tl.maximum(qh, 0.0), tl.minimum(qh, 0.0)
                up = (tl.dot(qp, tl.trans(top), input_precision="ieee")
                      + tl.dot(qn, tl.trans(bottom), input_precision="ieee"))
                if HAS_W:  # a negative weight turns the lower end into the bound
                    down = (tl.dot(qp, tl.trans(bottom), input_precision="ieee")
                            + tl.dot(qn, tl.trans(top), input_precision="ieee"))
                    wh = tl.load(W + b * swb + rq * swt + h * swh, mask=qmask, other=0.0)[:, None]
                    s += tl.where(wh >= 0, wh * tl.maximum(up, 0.0), wh * tl.maximum(down, 0.0))
                else:
                    s += tl.maximum(up, 0.0)
            else:
                r = tl.maximum(tl.dot(qh, tl.trans(top), input_precision="ieee"), 0.0)
                if HAS_W:
                    wh = tl.load(W + b * swb + rq * swt + h * swh, mask=qmask, other=0.0)
                    s += wh[:, None] * r
                else:
                    s += r
        cand = (_order(s) << 32) | rn[None, :].to(tl.int64)
        cand = tl.where(rn[None, :] < eligible[:, None], cand, -(2**63))
        best = _merge_top(best, cand, LOG_N, N_DIMS)
    col = tl.arange(0, NKEEP_P)
    chosen = (best - ((best >> 32) << 32)).to(tl.int32)
    tl.store(CH + b * scb + rq[:, None] * sct + col[None, :] * sck, chosen,
             mask=qmask[:, None] & (col[None, :] < NKEEP))


@triton.jit
def _staged_kernel(Q, K, W, CH, SEEDS, OUT, Tq, offset, keep_recent, scale, n_seeds,
                   sqb, sqt, sqh, sqd, skb, skt, skd, swb, swt, swh, scb, sct, sck,
                   seb, set_, sek, sob, sot, sok,
                   HI: tl.constexpr, DI: tl.constexpr, DI_P: tl.constexpr, TOPK: tl.constexpr,
                   TOPK_P: tl.constexpr, BLOCK: tl.constexpr, LOCAL: tl.constexpr,
                   NKEEP: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr,
                   NEG_INF_KEY: tl.constexpr, LOG_N: tl.constexpr, N_DIMS: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    rq = pid * ROWS + tl.arange(0, ROWS)
    qmask = rq < Tq
    t = (rq + offset)[:, None]
    L = (tl.maximum(t + 1 - LOCAL, 0) // BLOCK) * BLOCK  # [ROWS, 1]
    rd, rc = tl.arange(0, DI_P), tl.arange(0, TOPK_P)
    dmask = rd < DI
    ch = CH + b * scb + rq * sct
    # one virtual list per query: the kept blocks' keys (all before L(t)), the local window
    # L(t) .. t (at most LOCAL + BLOCK - 1 keys), then the seeds
    NB: tl.constexpr = NKEEP * BLOCK
    NL: tl.constexpr = LOCAL + BLOCK - 1
    best = tl.full([ROWS, TOPK_P], -(2**63), tl.int64)
    for c0 in range(0, NB + NL + n_seeds, TOPK_P):
        c = (c0 + rc)[None, :]
        in_blk, in_seed = c < NB, c >= NB + NL
        blk = tl.load(ch[:, None] + (c // BLOCK) * sck, mask=qmask[:, None] & in_blk, other=0)
        seed = tl.load(SEEDS + b * seb + rq[:, None] * set_ + (c - NB - NL) * sek,
                       mask=qmask[:, None] & in_seed & (c < NB + NL + n_seeds), other=-1)
        seed = seed.to(tl.int64)
        key = tl.where(in_blk, blk.to(tl.int64) * BLOCK + c % BLOCK,
                       tl.where(in_seed, seed, L + (c - NB)))
        valid = tl.where(in_blk, True, tl.where(in_seed, (seed >= 0) & (seed < L), key <= t))
        valid &= qmask[:, None]
        if c0 + TOPK_P > NB + NL:  # seeds inside a kept block are there already
            for i in range(NKEEP):
                kept = tl.load(ch + i * sck, mask=qmask, other=-1)
                valid &= ~in_seed | (seed // BLOCK != kept[:, None])
        safe = tl.where(valid, key, 0)
        kk = tl.load(K + b * skb + safe[:, :, None] * skt + rd[None, None, :] * skd,
                     mask=valid[:, :, None] & dmask[None, None, :], other=0.0)
        # each query has keys of its own: products lane by lane (as the C kernel), not a dot
        s = tl.zeros([ROWS, TOPK_P], dtype=tl.float32)
        for h in tl.static_range(HI):
            qh = tl.load(Q + b * sqb + rq[:, None] * sqt + h * sqh + rd[None, :] * sqd,
                         mask=qmask[:, None] & dmask[None, :], other=0.0) * scale
            r = tl.maximum(tl.sum(kk * qh[:, None, :], axis=2), 0.0)
            if HAS_W:
                s += tl.load(W + b * swb + rq * swt + h * swh, mask=qmask, other=0.0)[:, None] * r
            else:
                s += r
        s = tl.where(valid & (key > t - keep_recent), float("inf"), s)
        cand = tl.where(valid, (_order(s) << 32) | key, -(2**63))
        best = _merge_top(best, cand, LOG_N, N_DIMS)
    valid = (rc[None, :] < TOPK) & ((best >> 32) > NEG_INF_KEY)
    chosen = tl.where(valid, best - ((best >> 32) << 32), 2**62)
    chosen = _sort(chosen, LOG_N, N_DIMS, 0)
    chosen = tl.where(chosen == 2**62, -1, chosen)
    tl.store(OUT + b * sob + rq[:, None] * sot + rc[None, :] * sok, chosen,
             mask=qmask[:, None] & (rc[None, :] < TOPK))


def candidate_indexer(q_idx, k_idx, w_idx, topk: int, stage: Stage, scale: float,
                      keep_recent: int, offset: int, seeds, summaries, block_q: int | None = None):
    """Triton twin of :func:`megabase.kernels.dsa.reference.candidate_indexer`: ``indices [B, Tq,
    topk]`` of queries all at or past ``stage.first_staged()``. ``block_q``: queries per program
    of the candidate kernel; by default 1 on a GPU (a query's chunk of keys fills the registers)
    and as many as fit a modest tile under the interpreter (whose cost is per operation, whatever
    the tile: a sort costs the same for 1 or 256 rows). Global memory beyond the inputs and
    output: the kept blocks, ``[B, Tq, blocks]`` int32."""
    B, n, HI, DI = q_idx.shape
    cuda, dev = q_idx.is_cuda, q_idx.device
    out = torch.full((B, n, topk), -1, dtype=torch.long, device=dev)
    if topk == 0:
        return out
    q = q_idx.float().contiguous()
    k = k_idx.float().contiguous()
    w = (q.new_ones(1, 1, 1) if w_idx is None else w_idx.float()).contiguous()
    sm = summaries.to(dev, torch.float32).contiguous()
    has_seeds = seeds is not None and seeds.shape[-1] > 0
    sd = (seeds.to(dev, torch.int32).contiguous() if has_seeds else
          torch.full((1, 1, 1), -1, dtype=torch.int32, device=dev))
    chosen = torch.empty(B, n, stage.blocks, dtype=torch.int32, device=dev)
    bq = 16 if cuda else _interpreted_rows(n, stage.blocks, DI, 16)
    _block_kernel[(triton.cdiv(n, bq), B)](
        q, w, sm, chosen, n, offset, float(scale), *q.stride(), *w.stride(),
        *sm.stride(), *chosen.stride(), HI=HI, DI=DI, DI_P=pow2(DI), BLOCK=stage.block,
        LOCAL=stage.local, NKEEP=stage.blocks, NKEEP_P=pow2(stage.blocks), BLOCK_Q=bq,
        HAS_W=w_idx is not None, MAX=stage.summary == "max", **_cube(bq, stage.blocks))
    if block_q is not None:
        rows = triton.next_power_of_2(block_q)
    else:
        rows = 1 if cuda else _interpreted_rows(n, topk, DI, 1)
    _staged_kernel[(triton.cdiv(n, rows), B)](
        q, k, w, chosen, sd, out, n, offset, keep_recent, float(scale),
        sd.shape[-1] if has_seeds else 0, *q.stride(), *k.stride(), *w.stride(),
        *chosen.stride(), *sd.stride(), *out.stride(), HI=HI, DI=DI, DI_P=pow2(DI, 1),
        TOPK=topk, TOPK_P=pow2(topk), BLOCK=stage.block, LOCAL=stage.local,
        NKEEP=stage.blocks, ROWS=rows, HAS_W=w_idx is not None, NEG_INF_KEY=NEG_INF_KEY,
        **_cube(rows, topk))
    return out


staged_indexer = with_stage(dsa_indexer, block_summaries, candidate_indexer)


def _cube(rows: int, width: int) -> dict:
    """The sort arguments of ``[rows, pow2(width)]`` tiles (``rows`` a power of two)."""
    log_n = pow2(width).bit_length() - 1
    return dict(LOG_N=log_n, N_DIMS=log_n + rows.bit_length() - 1)


def _interpreted_rows(n: int, width: int, DI: int, least: int) -> int:
    """Queries per program under the interpreter: all ``n`` at once, up to a tile of ``2^22``
    elements (``rows x width x DI``, powers of two), at least ``least``."""
    fit = max(1, (1 << 22) // (pow2(width) * pow2(DI)))
    return max(least, min(pow2(n, 1), 1 << (fit.bit_length() - 1)))


__all__ = ["block_summaries", "candidate_indexer", "dsa_indexer", "indexer_kl_sparse",
           "sparse_attention", "staged_indexer"]
