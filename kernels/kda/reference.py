"""Kimi Delta Attention in plain PyTorch: the recurrent definition and the chunkwise (UT transform) form.

Both take ``fla.ops.kda`` conventions::

    q, k  [B, T, H, K]     v  [B, T, HV, V]     g (log-decay, <= 0)  [B, T, HV, K]
    beta  [B, T, HV]       initial_state / final_state  [B, HV, K, V] (fp32)

``HV`` must be a multiple of ``H`` (grouped value heads). Per value head, with ``D_t = Diag(exp g_t)``::

    S' = D_t S ;  S = S' + beta_t k_t (v_t - S'^T k_t)^T ;  o_t = S^T q_t * scale

:func:`kda_recurrent` is that loop and nothing else: the oracle. :func:`kda_chunk` computes the same
thing 64 tokens at a time: with ``Gamma`` the within-chunk cumulative log-decay,
``L[i, j] = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd)`` (``j < i``), ``T = (I + L)^-1``,
``W = T beta (exp(Gamma) * K)`` and ``U = T beta V``, each chunk is a few matmuls and only the
``[K, V]`` state is carried from chunk to chunk. Decay products are formed so that no exponent is
ever positive (no overflow for any ``g <= 0``). Long sequences are processed in checkpointed segments,
so autograd keeps O(T * (K + V)) activations instead of O(T * chunk * K).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megabase.kernels.precision import full_precision

CHUNK = 64
SUB = 16
FRAME = 64  # chunks computed together: a fixed shape, so results never depend on the sequence length
# Up to WHOLE tokens run as one piece with nothing recomputed (the fastest form); longer sequences
# run in checkpointed SEGMENT-token pieces, so what does not grow with T stays small. Peak live
# tensors of a cpu-small step at 65,536 tokens with recompute=layer: 2.16 GiB with 32,768-token
# pieces, 1.38 GiB with 8,192, 1.27 GiB with 4,096 (one frame), at the same speed.
WHOLE = 32768
SEGMENT = 4096


def _expand(q, k, v, g, beta, scale):
    """fp32, value-head layout ``[B, HV, T, *]``; q pre-scaled."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    scale = K**-0.5 if scale is None else scale
    q = q.float().repeat_interleave(HV // H, dim=2) * scale
    k = k.float().repeat_interleave(HV // H, dim=2)
    return [x.transpose(1, 2) for x in (q, k, v.float(), g.float(), beta.float())]


@full_precision
def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token KDA; returns ``(o [B, T, HV, V], final_state [B, HV, K, V] or None)``."""
    dtype = v.dtype
    q, k, v, g, beta = _expand(q, k, v, g, beta, scale)
    B, HV, T, K = q.shape
    S = q.new_zeros(B, HV, K, v.shape[-1])
    if initial_state is not None:
        S = S + initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, :, t, :, None].exp()
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, :, t, None] * k[:, :, t], err)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, v.shape[-1])
    return o.to(dtype), (S if output_final_state else None)


SAFE_EXP = 40.0


def _decay_products(a, b, gam, inclusive: bool):
    """``P[i, j] = sum_d a_id b_jd exp(gam_id - gam_jd)`` for ``j < i`` (``<=`` if inclusive), else 0.

    ``a, b``: ``[..., C, K]`` fp32; ``gam``: same shape, fp64, non-increasing along C. Returns
    ``[..., C, C]`` fp32.
    Off-diagonal sub-blocks factor through the boundary between them (both factors <= 1). Diagonal
    sub-blocks factor through their midpoint when no factor can exceed ``exp(SAFE_EXP)`` (always,
    for the model's gate with lower bound -5 and 16-token sub-blocks); otherwise they are formed
    pairwise with the upper triangle masked before ``exp``.
    """
    C = a.shape[-2]
    s = SUB if C % SUB == 0 else C
    nb = C // s
    shape = (*a.shape[:-2], nb, s, a.shape[-1])
    A, Bb, G = a.reshape(shape), b.reshape(shape), gam.reshape(shape)
    mask = torch.ones(s, s, dtype=torch.bool, device=a.device).tril(0 if inclusive else -1)
    mid = G[..., s // 2 : s // 2 + 1, :]
    span = torch.maximum(G[..., :1, :] - mid, mid - G[..., -1:, :])
    if float(span.detach().amax()) <= SAFE_EXP:
        diag = (A * (G - mid).float().exp()) @ (Bb * (mid - G).float().exp()).transpose(-1, -2)
        diag = diag.masked_fill(~mask, 0.0)
    else:
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~mask[:, :, None], float("-inf"))
        diag = (A[..., :, None, :] * Bb[..., None, :, :] * diff.float().exp()).sum(-1)
    if nb == 1:
        return diag.reshape(*a.shape[:-1], C)
    # Sub-block (i, j), i > j, factors through the last row of sub-block j; all pairs are formed at
    # once (one batched product) and the upper ones discarded. Exponents are clamped at 0 so the
    # discarded pairs cannot overflow; the kept ones are <= 0 already.
    ref = G[..., -1:, :]  # [..., nb, 1, K]
    gap = (G[..., :, None, :, :] - ref[..., None, :, :, :]).clamp(max=0)
    left = A[..., :, None, :, :] * gap.float().exp()
    right = Bb * (ref - G).float().exp()  # [..., nb, s, K]
    pairs = left @ right[..., None, :, :, :].transpose(-1, -2)  # [..., nb_i, nb_j, s, s]
    blocks = torch.arange(nb, device=a.device)
    lower = (blocks[:, None] > blocks[None, :]).to(pairs.dtype)[:, :, None, None]
    eye = torch.eye(nb, dtype=pairs.dtype, device=a.device)[:, :, None, None]
    full = pairs * lower + diag[..., :, None, :, :] * eye
    return full.transpose(-3, -2).reshape(*a.shape[:-1], C)


def _segment(q, k, v, g, beta, state, chunk: int, output: bool = True):
    """One segment ``[B, HV, Ts, *]`` (Ts a multiple of ``FRAME * chunk``); returns (o, state),
    ``o`` None without ``output``."""
    outs = []
    step = FRAME * chunk
    # split, not slices: a slice's backward zero-fills the whole input once per frame
    for frame in zip(*(x.split(step, dim=2) for x in (q, k, v, g, beta))):
        # contiguous: strides of a slice depend on T, and kernels pick code paths by stride
        o, state = _frame(*(x.contiguous() for x in frame), state.contiguous(), chunk, output)
        outs.append(o)
    return (torch.cat(outs, dim=2) if output else None), state


def _frame(q, k, v, g, beta, state, chunk: int, output: bool = True):
    """``FRAME`` chunks ``[B, HV, FRAME * chunk, *]`` from ``state``; returns (o or None, state)."""
    B, HV, Ts, K = q.shape
    n = Ts // chunk
    q, k, v, g = (x.reshape(B, HV, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, HV, n, chunk, 1)
    # fp64 cumulative decay: exponents are differences of large sums, which fp32 would round.
    gam = g.double().cumsum(-2)
    L = beta * _decay_products(k, k, gam, inclusive=False)
    eye = torch.eye(chunk, device=q.device, dtype=q.dtype)
    rhs = torch.cat([beta * v, beta * gam.float().exp() * k], dim=-1)
    UW = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    U, W = UW[..., : v.shape[-1]], UW[..., v.shape[-1] :]
    kd = (k * (gam[..., -1:, :] - gam).float().exp()).transpose(-1, -2)
    # Chunk to chunk: S' = (Diag(last) - kd W) S + kd U; only this recurrence is sequential.
    last = gam[..., -1, :].float().exp()
    decay = torch.diag_embed(last) - kd @ W
    inject = kd @ U
    states = []
    # unbind once: indexing chunk by chunk would make autograd zero-fill the whole tensor per chunk
    for dec, inj in zip(decay.unbind(2), inject.unbind(2)):
        states.append(state)
        state = torch.baddbmm(inj.flatten(0, 1), dec.flatten(0, 1), state.flatten(0, 1)).view_as(state)
    if not output:
        return None, state
    S = torch.stack(states, dim=2)
    Aqk = _decay_products(q, k, gam, inclusive=True)
    o = (q * gam.float().exp()) @ S + Aqk @ (U - W @ S)
    return o.reshape(B, HV, Ts, -1), state


@full_precision
def kda_chunk(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    chunk_size: int = CHUNK, segment: int | None = None, output: bool = True,
):
    """Chunkwise KDA, same contract as :func:`kda_recurrent`; any T, autograd-correct.
    With ``output=False`` only the final state is computed (``o`` is None).

    Work is done in frames of ``FRAME`` chunks (T is zero-padded to whole frames): every batched
    product has one shape whatever T is, so an output is bit-for-bit independent of how much
    sequence follows it. ``segment`` tokens (whole frames) are computed at a time; with gradients
    enabled each segment is checkpointed, so only segment inputs and boundary states are kept.
    Default: the whole sequence up to ``WHOLE`` tokens, else ``SEGMENT``-token segments.
    """
    dtype = v.dtype
    B, T, H, K = q.shape
    q, k, v, g, beta = _expand(q, k, v, g, beta, scale)
    HV, V = v.shape[1], v.shape[-1]
    pad = (-T) % (FRAME * chunk_size)
    if pad:  # zero k, beta, g: padded steps neither decay nor update the state
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    state = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        state = state + initial_state.float()
    frame = FRAME * chunk_size
    if segment is None:
        segment = T + pad if T + pad <= WHOLE else SEGMENT
    seg = max(frame, segment - segment % frame)
    outs = []
    for args in zip(*(x.split(seg, dim=2) for x in (q, k, v, g, beta))) if T + pad else ():
        if torch.is_grad_enabled() and T + pad > seg:
            o, state = checkpoint(_segment, *args, state, chunk_size, output, use_reentrant=False)
        else:
            o, state = _segment(*args, state, chunk_size, output)
        outs.append(o)
    if not output:
        return None, (state if output_final_state else None)
    o = torch.cat(outs, dim=2)[:, :, :T] if outs else v.new_zeros(B, HV, 0, V)
    return o.transpose(1, 2).to(dtype), (state if output_final_state else None)
