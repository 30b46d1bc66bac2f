"""DeepSeek Sparse Attention in plain PyTorch, memory-bounded (never a T x T tensor): the oracle of
the C (:mod:`.cpu`) and Triton (:mod:`.triton_kernels`) backends, which share its signatures.

Conventions of ``fla.ops.dsa.naive_dsa``::

    q [B, T, HQ, D]   k [B, T, H, D]   v [B, T, H, DV]      (GQA: HQ a multiple of H)
    q_idx [B, T, HI, DI]   k_idx [B, T, DI]   w_idx [B, T, HI] or None
    indices [B, T, topk]  (int64, padded with -1)

**Exact indexer.** ``I[t, s] = sum_j w[t, j] * relu(scale * q_idx[t, j] . k_idx[s])`` for
``s <= t`` in query blocks x key blocks, keeping a running top-k per query: peak memory
O(block_q * (topk + block_k)), ``block_k`` being the widest key chunk. Selection is by (score
desc, position desc): a total order, so any blocking gives the same set.

**Candidate stage** (:class:`~.stage.Stage`). From ``Stage.first_staged()`` on, a query at ``t``
scores only its candidates, then takes their top-k in the exact order:

* the local window: keys ``L(t) .. t``, ``L(t) = block * floor((t + 1 - local) / block)``, so
  between ``local`` and ``local + block - 1`` of the latest keys, always;
* the best ``blocks`` blocks: the keys before ``L(t)`` fall into whole blocks of ``block`` keys
  (aligned to position 0), each with a summary ``[B, Tk // block, R, DI]`` that the query scores
  first. ``mean`` (HISA, ``R`` = 1): the mean key, scored as a key is. ``max`` (Quest, ``R`` = 2:
  max then min per channel): they bound ``q . k`` over the block from above (and below), so with
  the ReLU and the sign of each head's weight they bound every key's index score in it: a lone
  spike is not averaged away;
* the seeds ``[B, Tq, S]`` (-1 padded): keys that continue an earlier copy of the query's last
  ``seed`` bases (:func:`seed_keys`).

**Seeds.** A query at ``t`` hashes the ``seed`` tokens ending at ``t``; the key at ``s`` the ones
ending at ``s - 1``. Where the ``k``-mer ending at ``u`` occurred before, ending at ``e``, key ``e +
1`` holds the base that followed the earlier copy (the one a copying head wants); if the
``k``-mer ending at ``e`` is the reverse complement of ``u``'s, the base after ``u`` pairs with the
one before ``e - k + 1``: key ``e - k``. A query follows the hits of the last ``carry + 1``
positions along their diagonals (key ``e + 1 + d`` for the hit of ``u = t - d``, ``e - k - d`` on
the other strand), so a copy with a mismatch stays found (the substitution-tolerant repeat models
of GeCo3 / JARVIS). Each ``k``-mer follows at most ``seed_cap`` earlier occurrences per strand (the
most recent): a low-complexity ``k``-mer costs no more than a rare one. Keys inside the local
window are left out (kept anyway), repeats too, and at most ``Stage.max_seeds`` are kept in the
order found: ``d`` ascending, forward before reverse, newest occurrence first.

**Sparse attention** gathers the selected keys one query block at a time (flash-style backward),
so it keeps O(T * topk) indices and nothing quadratic. When ``T <= topk`` every earlier key is
selected and the layer is exactly dense causal attention.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from megabase.kernels.precision import full_precision

from .stage import Stage, with_stage

BLOCK_Q = 256
BLOCK_K = 8192
KL_BLOCK_Q = 1024  # queries per step of the sparse indexer loss


def index_scores(q_idx, k_idx, w_idx, scale):
    """``[B, Tq, HI, DI] x [B, Tk, DI] -> [B, Tq, Tk]`` weighted-ReLU index scores (fp32).

    One product per index head, ReLU and weighted accumulation in place: the scores are the
    indexer's whole cost (O(T^2)), so no temporary wider than one head is formed.
    """
    HI = q_idx.shape[2]
    s = torch.matmul(q_idx.float().transpose(1, 2) * scale, k_idx.float().transpose(1, 2)[:, None])
    if torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad
                                    or (w_idx is not None and w_idx.requires_grad)):
        s = s.clamp(min=0)  # out of place: autograd needs the intermediates
        return s.sum(1) if w_idx is None else (s * w_idx.float().transpose(1, 2)[..., None]).sum(1)
    s = s.clamp_(min=0)  # [B, HI, Tq, Tk]
    if w_idx is None:
        return s.sum(1)
    w = w_idx.float()
    acc = s[:, 0].mul_(w[:, :, 0:1])
    for h in range(1, HI):
        acc.addcmul_(s[:, h], w[:, :, h : h + 1])
    return acc


@torch.no_grad()
@full_precision
def dsa_indexer(q_idx, k_idx, w_idx=None, topk: int = 2048, scale=None, keep_recent: int = 0,
                block_q: int = BLOCK_Q, block_k: int = BLOCK_K, offset: int = 0):
    """Top-k causal keys per query: ``indices [B, Tq, topk]``, ascending positions, -1 padded.

    Selection is by score, ties going to the most recent key (a total order: any blocking of the
    keys gives the same set). Keys are scanned from the diagonal backwards in chunks that double
    up to ``block_k``; once a query holds ``topk`` candidates only scores at or above its k-th
    enter the merge, so the top-k work shrinks as the prefix grows.

    Args:
        keep_recent: always select the ``keep_recent`` most recent keys (``t - r < s <= t``).
        offset: position of the first query within the keys (for streaming: keys ``[0, offset + Tq)``
            are ``k_idx``, queries are the last ``Tq`` positions).
    """
    B, Tq, HI, DI = q_idx.shape
    Tk = k_idx.shape[1]
    scale = DI**-0.5 if scale is None else scale
    out = torch.full((B, Tq, topk), -1, dtype=torch.long, device=q_idx.device)
    # Query blocks are zero-padded to block_q rows: one product shape, so a score is bit-for-bit
    # the same whatever the sequence length (streaming and full passes agree).
    q_pad = _pad_rows(q_idx, block_q)
    w_pad = None if w_idx is None else _pad_rows(w_idx, block_q)
    first = max(block_q, min(topk, block_k))
    for q0 in range(0, Tq, block_q):
        q1 = min(q0 + block_q, Tq)
        pos = torch.arange(q0, q0 + block_q, device=q_idx.device) + offset
        best = None  # [B, block_q, <= topk] composite keys, see _composite
        end, width = min(offset + q1, Tk), first
        while end > 0:
            k0 = max(0, end - width)
            keys = torch.arange(k0, end, device=q_idx.device)
            s = index_scores(q_pad[:, q0 : q0 + block_q], k_idx[:, k0:end],
                             None if w_pad is None else w_pad[:, q0 : q0 + block_q], scale)
            if end > offset + q0 or (keep_recent and end > offset + q0 - keep_recent + 1):
                invisible = keys[None, :] > pos[:, None]
                s = s.masked_fill(invisible[None], float("-inf"))
                if keep_recent:
                    recent = (keys[None, :] > pos[:, None] - keep_recent) & ~invisible
                    s = s.masked_fill(recent[None], float("inf"))
            best = _merge(best, s, k0, topk)
            end, width = k0, min(2 * width, block_k)
        out[:, q0:q1] = _positions(best, topk)[:, : q1 - q0]
    return out


def _order_key(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 with the same order (``-0.0`` is folded into ``+0.0`` first)."""
    bits = (s + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _order_value(key: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_order_key`: int64 order keys -> fp32."""
    bits = torch.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(torch.int32).view(torch.float32)


# a composite key whose score part (>> 32) is at or below this one is no selection (masked, padding)
NEG_INF_KEY = int(_order_key(torch.tensor([float("-inf")]))[0])
_MIN_KEY = -(1 << 63)  # below every composite key: padding of candidate rows


def _composite(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One int64 per candidate ordering by (score desc, position desc): ``key(score) * 2^32 + pos``.

    A single integer top-k then realises the total order; ties go to the most recent key, so the
    selection does not depend on how keys were split into blocks.
    """
    return _order_key(scores) * (1 << 32) + keys


def _positions(best: torch.Tensor, topk: int) -> torch.Tensor:
    """Composite keys ``best [B, bq, n <= topk]`` -> ``[B, bq, topk]``: their positions ascending,
    those of ``-inf`` scores or padding dropped, -1 padded."""
    none = 1 << 40  # past every position: sorts last
    idx = (best & 0xFFFFFFFF).masked_fill((best >> 32) <= NEG_INF_KEY, none).sort(-1).values
    out = torch.full((*best.shape[:2], topk), -1, dtype=torch.long, device=best.device)
    out[..., : idx.shape[-1]] = idx.masked_fill(idx == none, -1)
    return out


def _merge(best, scores, k0: int, topk: int):
    """The top ``topk`` of ``best`` (composite keys) and a chunk's ``scores [B, bq, n]`` of keys
    ``k0 .. k0 + n``.

    Only a chunk's candidates that can enter are encoded, gathered into a ``-inf``-padded row of
    the widest row's count: with ``best`` full, those above its k-th score (strictly: the chunk's
    keys are older than every key in ``best``, so a tie with the k-th loses), else those at or
    above the chunk's own k-th score.
    """
    B, bq, n = scores.shape
    if best is not None and best.shape[-1] >= topk:
        floor, above = _order_value(best.amin(-1) >> 32), torch.gt
    elif n > topk:
        floor, above = scores.topk(topk, dim=-1, sorted=False).values.amin(-1), torch.ge
    else:
        floor = None
    if floor is None:
        cand = _composite(scores, torch.arange(k0, k0 + n, device=scores.device))
    else:
        b, row, col = above(scores, floor[..., None]).nonzero(as_tuple=True)
        if b.numel() == 0:
            return best
        flat = b * bq + row
        counts = torch.bincount(flat, minlength=B * bq)
        c = int(counts.amax())
        rank = torch.arange(flat.shape[0], device=scores.device) - (counts.cumsum(0) - counts)[flat]
        cand = torch.full((B * bq, c), _MIN_KEY, dtype=torch.long, device=scores.device)
        cand[flat, rank] = _composite(scores[b, row, col], col + k0)
        cand = cand.reshape(B, bq, c)
    both = cand if best is None else torch.cat([best, cand], dim=-1)
    return both.topk(min(topk, both.shape[-1]), dim=-1, sorted=False).values


def _pad_rows(x, multiple: int):
    """Zero-pad dim 1 of ``x`` to a multiple of ``multiple``."""
    pad = (-x.shape[1]) % multiple
    if not pad:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)


def _gather(x, idx):
    """``x [B, T, *rest]``, ``idx [B, Tq, K]`` (>= 0) -> ``[B, Tq, K, *rest]``.

    ``index_select`` on the flattened rows: its backward is ``index_add_``, far faster on CPU than
    the accumulating ``index_put_`` that advanced indexing differentiates to.
    """
    B, T = x.shape[:2]
    flat = (idx + torch.arange(B, device=x.device)[:, None, None] * T).reshape(-1)
    return x.reshape(B * T, *x.shape[2:]).index_select(0, flat).reshape(*idx.shape, *x.shape[2:])


@torch.no_grad()
@full_precision
def block_summaries(k_idx: torch.Tensor, stage: Stage) -> torch.Tensor:
    """``k_idx [B, Tk, DI]`` -> ``[B, Tk // block, R, DI]``: the summary of every whole block."""
    B, Tk, DI = k_idx.shape
    n = Tk // stage.block
    blocks = k_idx[:, : n * stage.block].float().reshape(B, n, stage.block, DI)
    if stage.summary == "mean":
        return blocks.mean(2, keepdim=True)
    return torch.stack([blocks.amax(2), blocks.amin(2)], dim=2)


def summary_scores(qs: torch.Tensor, w: torch.Tensor | None, summaries: torch.Tensor,
                   summary: str) -> torch.Tensor:
    """``qs [B, bq, HI, DI]`` (scaled queries), ``w [B, bq, HI]``, ``summaries [B, n, R, DI]``
    -> ``[B, bq, n]``: each block's score (``mean``) or upper bound of its keys' scores (``max``)."""
    w = torch.ones(qs.shape[:3], dtype=qs.dtype, device=qs.device) if w is None else w
    if summary == "mean":
        s = torch.einsum("bqhd,bnd->bqhn", qs, summaries[:, :, 0])
        return (s.clamp(min=0) * w[..., None]).sum(2)
    top, bottom = summaries[:, :, 0], summaries[:, :, 1]
    pos, neg = qs.clamp(min=0), qs.clamp(max=0)
    hi = torch.einsum("bqhd,bnd->bqhn", pos, top) + torch.einsum("bqhd,bnd->bqhn", neg, bottom)
    lo = torch.einsum("bqhd,bnd->bqhn", pos, bottom) + torch.einsum("bqhd,bnd->bqhn", neg, top)
    w = w[..., None]
    return torch.where(w >= 0, w * hi.clamp(min=0), w * lo.clamp(min=0)).sum(2)


@torch.no_grad()
@full_precision
def candidate_indexer(q_idx, k_idx, w_idx, topk: int, stage: Stage, scale: float,
                      keep_recent: int, offset: int, seeds: torch.Tensor | None,
                      summaries: torch.Tensor, block_q: int | None = None) -> torch.Tensor:
    """The top-k of each staged query's candidates: ``indices [B, Tq, topk]``, ascending, -1
    padded, for queries at ``offset .. offset + Tq``, all at or past ``stage.first_staged()``.
    ``block_q`` (None: 32) queries at a time: memory ``block_q * (blocks * block + local + Tk /
    block)``. The split before ``first_staged()``: :data:`staged_indexer`."""
    Tq = q_idx.shape[1]
    block_q = 32 if block_q is None else block_q
    out = torch.empty(*q_idx.shape[:2], topk, dtype=torch.long, device=q_idx.device)
    keys = k_idx.float()
    for q0 in range(0, Tq, block_q):
        rows = slice(q0, min(q0 + block_q, Tq))
        w = None if w_idx is None else w_idx[:, rows].float()
        pos = torch.arange(rows.start, rows.stop, device=q_idx.device) + offset
        qs = q_idx[:, rows].float() * scale
        cand = _candidates(qs, w, summaries, pos, stage, None if seeds is None else seeds[:, rows])
        out[:, rows] = _top(qs, w, keys, cand, pos, topk, keep_recent)
    return out


def _candidates(qs, w, summaries, pos, stage: Stage, seeds):
    """``[B, bq, C]`` candidate key positions of the queries at ``pos`` (-1: none), no repeats."""
    B, bq = qs.shape[:2]
    local0 = stage.local_start(pos)  # [bq]
    eligible = local0 // stage.block
    scores = summary_scores(qs, w, summaries, stage.summary)
    n = scores.shape[-1]
    blk = torch.arange(n, device=qs.device)
    key = _composite(scores, blk).masked_fill(blk >= eligible[:, None], _MIN_KEY)
    chosen = key.topk(min(stage.blocks, n), dim=-1).values & 0xFFFFFFFF  # [B, bq, blocks]
    spread = torch.arange(stage.block, device=qs.device)
    from_blocks = (chosen[..., None] * stage.block + spread).flatten(2)
    width = stage.local + stage.block
    local = local0[:, None] + torch.arange(width, device=qs.device)
    local = local.masked_fill(local > pos[:, None], -1).expand(B, bq, width)
    parts = [from_blocks, local]
    if seeds is not None and seeds.shape[-1]:
        s = seeds.long()
        covered = (s[..., None] // stage.block == chosen[..., None, :]).any(-1)
        covered |= s >= local0[:, None]
        parts.append(s.masked_fill(covered | (s < 0), -1))
    return torch.cat(parts, dim=-1)


def _top(qs, w, keys, cand, pos, topk: int, keep_recent: int):
    """The top ``topk`` of the candidates by exact index score, as the exact indexer orders them."""
    valid = cand >= 0
    k = _gather(keys, cand.clamp(min=0))  # [B, bq, C, DI]
    s = torch.einsum("bqhd,bqcd->bqhc", qs, k).clamp(min=0)
    s = s.sum(2) if w is None else (s * w[..., None]).sum(2)
    if keep_recent:
        s = s.masked_fill(cand > pos[:, None] - keep_recent, float("inf"))
    s = s.masked_fill(~valid, float("-inf"))
    best = _composite(s, cand.clamp(min=0)).masked_fill(~valid, _MIN_KEY)
    return _positions(best.topk(min(topk, cand.shape[-1]), dim=-1).values, topk)


staged_indexer = with_stage(dsa_indexer, block_summaries, candidate_indexer)


def seed_keys(tokens: torch.Tensor, offset: int, stage: Stage) -> torch.Tensor:
    """``tokens [B, Tk]`` -> the seeds of the queries at ``offset .. Tk``: ``[B, Tk - offset, S]``
    int32, -1 padded, ``S`` the largest count of any query (possibly 0); see the module docs. A
    function of the tokens up to each query only, so a streamed sequence gets the full pass's
    seeds. Plain Python (a dictionary of k-mer occurrences): the definition."""
    B, Tk = tokens.shape
    k, rows = stage.seed, []
    for b in range(B):
        seq = tokens[b].tolist()
        codes = [_code(seq[p - k + 1 : p + 1]) if k and p >= k - 1 else None for p in range(Tk)]
        seen: dict[tuple, list[int]] = {}
        for p, c in enumerate(codes):
            if c is not None:
                seen.setdefault(c, []).append(p)
        per_query = []
        for t in range(offset, Tk):
            local0 = int(stage.local_start(torch.tensor(t)))
            keys: list[int] = []
            for d in range(stage.carry + 1 if k else 0):
                u = t - d
                if u < 0 or len(keys) == stage.max_seeds:
                    break
                if codes[u] is None:
                    continue
                rc = tuple(3 - x for x in reversed(codes[u]))
                for code, key in ((codes[u], lambda e: e + 1 + d), (rc, lambda e: e - k - d)):
                    hits = seen.get(code, [])
                    for e in hits[: bisect.bisect_left(hits, u)][::-1][: stage.seed_cap]:
                        s = key(e)
                        if 0 <= s < local0 and s not in keys and len(keys) < stage.max_seeds:
                            keys.append(s)
            per_query.append(keys)
        rows.append(per_query)
    S = max((len(keys) for per_query in rows for keys in per_query), default=0)
    out = np.full((B, max(Tk - offset, 0), S), -1, dtype=np.int32)
    for b, per_query in enumerate(rows):
        for i, keys in enumerate(per_query):
            out[b, i, : len(keys)] = keys
    return torch.from_numpy(out).to(tokens.device)


def _code(bases: list[int]) -> tuple | None:
    return tuple(bases) if all(0 <= x <= 3 for x in bases) else None


def _block_scores(q, k, v, idx, scale):
    """Gathered keys/values and masked scores of one query block.

    ``q [B, bq, HQ, D]``, ``idx [B, bq, K]`` -> ``(ks, vs [B, bq, K, H, *], scores [B, bq, H, G, K])``.
    """
    B, bq, HQ, D = q.shape
    H = k.shape[2]
    ks, vs = _gather(k, idx.clamp(min=0)), _gather(v, idx.clamp(min=0))
    scores = torch.einsum("bqhgd,bqkhd->bqhgk", q.reshape(B, bq, H, HQ // H, D), ks) * scale
    return ks, vs, scores.masked_fill((idx < 0)[:, :, None, None, :], float("-inf"))


class _SparseAttention(torch.autograd.Function):
    """Block-by-block sparse softmax attention with a flash-style backward.

    Forward keeps only its inputs, the output and the log-sum-exp per query and head; backward
    re-gathers one block's keys at a time and adds its key/value gradients with ``index_add_``.
    Every temporary has one block's shape, and outputs go into buffers allocated once: nothing
    block-sized outlives its block (freed blocks are reused, the heap does not fragment).
    Inputs are fp32, ``q``/``idx`` padded to whole blocks.
    """

    @staticmethod
    def forward(ctx, q, k, v, idx, scale, block_q):
        B, Tq, HQ, _ = q.shape
        o = q.new_empty(B, Tq, HQ, v.shape[-1])
        lse = q.new_empty(B, Tq, HQ)
        probs = q.new_empty(B, Tq, idx.shape[-1])
        for q0 in range(0, Tq, block_q):
            rows = slice(q0, q0 + block_q)
            _, vs, scores = _block_scores(q[:, rows], k, v, idx[:, rows], scale)
            m = scores.logsumexp(-1)
            m = m.masked_fill(~torch.isfinite(m), 0.0)
            p = (scores - m[..., None]).exp()
            o[:, rows] = torch.einsum("bqhgk,bqkhd->bqhgd", p, vs).reshape(B, -1, HQ, v.shape[-1])
            lse[:, rows] = m.reshape(B, -1, HQ)
            ph = p.sum((2, 3))
            probs[:, rows] = ph / ph.sum(-1, keepdim=True).clamp_min(1e-30)
        ctx.save_for_backward(q, k, v, idx, o, lse)
        ctx.scale, ctx.block_q = scale, block_q
        ctx.mark_non_differentiable(probs)
        return o, probs

    @staticmethod
    @full_precision
    def backward(ctx, do, _dprobs):
        q, k, v, idx, o, lse = ctx.saved_tensors
        scale, block_q = ctx.scale, ctx.block_q
        B, Tq, HQ, D = q.shape
        Tk, H = k.shape[1], k.shape[2]
        G = HQ // H
        dq = torch.empty_like(q)
        dk = torch.zeros(B * Tk, H, D, dtype=k.dtype, device=k.device)
        dv = torch.zeros(B * Tk, H, v.shape[-1], dtype=v.dtype, device=v.device)
        base = torch.arange(B, device=q.device)[:, None, None] * Tk
        for q0 in range(0, Tq, block_q):
            rows = slice(q0, q0 + block_q)
            qb, ib = q[:, rows], idx[:, rows]
            ks, vs, scores = _block_scores(qb, k, v, ib, scale)
            bq = qb.shape[1]
            p = (scores - lse[:, rows].reshape(B, bq, H, G)[..., None]).exp()
            dob = do[:, rows].reshape(B, bq, H, G, -1)
            delta = (dob * o[:, rows].reshape(B, bq, H, G, -1)).sum(-1, keepdim=True)
            ds = p * (torch.einsum("bqhgd,bqkhd->bqhgk", dob, vs) - delta) * scale
            dq[:, rows] = torch.einsum("bqhgk,bqkhd->bqhgd", ds, ks).reshape(B, bq, HQ, D)
            flat = (ib.clamp(min=0) + base).reshape(-1)  # invalid slots carry zero gradient
            qg = qb.reshape(B, bq, H, G, D)
            dk.index_add_(0, flat, torch.einsum("bqhgk,bqhgd->bqkhd", ds, qg).reshape(-1, H, D))
            dv.index_add_(0, flat, torch.einsum("bqhgk,bqhgd->bqkhd", p, dob).reshape(-1, H, v.shape[-1]))
        return dq, dk.reshape(k.shape), dv.reshape(v.shape), None, None, None


class _GradInto(torch.autograd.Function):
    """``x [B, T, ...]`` unchanged; in the backward its gradient is added into ``buffer[:, :T]``
    and none goes back to ``x`` through autograd."""

    @staticmethod
    def forward(ctx, x, buffer):
        ctx.buffer = buffer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer[:, : grad.shape[1]] += grad
        return None, None


def grads_into(buffers, *keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``keys``, each of whose gradient the backward adds into its buffer ``[B, >= T, ...]``
    instead of returning it: the ``key_grads`` route of the sparse attention and the indexer
    loss in plain PyTorch, for every backend whose kernel does not add in place (the C kernels
    do; this form makes each full-length gradient first)."""
    on = torch.is_grad_enabled()
    return tuple(_GradInto.apply(x, buf) if on and x.requires_grad else x
                 for x, buf in zip(keys, buffers))


@full_precision
def sparse_attention(q, k, v, indices, scale=None, block_q: int = BLOCK_Q,
                     return_probs: bool = False):
    """Attention of each query over its selected keys only: ``o [B, Tq, HQ, DV]`` (dtype of q).

    ``k, v`` may hold more keys than there are queries (a streaming cache): ``indices`` index them.
    Computed ``block_q`` queries at a time; under autograd only the inputs, ``o`` and the
    log-sum-exp are kept. ``return_probs`` also returns the head-summed, L1-normalised attention
    over the selected keys ``[B, Tq, topk]`` (no gradient), the target of the sparse indexer loss.
    """
    HQ, H = q.shape[2], k.shape[2]
    if HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({H})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    Tq = q.shape[1]
    # fixed block shapes, as in the indexer: outputs never depend on the sequence length
    q_pad = _pad_rows(q.float(), block_q)
    idx_pad = torch.cat([indices, indices.new_zeros(indices.shape[0], q_pad.shape[1] - Tq,
                                                    indices.shape[2])], dim=1)
    o, probs = _SparseAttention.apply(q_pad, k.float(), v.float(), idx_pad, scale, block_q)
    o = o[:, :Tq].to(q.dtype)
    return (o, probs[:, :Tq]) if return_probs else o


@full_precision
def indexer_kl_sparse(q_idx, k_idx, w_idx, indices, target, scale=None,
                      block_q: int = KL_BLOCK_Q):
    """``KL(p || softmax(I))`` on each query's selected set, averaged over queries.

    ``target [B, T, topk]``: head-summed, L1-normalised main attention over the same selection.
    Pass ``q_idx/k_idx/w_idx`` computed from a detached layer input, so only the indexer learns.
    Computed ``block_q`` queries at a time (checkpointed under autograd): the gathered index keys
    of one block, never of the whole sequence, are alive at once.
    """
    scale = q_idx.shape[-1] ** -0.5 if scale is None else scale
    B, T = indices.shape[:2]
    total = q_idx.new_zeros((), dtype=torch.float)
    for q0 in range(0, T, block_q):
        rows = slice(q0, q0 + block_q)
        args = (q_idx[:, rows], k_idx, None if w_idx is None else w_idx[:, rows],
                indices[:, rows], target[:, rows], scale)
        if torch.is_grad_enabled() and T > block_q:
            total = total + checkpoint(_kl_block, *args, use_reentrant=False)
        else:
            total = total + _kl_block(*args)
    return total / max(B * T, 1)


def _kl_block(q_idx, k_idx, w_idx, indices, target, scale):
    """Summed sparse KL of one query block (see :func:`indexer_kl_sparse`)."""
    valid = indices >= 0
    ks = _gather(k_idx[:, :, None, :], indices.clamp(min=0))[:, :, :, 0]  # [B, bq, topk, DI]
    s = torch.relu(torch.einsum("bqhd,bqkd->bqhk", q_idx.float(), ks.float()) * scale)
    s = s.sum(2) if w_idx is None else torch.einsum("bqhk,bqh->bqk", s, w_idx.float())
    logq = s.masked_fill(~valid, float("-inf")).log_softmax(-1)
    p = target.masked_fill(~valid, 0.0)
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p)).sum()


@full_precision
def indexer_kl_dense(q, k, q_idx, k_idx, w_idx=None, scale=None, index_scale=None,
                     block_q: int = BLOCK_Q):
    """Dense warm-up loss ``KL(p_t || softmax(I_t))`` over all ``s <= t``, one query block at a time.

    ``p_t`` is the main heads' causal attention (detached), head-summed and L1-normalised. Memory per
    block: ``block_q * T`` scores; use on warm-up lengths, not at 1M tokens.
    """
    B, T, HQ, D = q.shape
    H = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    index_scale = q_idx.shape[-1] ** -0.5 if index_scale is None else index_scale
    keys = torch.arange(T, device=q.device)
    total = q.new_zeros((), dtype=torch.float)
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        causal = keys[None, :] <= torch.arange(q0, q1, device=q.device)[:, None]
        with torch.no_grad():
            qg = q[:, q0:q1].float().reshape(B, q1 - q0, H, HQ // H, D)
            att = torch.einsum("bqhgd,bkhd->bqhgk", qg, k.float()) * scale
            att = att.masked_fill(~causal[None, :, None, None], float("-inf")).softmax(-1)
            p = att.sum((2, 3))
            p = p / p.sum(-1, keepdim=True)
        s = index_scores(q_idx[:, q0:q1], k_idx, None if w_idx is None else w_idx[:, q0:q1],
                         index_scale)
        logq = s.masked_fill(~causal[None], float("-inf")).log_softmax(-1)
        kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p))
        total = total + kl.sum()
    return total / (B * T)
